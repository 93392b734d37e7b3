"""Greedy generation on SmolLM2 (fp32) must be token-identical to HF transformers' greedy decoding.

HF's choice at every step is read from one forward of HF's model over the prompt and our output
(its logits at each position given our tokens so far): where each of our tokens is HF's argmax
there, HF's own greedy decoding produces our output, step by step, and one forward per prompt is
~10x faster than HF's `generate`. The one tolerated divergence is a genuine near-tie: at the first
token that is not HF's argmax, HF's top-2 logits are within 1e-4 and we picked one of those two
(from there on the prefixes differ, so nothing further is compared). Each such case is reported.
"""

import inspect
import json
import os
import textwrap

import pytest
import torch

from specinfer import Engine, SamplingParams

NEW_TOKENS = 128
NEAR_TIE = 1e-4

WRITTEN = [
    "The capital of France is",
    "def quicksort(xs):",
    "Once upon a time, in a small village by the sea,",
    "Explain why the sky is blue in one paragraph.",
    "1, 1, 2, 3, 5, 8, 13,",
    "import numpy as np\n\n# Compute the moving average of a 1-D array",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The three laws of thermodynamics are",
]
CHATS = [
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "What is 17 times 23? Show your steps."}],
]


def _stdlib_prompts(n: int) -> list[str]:
    """Real text nobody here wrote: the openings of standard-library docstrings."""
    objs = [json.dumps, os.path.join, inspect.getsource, textwrap.dedent, sorted, zip, str.split,
            dict.setdefault, os.walk, json.JSONDecoder]  # fmt: skip
    return [inspect.getdoc(o)[:300] for o in objs][:n]


@pytest.fixture(scope="module")
def engine(smollm_gguf):
    return Engine(smollm_gguf, dtype="float32", max_batch_size=20)


@pytest.fixture(scope="module")
def hf_model(smollm_gguf):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_gguf.parent), gguf_file=smollm_gguf.name, dtype=torch.float32
    )
    return model.eval()


def _hf_logits_over(model, ids: list[int], ours: list[int]) -> torch.Tensor:
    """HF's logits for each of our output tokens [len(ours), V], given the prompt and our tokens
    before it: where HF's argmax is our token at every position, HF's greedy output is ours."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + ours])).logits[0]
    return logits[len(ids) - 1 : len(ids) + len(ours) - 1]


def _compare(ours: list[int], ref_logits: torch.Tensor) -> str | None:
    """None if each of our tokens is HF's argmax, a near-tie report if the first that is not
    was one of HF's near-tied top two; else the test fails."""
    ref = ref_logits.argmax(-1).tolist()
    split = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if split is None:
        return None
    top2 = torch.topk(ref_logits[split], 2)
    gap = (top2.values[0] - top2.values[1]).item()
    assert gap < NEAR_TIE and ours[split] in top2.indices.tolist(), (
        f"diverged at step {split}: ours {ours[split]}, HF's {ref[split]}, top-2 gap {gap:.2e}"
    )
    return f"near-tie at step {split}: tokens {top2.indices.tolist()}, gap {gap:.1e}"


def test_greedy_batch_of_20_prompts_matches_transformers(engine, hf_model):
    prompts = WRITTEN + CHATS + _stdlib_prompts(10)
    assert len(prompts) == 20
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = engine.generate(prompts, params)  # one batch: 20 prompts of different lengths
    prompt_ids = [engine.prompt_ids(p) for p in prompts]
    assert len({len(ids) for ids in prompt_ids}) > 10
    ties = []
    for i, (ids, out) in enumerate(zip(prompt_ids, outs)):
        assert len(out.token_ids) == NEW_TOKENS
        report = _compare(out.token_ids, _hf_logits_over(hf_model, ids, out.token_ids))
        if report:
            ties.append(f"prompt {i}: {report}")
    print(f"\n{len(prompts)} prompts x {NEW_TOKENS} tokens; near-ties: {len(ties)}")
    for t in ties:
        print("  " + t)


def test_batch_one_equals_batched(engine):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    batched = engine.generate(WRITTEN[:4], params)
    single = [engine.generate(p, params)[0] for p in WRITTEN[:4]]
    assert [b.token_ids for b in batched] == [s.token_ids for s in single]


@pytest.mark.parametrize("ssm", [None, ["default", "ngram"]], ids=["incremental", "speculative"])
def test_logprobs_are_transformers_log_softmax(engine, hf_model, smollm_gguf, ssm):
    """Each token's logprob and its step's top 5 are HF's log-softmax of the raw logits at that
    position: greedy, and sampled with penalties (which the reported distribution leaves out);
    under speculation the rows come from the verified trees' accepted paths."""
    if ssm is not None:
        engine = Engine(smollm_gguf, dtype="float32", ssm=ssm)
    prompts = [WRITTEN[0], WRITTEN[3], CHATS[0]]
    for params in (SamplingParams(max_tokens=24, logprobs=5, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.8, seed=3, logprobs=5, ignore_eos=True,
                                  repetition_penalty=1.3, frequency_penalty=0.5)):  # fmt: skip
        for prompt, out in zip(prompts, engine.generate(prompts, params)):
            ids, tokens = engine.prompt_ids(prompt), out.token_ids
            ref = torch.log_softmax(_hf_logits_over(hf_model, ids, tokens), dim=-1)
            assert len(out.logprobs) == len(tokens) == 24
            ours = torch.tensor([e.logprob for e in out.logprobs])
            assert [e.token_id for e in out.logprobs] == tokens
            torch.testing.assert_close(
                ours, ref[torch.arange(len(tokens)), tokens], atol=1e-4, rtol=0
            )
            top = ref.topk(6, dim=-1)
            for step, e in enumerate(out.logprobs):
                values = torch.tensor([lp for _, lp in e.top])
                torch.testing.assert_close(values, top.values[step, :5], atol=1e-4, rtol=0)
                for (token, lp), want in zip(e.top, top.indices[step].tolist()):
                    # the same token, unless HF's value there is tied with its neighbour's
                    assert token == want or (top.values[step] - lp).abs().lt(1e-4).sum() > 1


def test_prompt_logprobs_are_transformers_log_softmax(smollm_gguf, hf_model):
    """Each prompt token's logprob (after the first) and top 3 are HF's log-softmax over the
    prompt, with prompts prefilled in chunks of 16 tokens, three at once."""
    engine = Engine(smollm_gguf, dtype="float32", max_tokens_per_step=16)
    prompts = _stdlib_prompts(3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        ids = engine.prompt_ids(prompt)
        assert len(ids) > 32 and len(out.prompt_logprobs) == len(ids)
        assert out.prompt_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1], dim=-1)
        ours = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        assert [e.token_id for e in out.prompt_logprobs[1:]] == ids[1:]
        torch.testing.assert_close(
            ours, ref[torch.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=0
        )
        top = torch.tensor([[lp for _, lp in e.top] for e in out.prompt_logprobs[1:]])
        torch.testing.assert_close(top, ref.topk(3, dim=-1).values, atol=1e-4, rtol=0)
