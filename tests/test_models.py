"""Our models against HF transformers: prefill, incremental decode and tree steps."""

from __future__ import annotations

import pytest
import torch

from specinfer.loader import load_model

transformers = pytest.importorskip("transformers")

TOL = 1e-4
SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
LLAMA = dict(SMALL, intermediate_size=128, max_position_embeddings=256, initializer_range=0.1)
OPT = dict(SMALL, ffn_dim=128, max_position_embeddings=64, init_std=0.1, pad_token_id=1)
CONFIGS = {
    "llama-gqa": lambda: transformers.LlamaConfig(**LLAMA, num_key_value_heads=2),
    "llama-mha-tied": lambda: transformers.LlamaConfig(
        **LLAMA, num_key_value_heads=4, tie_word_embeddings=True
    ),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **LLAMA,
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama-linear-rope": lambda: transformers.LlamaConfig(
        **LLAMA, num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "opt-pre-ln": lambda: transformers.OPTConfig(**OPT),
    "opt-post-ln": lambda: transformers.OPTConfig(**OPT, do_layer_norm_before=False),
    "opt-proj-untied": lambda: transformers.OPTConfig(
        **OPT, word_embed_proj_dim=32, tie_word_embeddings=False
    ),
}


def build_pair(name, tmp_path, dtype=torch.float32):
    """A random HF model saved as safetensors, and ours loaded from the same files."""
    config = CONFIGS[name]()
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: perturb them to test them
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf, load_model(tmp_path, dtype=dtype)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def step(model, kv, ids, positions, prefix_lens, tree_mask) -> torch.Tensor:
    rows = torch.arange(len(ids))
    with torch.no_grad():
        hidden = model(
            torch.tensor(ids), torch.tensor(positions), kv, rows, torch.tensor(prefix_lens),
            tree_mask,
        )  # fmt: skip
        return model.compute_logits(hidden)


PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [11, 250, 0, 64]]


def prefill(model, kv):
    """Both prompts in one batch, the shorter padded; padding slots get overwritten later."""
    T = max(map(len, PROMPTS))
    ids = [p + [0] * (T - len(p)) for p in PROMPTS]
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(len(PROMPTS), T, T)
    return step(model, kv, ids, [list(range(T))] * len(PROMPTS), [0] * len(PROMPTS), causal)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_matches_hf(name, tmp_path):
    hf, model = build_pair(name, tmp_path)
    kv = model.make_kv_cache(rows=len(PROMPTS), max_seq_len=32)
    logits = prefill(model, kv)
    seqs = [list(p) for p in PROMPTS]
    for b, p in enumerate(PROMPTS):
        ref = hf_logits(hf, p)
        assert ref.abs().max() > 0.1  # the comparison below is not vacuous
        torch.testing.assert_close(logits[b, : len(p)], ref, atol=TOL, rtol=0)
    last = torch.stack([logits[b, len(p) - 1] for b, p in enumerate(PROMPTS)])
    for _ in range(4):  # greedy, each request at its own position
        nxt = last.argmax(-1).tolist()
        lens = [len(s) for s in seqs]
        ones = torch.ones(len(seqs), 1, 1, dtype=torch.bool)
        last = step(model, kv, [[t] for t in nxt], [[n] for n in lens], lens, ones)[:, 0]
        for b, s in enumerate(seqs):
            s.append(nxt[b])
            torch.testing.assert_close(last[b], hf_logits(hf, s)[-1], atol=TOL, rtol=0)


def tree_mask(parents: list[int]) -> tuple[torch.Tensor, list[int]]:
    """mask[i, j]: j is i or an ancestor of i; and each node's depth."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask, depth


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_step_matches_hf_per_path(name, tmp_path):
    hf, model = build_pair(name, tmp_path)
    kv = model.make_kv_cache(rows=len(PROMPTS), max_seq_len=32)
    prefill(model, kv)
    parents = [-1, 0, 0, 1, 2, 2, 4]  # branches at nodes 0 and 2
    mask, depth = tree_mask(parents)
    tokens = [[9, 30, 31, 77, 120, 121, 5], [1, 2, 3, 4, 5, 6, 7]]
    lens = [len(p) for p in PROMPTS]
    positions = [[n + d for d in depth] for n in lens]
    logits = step(model, kv, tokens, positions, lens, mask.expand(2, -1, -1))
    for b, prompt in enumerate(PROMPTS):
        for i in range(len(parents)):
            path, node = [], i
            while node >= 0:
                path.insert(0, tokens[b][node])
                node = parents[node]
            ref = hf_logits(hf, prompt + path)[-1]
            torch.testing.assert_close(logits[b, i], ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["llama-gqa"])
def test_bf16_close_to_fp32(name, tmp_path):
    _, ours32 = build_pair(name, tmp_path)
    ours16 = load_model(tmp_path, dtype=torch.bfloat16)
    assert ours16.lm_head.weight.dtype == torch.bfloat16
    logits32 = prefill(ours32, ours32.make_kv_cache(2, 32))
    logits16 = prefill(ours16, ours16.make_kv_cache(2, 32))
    assert logits16.dtype == torch.float32
    scale = logits32.abs().max()
    assert (logits16 - logits32).abs().max() < 0.05 * scale


def test_smollm2_gguf_matches_transformers(smollm_gguf):
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    model = load_model(smollm_gguf)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm_gguf.parent, gguf_file=smollm_gguf.name, dtype=torch.float32
    ).eval()
    prompts = [[1, 504, 3458, 282, 4649, 314, 253, 1345, 30], [1, 9690, 198, 2683, 359, 2]]
    kv = model.make_kv_cache(1, 64)
    for prompt in prompts:
        T = len(prompt)
        causal = torch.ones(1, T, T, dtype=torch.bool).tril()
        logits = step(model, kv, [prompt], [list(range(T))], [0], causal)[0]
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=TOL, rtol=0)


def _tensor_parallel_worker(rank, world, tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        model = load_model(tmp_path)
        assert model.lm_head.weight.shape[0] == model.config.vocab_size // world
        logits = prefill(model, model.make_kv_cache(len(PROMPTS), 32))
        if rank == 0:
            torch.save(logits, tmp_path / "tp_logits.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["llama-gqa", "opt-proj-untied"])
def test_tensor_parallel_world_2_matches_world_1(name, tmp_path):
    _, model = build_pair(name, tmp_path)
    expected = prefill(model, model.make_kv_cache(len(PROMPTS), 32))
    torch.multiprocessing.spawn(_tensor_parallel_worker, args=(2, tmp_path), nprocs=2)
    got = torch.load(tmp_path / "tp_logits.pt")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
