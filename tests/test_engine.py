"""Engine behaviour on the default model: API, streaming, stop rules, batching, bad input."""

import json

import pytest

from specinfer import Engine, SamplingParams
from specinfer.cli import main as cli_main


@pytest.fixture(scope="module")
def engine(smollm_gguf):
    return Engine(smollm_gguf, dtype="float32", max_batch_size=3)


def test_stream_yields_the_same_text_as_generate(engine):
    params = SamplingParams(max_tokens=24)
    full = engine.generate("The capital of France is", params)[0]
    streamed = list(engine.stream("The capital of France is", params))
    assert len(streamed) > 1 and "".join(streamed) == full.text


def test_max_tokens_and_length_finish(engine):
    out = engine.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.prompt_tokens == len(engine.tokenizer.encode("Count: 1, 2, 3,"))


def test_chat_stops_at_eos(engine):
    out = engine.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=100))
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.eos_ids
    assert "<|im_end|>" not in out.text


def test_stop_string_truncates_and_finishes(engine):
    base = engine.generate("1, 2, 3, 4,", SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert " 6" in base.text  # the model continues the count; stop at "6"
    out = engine.generate(
        "1, 2, 3, 4,", SamplingParams(max_tokens=20, stop=["6"], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[: base.text.index("6")]


def test_stop_token_ids_end_a_request_as_eos_does(engine, smollm_gguf):
    """A stop token id ends the output at its first occurrence: kept in token_ids, not in the
    text; the same under speculation (a tree may accept tokens past it, which are dropped)."""
    prompt, plain = "1, 2, 3, 4,", SamplingParams(max_tokens=20, ignore_eos=True)
    base = engine.generate(prompt, plain)[0]
    stop = base.token_ids[6]
    first = base.token_ids.index(stop)
    params = SamplingParams(
        max_tokens=20, ignore_eos=True, stop_token_ids=[stop, engine.config.vocab_size - 1]
    )
    spec = Engine(smollm_gguf, dtype="float32", ssm=["default", "ngram"], max_batch_size=1)
    for e in (engine, spec):
        out = e.generate(prompt, params)[0]
        assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"
        assert out.text == engine.tokenizer.decode(base.token_ids[:first])
    assert spec.generate(prompt, plain)[0].metrics["tokens_per_step"] > 1  # it speculated
    with pytest.raises(ValueError, match=r"stop_token_ids: token ids outside the vocabulary"):
        engine.generate(prompt, SamplingParams(stop_token_ids=[10**9]))


def test_min_tokens_hold_back_eos_and_stop_ids(engine, smollm_gguf):
    """min_tokens: EOS (and stop token ids) cannot come before the output holds that many
    tokens; greedy speculative output equals incremental with it."""
    chat = [{"role": "user", "content": "Say hello."}]
    short = engine.chat(chat, SamplingParams(max_tokens=100))
    assert short.finish_reason == "stop" and short.token_ids[-1] in engine.eos_ids
    params = SamplingParams(max_tokens=100, min_tokens=len(short.token_ids) + 3)
    out = engine.chat(chat, params)
    assert len(out.token_ids) >= params.min_tokens
    assert not set(out.token_ids[: params.min_tokens]) & engine.eos_ids
    assert out.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]  # then not EOS
    spec = Engine(smollm_gguf, dtype="float32", ssm=["default", "ngram"], max_batch_size=1)
    assert spec.chat(chat, params).token_ids == out.token_ids
    with pytest.raises(ValueError, match="min_tokens must be an integer in"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(engine):
    def run(seed):
        p = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return engine.generate("Once upon a time", p)[0].token_ids

    assert run(1) == run(1)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_more_prompts_than_rows_use_continuous_batching(engine):
    # max_batch_size is 3: five prompts reuse rows as earlier requests finish.
    prompts = ["a", "The sun", "def f(x):", "Hello", "1 + 1 ="]
    lengths = [3, 9, 5, 12, 7]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == lengths
    alone = [engine.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in outs] == alone


def test_token_id_prompts_and_mixed_kinds(engine):
    ids = engine.tokenizer.encode("The capital of France is")
    by_ids, by_text = engine.generate(
        [ids, "The capital of France is"], SamplingParams(max_tokens=8)
    )
    assert by_ids.token_ids == by_text.token_ids


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ([""], None, "prompt 0 is empty"),
        (["ok", []], None, "prompt 1 is empty"),
        ([[1, 2, 10**9]], None, "out of range"),
        (["a", "b"], [SamplingParams()], "2 prompts but 1 SamplingParams"),
        ([], None, "no prompts"),
        ([["not", "ids"]], None, "expected text, token ids or chat messages"),
    ],
)
def test_bad_input_is_rejected_before_any_work(engine, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, params)


def test_too_long_prompt_names_the_context(engine):
    with pytest.raises(ValueError, match="context is 8192"):
        engine.generate([[5] * 9000])


def test_missing_model_and_bad_dtype():
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        Engine("no/such/model")
    with pytest.raises(ValueError, match="unknown dtype"):
        Engine("no/such/model", dtype="int3")


def test_cli_streams_a_completion(smollm_gguf, capsys):
    rc = cli_main(["generate", "The capital of France is", "--model", str(smollm_gguf),
                   "--max-tokens", "6", "--no-chat", "--dtype", "float32", "--temperature", "0"])  # fmt: skip
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], {"temperature": 0.2, "top_p": 0.9, "frequency_penalty": 0.3, "repetition_penalty": 1.0}),
        (["--temperature", "0"], {"temperature": 0.0, "frequency_penalty": 0.0}),
        (["--temperature", "0", "--repetition-penalty", "1.2"], {"repetition_penalty": 1.2}),
        (["--presence-penalty", "0.5", "--frequency-penalty", "0.25", "--top-k", "40"],
         {"presence_penalty": 0.5, "frequency_penalty": 0.25, "top_k": 40}),
        (["--min-p", "0.05"], {"min_p": 0.05, "top_p": 0.9}),
        (["--json-schema", "object"], {"json_schema": {"type": "object"}}),
        (["--json-schema", '{"type": "array"}'], {"json_schema": '{"type": "array"}'}),
        (["--regex", "[0-9]+"], {"regex": "[0-9]+", "json_schema": None}),
        (["--choice", "yes", "--choice", "no"], {"choice": ["yes", "no"]}),
    ],
)  # fmt: skip
def test_cli_sampling_defaults(smollm_gguf, monkeypatch, capsys, flags, expected):
    seen = []
    monkeypatch.setattr(
        Engine, "stream", lambda self, prompt, params: seen.append(params) or iter(())
    )
    assert (
        cli_main(["generate", "hi", "--model", str(smollm_gguf), "--mode", "incremental", *flags])
        == 0
    )
    (params,) = seen
    assert {k: getattr(params, k) for k in expected} == expected


def test_cli_json_schema_from_a_file(smollm_gguf, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, '
                      '"required": ["ok"], "additionalProperties": false}')  # fmt: skip
    rc = cli_main(["generate", "Is Paris in France?", "--model", str(smollm_gguf), "--max-tokens",
                   "16", "--temperature", "0", "--json-schema", str(schema)])  # fmt: skip
    assert rc == 0
    assert json.loads(capsys.readouterr().out) in ({"ok": True}, {"ok": False})
    rc = cli_main(["generate", "hi", "--model", str(smollm_gguf), "--regex", "(a"])
    assert rc == 2 and "regex is not valid" in capsys.readouterr().err


def test_cli_chat_template(smollm_gguf, tmp_path, monkeypatch, capsys):
    """--chat-template (a file or the template itself) renders the prompt instead of the
    model's; a missing file or a template that does not compile is refused before loading."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    seen = []
    monkeypatch.setattr(Engine, "stream", lambda self, prompt, params: seen.append(
        self.tokenizer.apply_chat_template(prompt)) or iter(()))  # fmt: skip
    file = tmp_path / "template.jinja"
    file.write_text(template)
    for value in (template, str(file)):
        args = ["generate", "Hi", "--model", str(smollm_gguf), "--mode", "incremental"]
        assert cli_main([*args, "--chat-template", value]) == 0
    long = "{# " + "x" * 300 + " #}" + template  # longer than a file name may be
    assert cli_main([*args, "--chat-template", long]) == 0
    assert seen == ["[user] Hi\n[assistant] "] * 3
    for value, error in (("no/such.jinja", "no such file"), ("{% for %}", "does not compile")):
        assert (
            cli_main(["generate", "Hi", "--model", "no/such/model", "--chat-template", value]) == 2
        )
        assert error in capsys.readouterr().err


def test_cli_reports_bad_arguments(capsys):
    assert cli_main(["generate", "hi", "--model", "no/such/model.gguf"]) == 2
    assert "not found" in capsys.readouterr().err
    assert cli_main(["generate", "hi", "--max-tokens", "-1"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_a_warm_up_records_graphs_and_leaves_no_other_trace(smollm_gguf):
    """Engine.warm_up: the op graphs of the shapes it met are recorded (what it is for); the
    counters of stats(), the suffix drafter's history and the prefix cache are as before it. A
    request after it is decoded as by a fresh engine (greedy)."""
    from specinfer.suffix import SuffixDrafter

    def fresh():
        return Engine(smollm_gguf, dtype="bfloat16", ssm=["ngram", "suffix"])

    engine, params = fresh(), SamplingParams(max_tokens=12, temperature=0)
    (suffix,) = [s for s in engine.drafter.ssms if isinstance(s, SuffixDrafter)]
    before, served = engine.stats(), len(suffix.history.tokens)
    engine.warm_up(requests=2, tokens=8)
    graphs = engine.runner.graphs
    assert graphs._graphs and graphs.replays > 0, "no op graph recorded or replayed"
    assert engine.stats() == before
    assert len(suffix.history.tokens) == served
    assert not engine.kv.prefix.block_of  # nor its prompt's blocks
    prompt = "The capital of France is"
    assert (
        engine.generate(prompt, params)[0].token_ids
        == fresh().generate(prompt, params)[0].token_ids
    )
    # What is served after it is recorded again.
    assert engine.stats()["prompt_tokens_total"] > 0
    engine.generate("Another prompt", params)  # the first one joins the history at its row's reuse
    assert len(suffix.history.tokens) > served
    # A context too short for the warm-up's prompt: nothing to warm, and no error.
    short = Engine(smollm_gguf, dtype="bfloat16", max_model_len=16)
    short.warm_up()
    assert not short.runner.graphs._graphs
