"""Greedy tree and sequence speculation on SmolLM2 (fp32) are token-identical to incremental
decoding (which test_generation_vs_hf.py holds equal to HF transformers).

The only tolerated divergence is a genuine near-tie: at the first differing token the target's
top-2 logits (for the reference prefix) are within 1e-4; each such case is reported, and a run
may have at most one per 8 prompts (at least one).
The fast run covers a few prompts; --runslow runs 30 prompts x 128 tokens per configuration.
"""

import pytest
import torch

from specinfer import Engine, SamplingParams
from test_generation_vs_hf import CHATS, WRITTEN, _stdlib_prompts

NEAR_TIE = 1e-4


def _more_stdlib_prompts() -> list[str]:
    import heapq  # noqa: E401
    import itertools
    import re
    import shutil
    import statistics

    objs = [heapq.heappush, itertools.groupby, re.sub, shutil.copytree, statistics.median,
            str.format, list.sort, dict.get, range, enumerate]  # fmt: skip
    return [(o.__doc__ or "")[:300] for o in objs]


@pytest.fixture(scope="module")
def incremental(smollm_gguf):
    return Engine(smollm_gguf, dtype="float32", max_batch_size=30)


def _top2_gap(engine: Engine, ids: list[int]) -> tuple[float, list[int]]:
    model, T = engine.model, len(ids)
    kv = model.make_kv_cache(1, T)
    hidden = model(torch.tensor([ids]), torch.arange(T)[None], kv, torch.tensor([0]), torch.tensor([0]),
                   torch.ones(1, T, T, dtype=torch.bool).tril())  # fmt: skip
    top2 = torch.topk(model.compute_logits(hidden[0, -1]), 2)
    return (top2.values[0] - top2.values[1]).item(), top2.indices.tolist()


_references: dict = {}  # (prompts, tokens) -> incremental completions, shared by all configs


def _reference(incremental: Engine, prompts: list, tokens: int) -> list:
    key = (repr(prompts), tokens)
    if key not in _references:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        _references[key] = incremental.generate(prompts, params)
    return _references[key]


def _check(
    incremental: Engine, spec: Engine, prompts: list, tokens: int, max_ties: int | None = None
) -> list[str]:
    """Every output equals incremental decoding's but for at most max_ties genuine near-ties
    (default: one per 8 prompts, at least one); each tie is printed."""
    max_ties = max(1, len(prompts) // 8) if max_ties is None else max_ties
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    reference = _reference(incremental, prompts, tokens)
    outs = spec.generate(prompts, params)
    ties = []
    for i, (ref, out) in enumerate(zip(reference, outs)):
        split = next(
            (j for j, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b), None
        )
        if split is None:
            assert len(out.token_ids) == len(ref.token_ids) == tokens
            continue
        prefix = incremental.prompt_ids(prompts[i]) + ref.token_ids[:split]
        gap, top2 = _top2_gap(incremental, prefix)
        assert gap < NEAR_TIE and out.token_ids[split] in top2, (
            f"prompt {i} diverged at token {split}: {out.token_ids[split]} vs {ref.token_ids[split]}, gap {gap:.1e}"
        )
        ties.append(f"prompt {i}: near-tie at token {split} (gap {gap:.1e})")
        print(f"\n  {ties[-1]}")
    assert len(ties) <= max_ties, f"{len(ties)} near-ties, at most {max_ties} allowed: {ties}"
    return ties


CONFIGS = [
    ("tree", "1,1,3,1"),
    ("tree", "2,2,1"),
    ("sequence", "1,1,1,1"),
    ("tree", "1,1,3,1,1,1,1,1"),
]


@pytest.mark.parametrize(
    "mode, tree, batch", [("tree", "1,1,3,1", 4), ("tree", "2,2,1", 1), ("sequence", "1,1,1,1", 4)]
)
def test_speculation_is_lossless_on_smollm2(smollm_gguf, incremental, mode, tree, batch):
    spec = Engine(
        smollm_gguf, dtype="float32", ssm="layers:4", tree=tree, mode=mode, max_batch_size=batch
    )
    prompts = (WRITTEN + CHATS)[:4] if batch > 1 else WRITTEN[:2]
    ties = _check(incremental, spec, prompts, 16)
    print(f"\n{mode} {tree} batch {batch}: near-ties {len(ties)}", *ties, sep="\n  ")


def test_merged_ssm_and_ngram_are_lossless_on_smollm2(smollm_gguf, incremental):
    # The layer-selected SSM's LM head restricted to the first 8192 token ids (the other tests
    # use the full head).
    spec = Engine(smollm_gguf, dtype="float32", ssm=["layers:2", "ngram"], tree="1,1,3,1",
                  ssm_head=8192, max_batch_size=2)  # fmt: skip
    prompts = (WRITTEN + CHATS)[:4]
    ties = _check(incremental, spec, prompts, 16)
    print(f"\nlayers:2 + ngram, batch 2: near-ties {len(ties)}", *ties, sep="\n  ")


def test_a_perfect_ssm_accepts_whole_paths(smollm_gguf, incremental):
    # The target as its own SSM: deep accepted paths exercise the depth-first commit. Whole
    # trees: drafting with the target costs more than it gains, so the cut would stop it. Its
    # weights as loaded: 8-bit drafts (ssm_int8) would no longer be the target's.
    spec = Engine(smollm_gguf, dtype="float32", ssm=smollm_gguf, tree="1,2,1", max_batch_size=2,
                  adaptive_tree=False, ssm_int8=False)  # fmt: skip
    ties = _check(incremental, spec, WRITTEN[:2], 16)
    out = spec.generate(WRITTEN[0], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out.metrics["tokens_per_step"] > 3.0  # depth 3 + the bonus token, minus near-ties
    print(f"\nperfect SSM: near-ties {len(ties)}", *ties, sep="\n  ")


@pytest.mark.slow
@pytest.mark.parametrize("batch", [4, 1])
@pytest.mark.parametrize("mode, tree", CONFIGS)
def test_speculation_is_lossless_on_smollm2_30x128(smollm_gguf, incremental, mode, tree, batch):
    spec = Engine(
        smollm_gguf, dtype="float32", ssm="layers:4", tree=tree, mode=mode, max_batch_size=batch
    )
    prompts = WRITTEN + CHATS + _stdlib_prompts(10) + _more_stdlib_prompts()
    assert len(prompts) == 30
    ties = _check(incremental, spec, prompts, 128)
    print(f"\n{mode} {tree} batch {batch}, 30 x 128: near-ties {len(ties)}", *ties, sep="\n  ")


def test_the_shipped_default_ssm_is_lossless(smollm_gguf, incremental):
    spec = Engine(smollm_gguf, dtype="float32", ssm=["default", "ngram"], max_batch_size=2)
    ties = _check(incremental, spec, CHATS[:2], 24)
    print(f"\ndefault SSM + ngram: near-ties {len(ties)}", *ties, sep="\n  ")


def test_the_shipped_feature_head_is_lossless(smollm_gguf, incremental):
    spec = Engine(smollm_gguf, dtype="float32", ssm=["feature", "ngram"], max_batch_size=2)
    ties = _check(incremental, spec, CHATS[:2], 24)
    print(f"\nfeature head + ngram: near-ties {len(ties)}", *ties, sep="\n  ")


@pytest.mark.slow
@pytest.mark.parametrize("ssm", [["feature"], ["feature", "default", "ngram"]])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_feature_head_is_lossless_30x128(smollm_gguf, incremental, ssm, dtype):
    """The shipped feature head alone and merged, cut by the budget, at batch 4; bfloat16 with
    no near-tie allowance (see test_bfloat16_speculation_is_bit_exact)."""
    spec = Engine(smollm_gguf, dtype=dtype, ssm=ssm, max_batch_size=4)
    prompts = WRITTEN + CHATS + _stdlib_prompts(10) + _more_stdlib_prompts()
    if dtype == "float32":
        ties = _check(incremental, spec, prompts, 128)
        print(f"\n{ssm} 30 x 128: near-ties {len(ties)}", *ties, sep="\n  ")
        return
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    reference = Engine(smollm_gguf, dtype=dtype, max_batch_size=4).generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert sum(o.metrics["per_ssm"][0]["accepted"] for o in outs) > 0


@pytest.mark.parametrize("ssm", [[], ["--ssm", "default", "--ssm", "ngram"]])
def test_generate_speculates_by_default(smollm_gguf, capsys, ssm):
    from specinfer.cli import main
    from specinfer.default_model import GGUF_NAME

    if ssm and smollm_gguf.name != GGUF_NAME:
        pytest.skip("the shipped SSM belongs to the default model")
    args = ["generate", "Name three colours.", "--max-tokens", "12", "--dtype", "float32",
            "--model", str(smollm_gguf), "--temperature", "0"]  # fmt: skip
    assert main(args + ssm + ["--stats"]) == 0
    speculative = capsys.readouterr()
    assert "ngram:" in speculative.err  # per-SSM statistics: the n-gram drafter drafted
    # The default model drafts with its shipped SSM too, asked for or not, and by default with
    # the suffix drafter from its shipped corpus.
    assert ("default_ssm:" in speculative.err) == (smollm_gguf.name == GGUF_NAME)
    default_corpus = smollm_gguf.name == GGUF_NAME and not ssm
    assert ("suffix:corpus=default:" in speculative.err) == default_corpus
    assert main(args + ["--mode", "incremental"]) == 0
    assert capsys.readouterr().out == speculative.out
    assert main(args + ssm + ["--whole-trees"]) == 0  # every drafted node verified
    assert capsys.readouterr().out == speculative.out


@pytest.mark.parametrize(
    "spec, message", [("default", "distilled from"), ("feature", "trained for")]
)
def test_the_default_ssm_belongs_to_the_default_model(tmp_path, spec, message):
    from specinfer.drafting import build_drafter

    with pytest.raises(ValueError, match=message):
        build_drafter(spec, None, None, tmp_path / "other.gguf", torch.float32, "cpu", None, False)


@pytest.fixture(scope="module")
def incremental_bf16(smollm_gguf):
    return Engine(smollm_gguf, dtype="bfloat16", max_batch_size=4)


@pytest.mark.parametrize(
    "ssm, tree, mode, batch",
    [("layers:4", "2,2,1", "tree", 4), ("layers:2", "1,1,1,1", "sequence", 1), (["layers:2", "ngram"], "1,3,1", "tree", 4),
     (["feature", "ngram"], "2,2,1", "tree", 4)],
)  # fmt: skip
def test_bfloat16_speculation_is_bit_exact(smollm_gguf, incremental_bf16, ssm, tree, mode, batch):
    """bfloat16 (the fast dtype, recorded op graphs on): no near-tie allowance. The CPU kernels
    compute a row the same way whatever rows share the call, so a tree node's logits are exactly
    those of decoding it alone, and a batch's those of each request alone."""
    trees = tree if isinstance(ssm, str) else [tree, None]
    spec = Engine(
        smollm_gguf, dtype="bfloat16", ssm=ssm, tree=trees, mode=mode, max_batch_size=batch
    )
    prompts = (WRITTEN + CHATS)[:4]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.token_ids for c in incremental_bf16.generate(prompts, params)]
    assert [c.token_ids for c in spec.generate(prompts, params)] == expected


def test_bfloat16_batches_are_bit_exact(smollm_gguf, incremental_bf16):
    prompts = (WRITTEN + CHATS)[:4]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.token_ids for c in incremental_bf16.generate(prompts, params)]
    one_by_one = Engine(smollm_gguf, dtype="bfloat16", max_batch_size=1)
    assert [c.token_ids for c in one_by_one.generate(prompts, params)] == expected
