"""Tool calling's pieces without a model: the tools a request declares (and the 400s for bad
ones), an answer's tool-call blocks read back as OpenAI tool_calls, a stream that holds back a
tool call's text, earlier calls written back into a conversation, and the grammar that forces
calls (llguidance accepts it and holds an answer to it). The server's end-to-end test, with the
`openai` client, is test_server.py's test_tool_calls."""

from __future__ import annotations

import json

import pytest

from specinfer.server.errors import APIError
from specinfer.server.tools import CLOSE, OPEN, ToolStream, parse_tools, render_tool_calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone"}},
]


def _block(name: str, arguments: dict) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def test_declared_tools_and_choices():
    auto = parse_tools(TOOLS, None, None)
    assert list(auto.functions) == ["get_weather", "get_time"]
    assert auto.functions["get_time"] == ("Time in a zone", {"type": "object"})
    assert not auto.forced and auto.parallel
    assert parse_tools(TOOLS, "none", None) is None and parse_tools(None, None, None) is None
    required = parse_tools(TOOLS, "required", False)
    assert required.forced and required.only is None and not required.parallel
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.forced and named.only == "get_time"
    # A function may be named like a choice: the named form still picks it alone.
    tools = [{"type": "function", "function": {"name": "auto"}}]
    assert parse_tools(tools, {"type": "function", "function": {"name": "auto"}}, None).forced


@pytest.mark.parametrize("tools, choice, parallel, message, param", [
    (None, "auto", None, "tool_choice needs tools", "tool_choice"),
    ({"type": "function"}, None, None, "tools must be a list", "tools"),
    ([{"type": "code"}], None, None, 'tools[0] must be {"type": "function"', "tools"),
    ([{"type": "function", "function": {"name": "a b"}}], None, None,
     "tools[0].function.name must be 1-64 letters", "tools"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, None, None,
     "two functions are named 'f'", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, None,
     "parameters must be a JSON schema object", "tools"),
    (TOOLS, "always", None, "tool_choice must be none, auto, required", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None,
     "tool_choice must name one of the tools", "tool_choice"),
    (TOOLS, "auto", "yes", "parallel_tool_calls must be a boolean", "parallel_tool_calls"),
])  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(tools, choice, parallel, message, param):
    with pytest.raises(APIError) as e:
        parse_tools(tools, choice, parallel)
    assert e.value.status == 400 and message in e.value.message and e.value.param == param


def test_an_answer_of_blocks_is_tool_calls():
    tools = parse_tools(TOOLS, None, None)
    text = (
        "Let me look.\n" + _block("get_weather", {"city": "Oslo"}) + "\n" + _block("get_time", {})
    )
    content, calls = tools.parse(text, "stop")
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # An unclosed last block at the end of an answer that ended still counts.
    assert tools.parse(text.removesuffix(f"\n{CLOSE}"), "stop")[1]
    # Not calls: cut short, no blocks, bad JSON, an undeclared name, arguments not an object,
    # several calls where one is allowed. The text comes back whole, as content.
    single = parse_tools(TOOLS, None, False)
    for answer, reason, t in [
        (text, "length", tools),
        ("It is sunny.", "stop", tools),
        (f"{OPEN}\n{{'name': 'get_time'}}\n{CLOSE}", "stop", tools),
        (_block("get_news", {}), "stop", tools),
        (f'{OPEN}{{"name": "get_time", "arguments": [1]}}{CLOSE}', "stop", tools),
        (text, "stop", single),
    ]:  # fmt: skip
        assert t.parse(answer, reason) == (answer, []), answer
    assert single.parse(_block("get_time", {}), "stop")[0] is None


@pytest.mark.parametrize("forced", [False, True])
def test_a_stream_holds_back_a_tool_call(forced):
    tools = parse_tools(TOOLS, "required" if forced else "auto", None)
    text = "Checking " + _block("get_weather", {"city": "Oslo"})
    stream = ToolStream(tools)
    sent = "".join(stream.feed(ch) for ch in text)  # the worst split: a character at a time
    rest, calls = stream.finish("stop")
    assert sent == ("" if forced else "Checking")  # the space might have ended the content
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    ]
    assert sent + rest == tools.parse(text, "stop")[0] == "Checking"
    # Text that only looks like a call's start is all sent: as it comes, or at the end.
    for answer in ["a <tool b", "x <tool_call> y", "ends with <tool_ca", " spaced \n "]:
        stream = ToolStream(parse_tools(TOOLS, None, None))
        sent = "".join(stream.feed(answer[i : i + 3]) for i in range(0, len(answer), 3))
        rest, calls = stream.finish("stop")
        assert sent + rest == answer and calls == [], answer
    stream = ToolStream(parse_tools(TOOLS, None, None))
    assert stream.feed("a <tool b") == "a <tool b"  # sent as soon as it cannot be an opening


def test_earlier_calls_are_written_back_in_the_answer_format():
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]  # fmt: skip
    written = render_tool_calls(None, calls, "messages[1]")
    assert written == _block("get_weather", {"city": "Oslo"})
    assert (
        parse_tools(TOOLS, None, None).parse(written, "stop")[1][0]["function"]
        == calls[0]["function"]
    )
    assert render_tool_calls("Sure.", calls, "m").startswith("Sure.\n" + OPEN)
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\] needs a function"):
        render_tool_calls(None, [{"id": "x"}], "messages[1]")


def test_the_forced_grammar_holds_an_answer_to_calls(smollm_gguf):
    """llguidance accepts the grammar, which takes a well-formed call of a declared tool whose
    arguments match its schema, and refuses the others."""
    from specinfer import Engine, SamplingParams

    engine = Engine(smollm_gguf, dtype="bfloat16")
    tok = engine.tokenizer

    def takes(tools, text: str) -> bool:
        grammar = engine.grammars.compile(SamplingParams(grammar=tools.grammar()))
        return all(grammar.consume(t) for t in tok.encode(text, add_special_tokens=False))

    single, several = parse_tools(TOOLS, "required", False), parse_tools(TOOLS, "required", None)
    good = _block("get_weather", {"city": "Oslo"})
    assert takes(single, good) and takes(several, good + "\n" + _block("get_time", {}))
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert takes(named, _block("get_time", {})) and not takes(named, good)
    for bad in [_block("get_weather", {"town": "Oslo"}), _block("get_news", {}), "Sunny.",
                good + "\n" + good]:  # fmt: skip
        assert not takes(single, bad), bad


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_that_renders_tools_is_given_them(smollm_gguf):
    """A chat template that reads `tools` renders them itself (the format its model knows);
    one that does not (the default model's) gets our system message. A template that refuses
    the messages is a ValueError naming it, not a crash."""
    from specinfer.tokenizer import TokenizerWrapper

    tok = TokenizerWrapper.from_path(smollm_gguf)
    tools = parse_tools(TOOLS, None, None)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    assert not tok.renders_tools
    ours = tools.prompt(tok, messages)
    assert ours[0]["role"] == "system" and "get_weather" in ours[0]["content"]
    assert ours[1:] == messages
    tok.chat_template = TOOL_TEMPLATE
    assert tok.renders_tools
    rendered = tok.decode(tools.prompt(tok, messages))
    assert rendered == "<tools>get_weather;get_time;</tools>\n<user>Weather in Oslo?\n<assistant>"
    tok.chat_template = "You may have tools. {{ raise_exception('roles must alternate') }}"
    assert not tok.renders_tools  # the word alone is not the variable
    with pytest.raises(ValueError, match="chat template refused these messages: roles must"):
        tok.apply_chat_template(messages)


def test_forced_calls_under_speculation_equal_incremental_decoding(smollm_gguf):
    """The forced grammar masks a verified tree's rows as any structured output does: greedy
    speculative output equals incremental, token for token, and is a call."""
    from specinfer import Engine, SamplingParams

    tools = parse_tools(TOOLS, "required", False)
    chats = [[{"role": "user", "content": q}] for q in ("Weather in Oslo?", "What time is it?")]
    prompts = [tools.messages(chat) for chat in chats]
    params = SamplingParams(max_tokens=48, grammar=tools.grammar())
    spec = Engine(smollm_gguf, dtype="bfloat16", ssm=["default", "ngram"]).generate(prompts, params)
    plain = Engine(smollm_gguf, dtype="bfloat16").generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics["tokens_per_step"] > 1 for o in spec), "nothing was speculated"
    finished = [o for o in spec if o.finish_reason == "stop"]  # the grammar completed
    assert finished and all(tools.parse(o.text, "stop")[1] for o in finished)
