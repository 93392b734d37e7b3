"""Tool calling's pieces without a model: the tools a request declares (and the 400s for bad
ones), an answer's tool-call blocks read back as OpenAI tool_calls, a stream that holds back a
tool call's text, earlier calls written back into a conversation, and the grammar that forces
calls (llguidance accepts it and holds an answer to it). The server's end-to-end test, with the
`openai` client, is test_server.py's test_tool_calls."""

from __future__ import annotations

import json

import pytest

from specinfer.server.errors import APIError
from specinfer.server.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, template_format
from specinfer.server.tools import (
    CLOSE,
    OPEN,
    ToolStream,
    checked_tool_calls,
    conversation,
    parse_tools,
)

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
    checked = checked_tool_calls(calls, "messages[1]")
    assert checked[0]["function"]["arguments"] == {"city": "Oslo"}  # the object, as templates take
    turns = [{"role": "assistant", "content": None, "tool_calls": checked},
             {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]  # fmt: skip
    # A template that does not render tools: the calls in the turn's text, as Hermes blocks.
    written = conversation(turns, structured=False)
    assert written == [{"role": "assistant", "content": _block("get_weather", {"city": "Oslo"})},
                       {"role": "tool", "content": "12 C"}]  # fmt: skip
    parsed = parse_tools(TOOLS, None, None).parse(written[0]["content"], "stop")[1]
    assert parsed[0]["function"] == calls[0]["function"]
    said = conversation([{**turns[0], "content": "Sure."}], structured=False)[0]["content"]
    assert said.startswith("Sure.\n" + OPEN)
    # One that does: the messages as they are (content a string).
    assert conversation(turns, structured=True) == [{**turns[0], "content": ""}, turns[1]]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\] needs a function"):
        checked_tool_calls([{"id": "x"}], "messages[1]")


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
    # The formats of templates that teach others: what their grammar takes, parse reads.
    for fmt, answer in [
        (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": '
                      '"get_time", "parameters": {"timezone": "UTC"}}'),
        (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
                  '"arguments": {"timezone": "UTC"}}]'),
    ]:  # fmt: skip
        several, single = _with_format(fmt, "required"), _with_format(fmt, "required", False)
        assert takes(several, answer) and len(several.parse(answer, "stop")[1]) == 2
        first = answer.split(";")[0] if fmt is LLAMA3_JSON else answer.split("}}, ")[0] + "}}]"
        assert takes(single, first) and not takes(single, answer), first
        assert len(single.parse(first, "stop")[1]) == 1
        assert not takes(several, good)


def _with_format(fmt, choice=None, parallel=None):
    tools = parse_tools(TOOLS, choice, parallel)
    tools.format = fmt
    return tools


def test_the_format_a_template_teaches():
    llama = ('Respond in the format {"name": function name, "parameters": dictionary of argument '
             'name and its value}. {%- for t in tools %}{{ t | tojson }}{% endfor %}')  # fmt: skip
    assert template_format(llama) is LLAMA3_JSON
    assert template_format("{{ '[AVAILABLE_TOOLS]' }}{{ tools }}{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert template_format("<tools>{{ tools }}</tools> answer in <tool_call></tool_call>") is HERMES
    assert template_format("{{ tools }}") is HERMES  # none we know: the one we ask for


def test_llama3_and_mistral_answers_are_calls():
    weather, time = {"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time"}
    llama, single = _with_format(LLAMA3_JSON), _with_format(LLAMA3_JSON, parallel=False)
    for answer, names in [
        (json.dumps(weather), ["get_weather"]),
        ("<|python_tag|>" + json.dumps(weather) + "\n", ["get_weather"]),
        (json.dumps(weather) + "; " + json.dumps(time), ["get_weather", "get_time"]),
    ]:  # fmt: skip
        content, calls = llama.parse(answer, "stop")
        assert content is None and [c["function"]["name"] for c in calls] == names, answer
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    pair = json.dumps(weather) + ";" + json.dumps(time)
    bad_arguments = json.dumps({**weather, "parameters": [1]})
    for answer, t in [("It is sunny.", llama), (pair, single), (json.dumps(weather) + " ok", llama),
                      ('{"name": "get_news", "parameters": {}}', llama), ("{bad", llama),
                      (bad_arguments, llama)]:  # fmt: skip
        assert t.parse(answer, "stop") == (answer, []), answer
    assert llama.parse(json.dumps(weather), "length") == (json.dumps(weather), [])
    mistral = _with_format(MISTRAL)
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    for answer in ["[TOOL_CALLS] " + json.dumps([call]), json.dumps([call, {"name": "get_time"}])]:
        content, calls = mistral.parse(answer, "stop")
        assert content is None and calls[0]["function"]["name"] == "get_weather"
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)  # its template's rule
    for answer in ["[1, 2]", "[TOOL_CALLS] []", "Sunny [really]", json.dumps(call)]:
        assert mistral.parse(answer, "stop") == (answer, []), answer


def test_a_call_may_name_its_arguments_either_way():
    """Models trained on one format write the other's key at times: "arguments" in a Llama 3
    answer, "parameters" in a Hermes block, or none for a function without parameters."""
    weather = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    content, calls = _with_format(LLAMA3_JSON).parse(json.dumps(weather), "stop")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    block = f'{OPEN}\n{{"name": "get_weather", "parameters": {{"city": "Oslo"}}}}\n{CLOSE}'
    assert json.loads(parse_tools(TOOLS, None, None).parse(block, "stop")[1][0]["function"]
                      ["arguments"]) == {"city": "Oslo"}  # fmt: skip
    bare = f'{OPEN}\n{{"name": "get_time"}}\n{CLOSE}'
    assert parse_tools(TOOLS, None, None).parse(bare, "stop")[1][0]["function"]["arguments"] == "{}"
    odd = f'{OPEN}\n{{"name": "get_time", "args": {{"timezone": "UTC"}}}}\n{CLOSE}'
    assert parse_tools(TOOLS, None, None).parse(odd, "stop") == (odd, [])


def test_history_calls_follow_the_template_that_renders(smollm_gguf):
    """With named templates, a chat without tools is rendered by "default": if it does not read
    tools, earlier calls are written in as Hermes text rather than handed over structured."""
    from specinfer.server.protocol import ChatCompletionRequest
    from specinfer.tokenizer import TokenizerWrapper

    tok = TokenizerWrapper.from_path(smollm_gguf)
    tok.named_templates = {"default": "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                                      "{% endfor %}", "tool_use": TOOL_TEMPLATE}  # fmt: skip
    tok.chat_template = tok.named_templates["default"]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "12 C"}]  # fmt: skip
    plain = ChatCompletionRequest(model="m", messages=messages)
    text = tok.decode(plain.chat_prompt(tok), skip_special_tokens=False)
    assert "<assistant><tool_call>" in text and '"city": "Oslo"' in text
    with_tools = ChatCompletionRequest(model="m", messages=messages, tools=TOOLS)
    text = tok.decode(with_tools.chat_prompt(tok), skip_special_tokens=False)
    assert text.startswith("<tools>") and "<tool_call>" not in text


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL])
def test_a_stream_holds_back_a_whole_answer_call(fmt):
    call = {"name": "get_weather", fmt.key: {"city": "Oslo"}}
    text = fmt.tag + " " + (json.dumps([call]) if fmt is MISTRAL else json.dumps(call))
    stream = ToolStream(_with_format(fmt))
    assert "".join(stream.feed(ch) for ch in text) == ""
    rest, calls = stream.finish("stop")
    assert rest == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    for answer in ["It is sunny {really}.", "  {not a call", " [1]"]:
        stream = ToolStream(_with_format(fmt))
        sent = "".join(stream.feed(answer[i : i + 2]) for i in range(0, len(answer), 2))
        rest, calls = stream.finish("stop")
        assert sent + rest == answer and calls == [], answer
        held = answer.lstrip().startswith(fmt.open or "{")  # it began as calls do
        assert sent == ("" if held else answer)  # else sent as it came


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
    ours, declared = tools.prompt(tok, messages)
    assert ours[0]["role"] == "system" and "get_weather" in ours[0]["content"]
    assert ours[1:] == messages and declared is None
    tok.chat_template = TOOL_TEMPLATE
    assert tok.renders_tools
    given, declared = tools.prompt(tok, messages)
    rendered = tok.apply_chat_template(given, tools=declared)
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
