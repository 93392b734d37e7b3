import pytest
import torch

from specinfer.sampling import SamplingParams, make_generator, next_token, probabilities


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_invalid_params_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="###").stop == ["###"]


def test_temperature_scales_the_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(probabilities(logits, 0.5), torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5])
    p = probabilities(logits, 1.0, top_k=2)
    assert torch.nonzero(p).flatten().tolist() == [1, 4]
    assert p.sum().item() == pytest.approx(1.0)
    expected = torch.softmax(torch.tensor([3.0, 2.5]), -1)
    assert torch.allclose(p[[1, 4]], expected)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = probabilities(probs.log(), 1.0, top_p=0.7)  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = probabilities(probs.log(), 1.0, top_p=0.1)  # the top token always stays
    assert torch.allclose(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_min_p_keeps_the_tokens_near_the_most_likely():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.4, 0.25, 0.25]])
    p = probabilities(probs.log(), 1.0, min_p=0.5)  # at least 0.25 / 0.2
    kept = torch.tensor([[0.5, 0.3, 0.0, 0.0], [0.0, 0.4, 0.25, 0.25]])
    assert torch.allclose(p, kept / kept.sum(-1, keepdim=True))
    only_top = probabilities(probs.log(), 1.0, min_p=1.0)
    assert torch.allclose(only_top, torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
    # After top-k, relative to the most likely token: what top-k left, renormalised, decides.
    both = probabilities(probs.log(), 1.0, top_k=3, min_p=0.55)  # 0.25 / 0.4 > 0.55; 0.15 / 0.5 not
    assert torch.allclose(both, kept / kept.sum(-1, keepdim=True))


@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0], ids=["flat", "peaked", "sharp"])
def test_top_p_on_a_large_vocabulary_matches_a_full_sort(scale):
    """The nucleus found over the largest k probabilities (k growing) is the one a full sort
    gives, from one token to thousands, on several rows at once."""
    torch.manual_seed(3)
    logits = torch.randn(4, 5000) * scale
    p = probabilities(logits, 0.8, top_p=0.9)
    probs = torch.softmax(logits.float() / 0.8, -1)
    top, order = probs.sort(-1, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, top.cumsum(-1) - top < 0.9)
    expected = probs.masked_fill(~keep, 0.0)
    expected = expected / expected.sum(-1, keepdim=True)
    assert torch.equal(p > 0, keep)
    torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-7)
    assert torch.allclose(p.sum(-1), torch.ones(4))


def test_greedy_is_argmax_and_seeded_sampling_is_reproducible():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert next_token(logits, SamplingParams(), make_generator(0)) == int(logits.argmax())
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [next_token(logits, params, make_generator(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    gen = make_generator(7)
    many = {next_token(logits, params, gen) for _ in range(200)}
    assert len(many) > 5  # it does sample, not just argmax


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0])
    params = SamplingParams(temperature=1.0)
    gen = make_generator(123)
    n = 6000
    counts = torch.bincount(
        torch.tensor([next_token(logits, params, gen) for _ in range(n)]), minlength=3
    )
    expected = torch.softmax(logits, -1) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 13.8  # chi-squared, 2 degrees of freedom, p = 0.001


def test_greedy_tokens_is_argmax_first_maximum_included():
    from specinfer.sampling import greedy_tokens

    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first maximum, as argmax
    x[2] = 0.0
    assert torch.equal(greedy_tokens(x), x.argmax(-1))
    assert int(greedy_tokens(x[1])) == 10 and int(greedy_tokens(x[2])) == 0


def test_sample_all_equals_sampling_each_request_alone():
    """The engine's batched next tokens (one max over the greedy rows without penalties) are
    what each request samples alone: greedy, penalised greedy and seeded sampling mixed."""
    from specinfer.engine.sequence import Sequence
    from specinfer.engine.spec_step import sample, sample_all

    V = 50
    kinds = [SamplingParams(), SamplingParams(repetition_penalty=1.5),
             SamplingParams(temperature=0.8, seed=3), SamplingParams()]  # fmt: skip

    def batch():
        seqs = [Sequence(str(i), [1, 2, 3], p, None, 64, V, torch.device("cpu"))
                for i, p in enumerate(kinds)]  # fmt: skip
        for s in seqs:
            s.output_ids = [7, 8]
        return seqs

    logits = torch.randn(len(kinds), V, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1].max() + 0.1  # greedy picks 7 unless its penalty applies
    alone = [sample(s, lg) for s, lg in zip(batch(), logits)]
    assert sample_all(batch(), logits) == alone
    assert alone[1] != 7 and alone[0] == int(logits[0].argmax())
