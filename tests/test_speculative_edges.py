"""Speculative decoding at the edges of a request, on tiny random models: stopping at EOS and at
stop strings, running into the model's context, and the Engine's own argument checks. Greedy
speculation must give what incremental decoding gives: token ids, text and finish reason."""

import json
import shutil

import pytest

from specinfer import Engine, SamplingParams
from test_speculative import PROMPT, _tiny_llama

# Incremental outputs of the tiny target (seed 0, 3 layers), ignoring EOS, 24 tokens:
#   [3]                   5 3 4 5 3 3 4 5 4 3 5 0 0 4 3 3 4 3 3 3 3 3 3 4
#   PROMPT (1 4 2)        2 0 5 2 5 5 5 2 5 0 5 5 5 0 5 0 5 5 5 5 0 5 5 5
#   [2, 3]                5 1 5 5 5 2 5 1 1 1 1 1 2 1 5 2 5 1 3 5 2 5 1 1
#   [5, 5, 1, 0, 2, 4, 4] 5 2 5 5 3 1 1 4 5 2 5 2 1 1 0 4 0 4 4 5 4 0 0 4
PROMPTS = [[3], PROMPT, [2, 3], [5, 5, 1, 0, 2, 4, 4]]
EOS = 0  # ends [3] at token 12, PROMPT at 2, [5, 5, ...] at 15; [2, 3] runs to its length


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    return _tiny_llama(root / "target", seed=0, layers=3), _tiny_llama(root / "ssm", seed=1)


def _with_config(src, dst, **changes):
    """A copy of an HF model directory with config.json fields changed (same weights)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


# (ssm, tree, mode): a perfect SSM (whole paths accepted, so a finish lands inside one), a
# different model, the target's first layer, prompt lookup.
SPECULATORS = [
    ("self", "1,2,1", "tree"),
    ("other", "2,2,1", "tree"),
    ("other", "1,1,1,1", "sequence"),
    ("layers", "3,1", "tree"),
    ("ngram", None, "tree"),
]
IDS = ["self", "other", "other-sequence", "layers", "ngram"]


def _speculative(target, other, ssm, tree, mode, **kwargs):
    spec = {"self": target, "other": other, "layers": 1, "ngram": "ngram"}[ssm]
    return Engine(target, dtype="float32", ssm=spec, tree=tree, mode=mode, max_batch_size=3,
                  **kwargs)  # fmt: skip


def _same(outs, reference):
    got = [(o.token_ids, o.text, o.finish_reason) for o in outs]
    assert got == [(r.token_ids, r.text, r.finish_reason) for r in reference]


@pytest.fixture(scope="module")
def with_eos(tiny, tmp_path_factory):
    return _with_config(tiny[0], tmp_path_factory.mktemp("eos") / "target", eos_token_id=EOS)


@pytest.mark.parametrize("ssm, tree, mode", SPECULATORS, ids=IDS)
def test_speculation_stops_at_eos_like_incremental(with_eos, tiny, ssm, tree, mode):
    params = SamplingParams(max_tokens=20)
    reference = Engine(with_eos, dtype="float32").generate(PROMPTS, params)
    # the reference itself: three requests end at the EOS, one at its length
    assert [r.finish_reason for r in reference] == ["stop", "stop", "length", "stop"]
    assert [len(r.token_ids) for r in reference] == [12, 2, 20, 15]
    for r in reference[:2] + reference[3:]:  # the EOS ends the ids, and is not in the text
        assert r.token_ids.index(EOS) == len(r.token_ids) - 1 and "t0" not in r.text
    # 4 prompts on 3 rows: a row freed by an EOS is reused
    outs = _speculative(with_eos, tiny[1], ssm, tree, mode).generate(PROMPTS, params)
    _same(outs, reference)


@pytest.mark.parametrize("ssm, tree, mode", SPECULATORS, ids=IDS)
def test_speculation_stops_at_a_stop_string_like_incremental(tiny, ssm, tree, mode):
    """ "t0 t0" spans two tokens; "1 t3" starts inside one ("t1 t3")."""
    params = SamplingParams(max_tokens=24, stop=["t0 t0", "1 t3"], ignore_eos=True)
    reference = Engine(tiny[0], dtype="float32").generate(PROMPTS, params)
    assert [r.finish_reason for r in reference] == ["stop", "length", "stop", "stop"]
    assert [len(r.token_ids) for r in reference] == [13, 24, 19, 23]
    assert reference[0].text == "t5 t3 t4 t5 t3 t3 t4 t5 t4 t3 t5 "  # cut before "t0 t0"
    assert reference[2].text.endswith("t2 t5 t")  # cut before "1 t3"
    outs = _speculative(*tiny, ssm, tree, mode).generate(PROMPTS, params)
    _same(outs, reference)


CONTEXT = 20


@pytest.fixture(scope="module")
def short_context(tiny, tmp_path_factory):
    dst = tmp_path_factory.mktemp("short") / "target"
    return _with_config(tiny[0], dst, max_position_embeddings=CONTEXT)


@pytest.mark.parametrize("ssm, tree, mode", SPECULATORS, ids=IDS)
def test_speculation_into_the_context_limit_ends_with_length(short_context, tiny, ssm, tree, mode):
    """Requests that would run past max_position_embeddings end at it ("length"), whatever
    max_tokens says, with incremental decoding's output; the trees near the end are cut to fit.
    Prompts of 1 to 19 tokens: the last gets its one token from the prefill alone."""
    prompts = PROMPTS + [[2, 5] * 9, [1, 4, 2] * 6 + [3]]
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    reference = Engine(short_context, dtype="float32").generate(prompts, params)
    assert [len(p) + len(r.token_ids) for p, r in zip(prompts, reference)] == [CONTEXT] * 6
    assert {r.finish_reason for r in reference} == {"length"}
    # the same weights with a long context: the short one only cuts the output
    long = Engine(tiny[0], dtype="float32").generate(prompts, params)
    assert [r.token_ids for r in reference] == [
        o.token_ids[: CONTEXT - len(p)] for p, o in zip(prompts, long)
    ]
    speculative = _speculative(short_context, tiny[1], ssm, tree, mode)
    _same(speculative.generate(prompts, params), reference)
    single = speculative.generate(prompts[0], params)[0]  # alone: the tree is not padded
    assert single.token_ids == reference[0].token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_batch_size": 0}, "max_batch_size must be at least 1, got 0"),
        ({"mode": "beam"}, "mode must be 'incremental', 'sequence', 'tree' or 'dsi', got 'beam'"),
        ({"verifier": "exact"}, "verifier must be 'mss' or 'naive', got 'exact'"),
        ({"dtype": "float16"}, "dtype float16 is not supported on the CPU"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"mode": "tree"}, "mode 'tree' needs an ssm"),
        ({"mode": "sequence"}, "mode 'sequence' needs an ssm"),
    ],
    ids=[
        "max_batch_size",
        "mode",
        "verifier",
        "float16-cpu",
        "dtype",
        "tree-no-ssm",
        "sequence-no-ssm",
    ],  # fmt: skip
)
def test_engine_rejects_bad_arguments(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny[0], **kwargs)
