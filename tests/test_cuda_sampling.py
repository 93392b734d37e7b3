"""Sampling on a CUDA device: each request's generator lives on the device its logits are on, so
incremental and speculative sampling run there, reproduce with a seed, and follow the target's
distribution (chi-squared against the exact joint of the first three tokens). Skipped without a
GPU; `benchmarks/gpu_check.sh` runs them (`pytest -m gpu`)."""

import pytest

from marks import gpu
from specinfer import Engine, SamplingParams, TreeConfig
from test_speculative import PROMPT, _chi_squared_p, _sample_first3, exact, tiny_pair  # noqa: F401


@gpu
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"tree": TreeConfig((3, 2), sample_children=True)}, {"tree": TreeConfig((2, 2))}],
    ids=["incremental", "sampled children", "top-k children"],
)
def test_cuda_sampling_matches_incremental_distribution(tiny_pair, exact, kwargs):  # noqa: F811
    target, ssm = tiny_pair
    engine = Engine(target, dtype="float32", device="cuda", max_batch_size=512,
                    ssm=ssm if kwargs else None, **kwargs)  # fmt: skip
    samples = 20_000
    stat, p = _chi_squared_p(_sample_first3(engine, samples), exact, samples)
    print(f"\ncuda {kwargs or 'incremental'}: chi2 = {stat:.1f}, p = {p:.3f}")
    assert p > 0.01, f"chi2 = {stat:.1f}, p = {p:.2e}"


@gpu
@pytest.mark.parametrize("speculative", [False, True])
def test_cuda_seeded_sampling_reproduces(tiny_pair, speculative):  # noqa: F811
    target, ssm = tiny_pair
    engine = Engine(target, dtype="float32", device="cuda",
                    ssm=ssm if speculative else None, tree="2,2")  # fmt: skip
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_k=4, seed=s, ignore_eos=True)
              for s in range(6)]  # fmt: skip
    batched = [o.token_ids for o in engine.generate([PROMPT] * 6, params)]
    alone = [engine.generate(PROMPT, p)[0].token_ids for p in params[:2]]
    assert alone == batched[:2]
    assert len(set(map(tuple, batched))) > 1, "different seeds gave one output"
