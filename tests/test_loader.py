"""Loader: HF directories (single and sharded), GGUF files (quant types), and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specinfer.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=64,
    initializer_range=0.1,
    architectures=["LlamaForCausalLM"],
)


def tiny_llama(tie: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


def logits_of(model, ids: list[int]) -> torch.Tensor:
    T = len(ids)
    kv = model.make_kv_cache(1, T)
    zero = torch.zeros(1, dtype=torch.long)
    mask = torch.ones(1, T, T, dtype=torch.bool).tril()
    with torch.no_grad():
        h = model(torch.tensor([ids]), torch.arange(T)[None], kv, zero, zero, mask)
        return model.compute_logits(h)[0]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


IDS = [3, 141, 59, 26, 5, 35, 89, 79]


def test_sharded_checkpoint_with_index(tmp_path):
    hf = tiny_llama()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    torch.testing.assert_close(
        logits_of(load_model(tmp_path), IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0
    )


def test_a_model_is_built_in_the_dtype_it_runs_in(tmp_path, monkeypatch):
    """Its weights are made bfloat16, not float32 and converted; the rotary tables (buffers,
    computed in float32) are converted; the weights equal float32 weights rounded."""
    hf = tiny_llama()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(k.get("dtype")) or
                        real_empty(*a, **k))  # fmt: skip
    model = load_model(tmp_path, dtype=torch.bfloat16)
    monkeypatch.undo()
    assert made and set(made) == {torch.bfloat16}, made
    assert {t.dtype for t in [*model.parameters(), *model.buffers()]} == {torch.bfloat16}
    full = load_model(tmp_path)  # outside a build, parameters are float32 again
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    for (name, p), q in zip(model.named_parameters(), full.parameters()):
        assert torch.equal(p, q.to(torch.bfloat16)), name


def test_missing_path_config_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama().config.to_dict()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(tmp_path)


def test_unsupported_rope_scaling(tmp_path):
    config = dict(tiny_llama().config.to_dict(), rope_scaling={"rope_type": "yarn", "factor": 2.0})
    config.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="yarn"):
        load_model(tmp_path)


def break_checkpoint(tmp_path, edit):
    tiny_llama().save_pretrained(tmp_path, safe_serialization=True)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    break_checkpoint(tmp_path, lambda t: t.update({name: torch.zeros(64, 64)}))
    with pytest.raises(ValueError, match=rf"{name}.*\(32, 64\).*\(64, 64\)"):
        load_model(tmp_path)


def test_missing_tensors_are_listed(tmp_path):
    def drop(t):
        del t["model.layers.0.mlp.up_proj.weight"], t["model.norm.weight"]

    break_checkpoint(tmp_path, drop)
    with pytest.raises(ValueError, match="missing") as err:
        load_model(tmp_path)
    assert "model.norm.weight" in str(err.value) and "gate_up_proj" in str(err.value)


def test_unexpected_tensor(tmp_path):
    break_checkpoint(tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="model.extra.weight"):
        load_model(tmp_path)


# --- GGUF -------------------------------------------------------------------------------------

GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.{kind}"
    return f"{GGUF_NAMES[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (its RoPE pairs adjacent dims)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, hf, qtype, arch="llama", extra=None):
    """Convert `hf` as llama.cpp would: matrices as `qtype`, norms F32. Returns, per HF name,
    the weight the file really holds (after the quantisation round trip)."""
    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    stored = {}
    for name, t in hf.state_dict().items():
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        data = t.numpy()
        if data.ndim == 2:
            data = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
            stored[name] = torch.from_numpy(data.copy())
            if "q_proj" in name:
                data = llama_cpp_permute(data, c.num_attention_heads)
            elif "k_proj" in name:
                data = llama_cpp_permute(data, c.num_key_value_heads)
            q = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
            w.add_tensor(gguf_name(name), q, raw_dtype=qtype if q.dtype == np.uint8 else None)
        else:
            stored[name] = t.clone()
            w.add_tensor(gguf_name(name), data)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("tie", [False, True])
def test_gguf_quant_types_load_exactly(tmp_path, qtype, tie):
    hf = tiny_llama(tie)
    stored = write_gguf(tmp_path / "m.gguf", hf, qtype)
    hf.load_state_dict(stored, strict=False)  # HF now holds exactly what the file holds
    model = load_model(tmp_path / "m.gguf")
    assert model.config.tie_word_embeddings == tie
    assert model.config.num_kv_heads == 2 and model.config.intermediate_size == 128
    torch.testing.assert_close(logits_of(model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_gguf_unsupported_quant_type_names_tensor(tmp_path):
    extra = {"blk.0.attn_q.bias": np.zeros(64, dtype=np.int8)}
    write_gguf(tmp_path / "m.gguf", tiny_llama(), Q.F32, extra=extra)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.bias.*I8"):
        load_model(tmp_path / "m.gguf")


def test_gguf_unsupported_architecture(tmp_path):
    write_gguf(tmp_path / "m.gguf", tiny_llama(), Q.F32, arch="gpt2")
    with pytest.raises(ValueError, match="gpt2"):
        load_model(tmp_path / "m.gguf")


def test_not_a_model_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="weights.bin"):
        load_model(tmp_path / "weights.bin")


def test_opt_checkpoint_without_model_prefix(tmp_path):
    """Original OPT checkpoints name tensors `decoder.*`, without HF's `model.` prefix."""
    config = transformers.OPTConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
        max_position_embeddings=64, architectures=["OPTForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.OPTForCausalLM(config).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file(
        {k.removeprefix("model."): v for k, v in tensors.items()}, tmp_path / "model.safetensors"
    )
    assert any(k.startswith("decoder.") for k in load_file(tmp_path / "model.safetensors"))
    torch.testing.assert_close(
        logits_of(load_model(tmp_path), IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0
    )


def test_gguf_rope_freqs_reproduce_llama3_scaling(tmp_path):
    """Llama 3.1 GGUFs carry RoPE scaling as per-frequency divisors (`rope_freqs.weight`)."""
    torch.manual_seed(0)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**TINY, rope_scaling=scaling)
    ).eval()
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    plain = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    factors = (plain / hf.model.rotary_emb.inv_freq).numpy()
    assert factors.max() > 2  # the scaling matters at these positions
    write_gguf(tmp_path / "m.gguf", hf, Q.F32, extra={"rope_freqs.weight": factors})
    ids = IDS * 3  # long enough to reach the scaled wavelengths
    torch.testing.assert_close(
        logits_of(load_model(tmp_path / "m.gguf"), ids), hf_logits(hf, ids), atol=1e-4, rtol=0
    )


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("tie", [False, True])
def test_a_gguf_file_is_converted_once_and_loads_as_read_directly(tmp_path, monkeypatch, tie):
    import specinfer.loader as loader

    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    factors = np.linspace(1.0, 4.0, 8, dtype=np.float32)  # rope_scaling goes through the config
    write_gguf(path, tiny_llama(tie), Q.Q4_1, extra={"rope_freqs.weight": factors})
    monkeypatch.setenv("SPECINFER_GGUF_CACHE", "0")
    direct = {dtype: load_model(path, dtype) for dtype in (torch.float32, torch.bfloat16)}
    assert not cache.exists()
    monkeypatch.setenv("SPECINFER_GGUF_CACHE", str(cache))
    first = load_model(path)
    [converted] = cache.iterdir()
    assert sorted(f.name for f in converted.iterdir()) == [
        "config.json", "tensors.safetensors", "tokenizer_gguf.json"]  # fmt: skip

    def read_again(path):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(loader, "_read_gguf", read_again)
    for dtype, model in [(torch.float32, first)] + [(d, load_model(path, d)) for d in direct]:
        assert model.config == direct[dtype].config and model.config.rope_scaling["factors"]
        assert _same_weights(model, direct[dtype]), dtype
    assert list(cache.iterdir()) == [converted]


def test_a_changed_gguf_file_is_converted_again_in_place_of_its_old_conversion(
    tmp_path, monkeypatch
):
    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    monkeypatch.setenv("SPECINFER_GGUF_CACHE", str(cache))
    write_gguf(path, tiny_llama(tie=False), Q.F32)
    assert not load_model(path).config.tie_word_embeddings
    [old] = cache.iterdir()
    write_gguf(path, tiny_llama(tie=True), Q.F32)
    assert load_model(path).config.tie_word_embeddings
    [new] = cache.iterdir()
    assert new != old


def test_a_cache_that_cannot_be_written_leaves_the_gguf_file_read_directly(tmp_path, monkeypatch):
    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_gguf(path, tiny_llama(), Q.Q8_0)
    cache.write_text("a file where the cache directory would be")
    monkeypatch.setenv("SPECINFER_GGUF_CACHE", str(cache))
    with pytest.warns(UserWarning, match="could not cache m.gguf"):
        model = load_model(path)
    monkeypatch.setenv("SPECINFER_GGUF_CACHE", "0")
    assert _same_weights(model, load_model(path))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_a_gguf_file_too_large_to_convert_is_read_directly(tmp_path, monkeypatch):
    import specinfer.loader as loader

    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_gguf(path, tiny_llama(), Q.Q4_0)
    monkeypatch.setenv("SPECINFER_GGUF_CACHE", str(cache))
    weights = 4 * sum(p.numel() for p in tiny_llama().parameters())
    monkeypatch.setattr(loader, "MAX_CONVERTED_BYTES", weights // 2)
    model = load_model(path)
    assert not cache.exists()
    monkeypatch.setattr(loader, "MAX_CONVERTED_BYTES", weights)
    assert _same_weights(model, load_model(path)) and len(list(cache.iterdir())) == 1


def test_a_half_written_conversion_is_removed_once_a_day_old(tmp_path, monkeypatch):
    import os
    import time

    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_gguf(path, tiny_llama(), Q.F32)
    monkeypatch.setenv("SPECINFER_GGUF_CACHE", str(cache))
    old, young = cache / ".m-0123456789abcdef-ab12cd_4", cache / ".m-0123456789abcdef-ef56gh78"
    other = cache / ".not-a-conversion"  # never ours to remove, however old
    for partial in (old, young, other):
        partial.mkdir(parents=True)
        (partial / "tensors.safetensors").write_bytes(b"half")
    two_days_ago = time.time() - 2 * 24 * 3600
    for partial in (old, other):
        os.utime(partial, (two_days_ago, two_days_ago))
    load_model(path)
    assert young.is_dir() and other.is_dir() and not old.exists()
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1
