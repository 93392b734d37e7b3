"""Structured output (json_schema, regex, choice, grammar): the output matches, speculation keeps
it exact (greedy: token for token; sampling: the masked distribution, chi-squared), bad
schemas are clear errors."""

import json
import re
import shutil

import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from specinfer import Engine, SamplingParams
from specinfer.tree import TreeConfig
from test_speculative import (
    PROMPT,
    SAMPLES,
    VOCAB,
    _chi_squared_p,
    _last_logits,
    _sample_first3,
    tiny_pair,  # noqa: F401
)

# Tokens 0..5 are the letters a..f (f is EOS): the first token is 1, 2 or 4, then 0, 2, 3 or 4
# any number of times, EOS from the third token on.
LETTERS = "abcdef"
REGEX = "[bce][acde]+"
ALLOWED = [{1, 2, 4}, {0, 2, 3, 4}, {0, 2, 3, 4, 5}]
EOS = 5


@pytest.fixture(scope="module")
def tiny_bytes(tiny_pair, tmp_path_factory):  # noqa: F811
    """The tiny target with one letter a token and a byte-level decoder (llguidance reads
    tokens as bytes, and builds longer ones from single bytes), f its EOS token."""
    path = tmp_path_factory.mktemp("bytes") / "target"
    shutil.copytree(tiny_pair[0], path)
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(LETTERS)}, unk_token="a"))
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "f"}))
    return path


def _masked_joint(engine: Engine, temperature: float = 1.0) -> dict[tuple, float]:
    """P(first 3 tokens) under incremental sampling held to REGEX, from the target's logits and
    the allowed sets written out above (not from llguidance); EOS ends an output early."""
    probs: dict[tuple, float] = {(): 1.0}
    for allowed in ALLOWED:
        nxt = {}
        for prefix, p in probs.items():
            if prefix and prefix[-1] == EOS:
                nxt[prefix] = p
                continue
            logits = _last_logits(engine.model, PROMPT + list(prefix)).double() / temperature
            logits[[t for t in range(VOCAB) if t not in allowed]] = float("-inf")
            dist = torch.softmax(logits, -1)
            for t in allowed:
                nxt[prefix + (t,)] = p * dist[t].item()
        probs = nxt
    return probs


def test_params_take_one_structure_of_the_right_type():
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        SamplingParams(choice=[])
    with pytest.raises(ValueError, match="json_schema must be a dict"):
        SamplingParams(json_schema=3)
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        SamplingParams(regex="")
    assert SamplingParams(regex="a+").structured_fields == ["regex"]


def test_invalid_grammars_are_errors_that_name_them(tiny_bytes, tiny_pair):  # noqa: F811
    engine = Engine(tiny_bytes, dtype="float32")
    for kwargs, field in (({"regex": "(b"}, "regex"), ({"json_schema": {"type": "nope"}}, "json_schema"),
                          ({"grammar": "start: ???"}, "grammar")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{field} is not valid"):
            engine.generate([PROMPT], SamplingParams(max_tokens=3, **kwargs))
    with pytest.raises(ValueError, match="needs a model with an EOS token"):
        Engine(tiny_pair[0], dtype="float32").generate([PROMPT], SamplingParams(regex="b"))


@pytest.mark.parametrize("tree", ["2,2", "1,1,1", TreeConfig((3, 2), beam=2)], ids=str)
def test_greedy_under_a_regex_equals_incremental_tiny(tiny_bytes, tree):
    params = SamplingParams(max_tokens=12, regex=REGEX)
    prompts = [PROMPT, [3], [5, 5, 1, 0, 2, 4, 4], [2, 3]]
    reference = Engine(tiny_bytes, dtype="float32").generate(prompts, params)
    spec = Engine(tiny_bytes, dtype="float32", ssm=["layers:1", "ngram:min_n=1"], tree=[tree, None])
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    for r in reference:
        body = r.token_ids[:-1] if r.token_ids[-1] == EOS else r.token_ids
        assert re.fullmatch(REGEX, "".join(LETTERS[t] for t in body)), r.token_ids
    unconstrained = Engine(tiny_bytes, dtype="float32").generate(
        prompts, SamplingParams(max_tokens=12)
    )
    assert [o.token_ids for o in unconstrained] != [r.token_ids for r in reference]


@pytest.mark.parametrize("tree", [TreeConfig((3, 2), sample_children=True), TreeConfig((2, 2))],
                         ids=["sampled children", "top-k children"])  # fmt: skip
def test_sampling_under_a_regex_matches_the_masked_distribution(tiny_bytes, tree):
    """Speculative sampling with the target's rows masked by the grammar along each tree path
    draws from incremental sampling's masked distribution; never a forbidden token."""
    engine = Engine(tiny_bytes, dtype="float32", max_batch_size=512, ssm="layers:1", tree=tree)
    n = SAMPLES
    counts = _sample_first3(engine, n, sampling={"temperature": 1.0, "regex": REGEX})
    exact = _masked_joint(engine)
    impossible = {key: c for key, c in counts.items() if exact.get(key, 0) == 0}
    assert not impossible, f"outputs the grammar forbids: {impossible}"
    stat, p = _chi_squared_p(counts, exact, n)
    print(f"\nregex sampling ({tree}): chi2 = {stat:.1f}, p = {p:.3f}")
    assert p > 0.01, f"chi2 = {stat:.1f}, p = {p:.2e}"


def test_a_failing_grammar_ends_its_request_alone(tiny_bytes, monkeypatch, caplog):
    """A matcher that refuses a token (a bug, ours or llguidance's) aborts that request, logged;
    the others in its batch run on as alone."""
    from specinfer import structured

    engine = Engine(tiny_bytes, dtype="float32", ssm="layers:1", tree="2,2")
    alone = engine.generate([[3]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    consume = structured.Grammar.consume

    def failing(self, token):
        if len(self.history) == 2:
            self.error = "refused for the test"
            return False
        self.history.append(token)
        return consume(self, token)

    monkeypatch.setattr(structured.Grammar, "history", [], raising=False)
    monkeypatch.setattr(structured.Grammar, "consume", failing)
    outs = engine.generate([PROMPT, [3]], [SamplingParams(max_tokens=8, regex=REGEX),
                                           SamplingParams(max_tokens=8, ignore_eos=True)])  # fmt: skip
    assert outs[0].finish_reason == "abort" and len(outs[0].token_ids) == 2
    assert outs[1].token_ids == alone.token_ids
    assert "its grammar failed (refused for the test)" in caplog.text


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}  # fmt: skip
CHATS = [
    [{"role": "user", "content": "Make up a person and describe them."}],
    [{"role": "user", "content": "Which planet is largest? Reply in JSON."}],
    [{"role": "user", "content": "Is water wet? Answer yes or no."}],
]


@pytest.fixture(scope="module")
def smollm_pair(smollm_gguf):
    return (Engine(smollm_gguf, dtype="float32"),
            Engine(smollm_gguf, dtype="float32", ssm=["default", "ngram", "suffix:corpus=default"]))  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [{"json_schema": SCHEMA}, {"json_schema": {"type": "object"}}, {"choice": ["yes", "no", "it depends"]},
     {"regex": r"(Yes|No), because [a-z ]{1,40}\."}],
    ids=["schema", "json object", "choice", "regex"],
)  # fmt: skip
def test_structured_output_on_smollm_is_valid_and_speculation_exact(smollm_pair, kwargs):
    incremental, spec = smollm_pair
    params = SamplingParams(max_tokens=64, **kwargs)
    reference = incremental.generate(CHATS, params)
    outs = spec.generate(CHATS, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    for r in reference:
        if r.finish_reason == "length":
            continue
        assert r.finish_reason == "stop"
        if "json_schema" in kwargs:
            value = json.loads(r.text)
            assert isinstance(value, dict)
            if kwargs["json_schema"] is SCHEMA:
                assert set(value) == {"name", "age", "tags"} and isinstance(value["age"], int)
        elif "choice" in kwargs:
            assert r.text in kwargs["choice"]
        else:
            assert re.fullmatch(kwargs["regex"], r.text), r.text
    finished = [r for r in reference if r.finish_reason == "stop"]
    assert len(finished) >= 2, [r.text for r in reference]
