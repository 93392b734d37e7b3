"""The OpenAI-compatible server (specinfer.server) over a real engine on the default model.

One uvicorn server runs in a background thread for the module, over Engine(bfloat16, default SSM
+ n-gram) and AsyncEngine; requests go through the `openai` client (and httpx for raw bodies and
disconnects). Greedy outputs are checked against Engine.generate, run with the same
SamplingParams before the server starts. `specinfer serve` is tested as a subprocess: ready line,
one request, SIGTERM with a request in flight, exit status 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

for _module in ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specinfer import SamplingParams  # noqa: E402
from specinfer.engine import AsyncEngine, Engine  # noqa: E402
from specinfer.server import build_app  # noqa: E402
from specinfer.server.protocol import MAX_N  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
CHAT = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"
# Greedy references, computed with Engine.generate before the server starts.
REFERENCES = {
    "chat": (CHAT, SamplingParams(max_tokens=12)),
    "completion": (PROMPT, SamplingParams(max_tokens=12)),
    "stop": (PROMPT, SamplingParams(max_tokens=12, stop=["\n", "."])),
    "chat_logprobs": (CHAT, SamplingParams(max_tokens=12, logprobs=3)),
    "completion_logprobs": (PROMPT, SamplingParams(max_tokens=12, logprobs=2)),
    "echo": (PROMPT, SamplingParams(max_tokens=4, logprobs=1, prompt_logprobs=1)),
}
LOGPROB_TOLERANCE = 0.05  # bfloat16: the server's batches and trees may differ from the reference's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ThreadedServer:
    """uvicorn.Server on 127.0.0.1, an OS-chosen port, in a daemon thread."""

    def __init__(self, app, deadline_s: float = 30.0):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + deadline_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="module")
def served(smollm_gguf):
    engine = Engine(smollm_gguf, dtype="bfloat16", ssm=["default", "ngram"], max_batch_size=4,
                    max_model_len=MAX_MODEL_LEN)  # fmt: skip
    refs = {key: engine.generate(prompt, params)[0] for key, (prompt, params) in REFERENCES.items()}
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, MODEL)
    server = _ThreadedServer(app)
    base = f"http://127.0.0.1:{server.port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
    http = httpx.Client(base_url=base, timeout=60)
    try:
        yield SimpleNamespace(engine=engine, app=app, base=base, client=client, http=http,
                              refs=refs)  # fmt: skip
    finally:
        http.close()
        server.stop()
        asyncio.run(async_engine.shutdown(5))


def _sse(lines) -> list:
    """The payloads of `data: ...` lines ("[DONE]" kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _wait_idle(engine, deadline_s: float = 30.0) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"the engine still holds requests after {deadline_s} s: {stats}")
        time.sleep(0.05)


def _metrics(served) -> dict:
    """{(sample name, labels as a sorted tuple): value} from /metrics."""
    text = served.http.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# -- generation --------------------------------------------------------------------------------


def test_chat_greedy_equals_engine(served):
    ref = served.refs["chat"]
    r = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    prompt_tokens = len(served.engine.prompt_ids(CHAT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, len(ref.token_ids))
    assert r.usage.total_tokens == prompt_tokens + len(ref.token_ids)


def test_chat_stream_with_usage(served):
    ref = served.refs["chat"]
    chunks = list(
        served.client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == ref.finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_equals_engine(served):
    ref = served.refs["completion"]
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(served.engine.prompt_ids(PROMPT))
    assert r.usage.completion_tokens == len(ref.token_ids)
    # Streamed: the same text; the raw lines end in [DONE].
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    with served.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ref.text
    assert events[-2]["choices"][0]["finish_reason"] == ref.finish_reason


def test_stop_strings(served):
    ref = served.refs["stop"]
    assert ref.finish_reason == "stop"  # the reference must actually stop
    r = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=["\n", "."]
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "stop")
    r = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop="."
    )
    assert r.choices[0].text == ref.text and "." not in r.choices[0].text
    # stop_token_ids (vLLM's): the first of them generated ends the completion, left out of it.
    ids = served.refs["completion"].token_ids
    k = ids.index(ids[4])
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"stop_token_ids": [ids[4]]})  # fmt: skip
    tokenizer = served.engine.tokenizer
    assert (r.choices[0].text, r.choices[0].finish_reason) == (tokenizer.decode(ids[:k]), "stop")
    assert r.usage.completion_tokens == k + 1


def test_n_choices_and_seeds(served):
    ref = served.refs["completion"]
    r = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [ref.text, ref.text]
    assert r.usage.completion_tokens == 2 * len(ref.token_ids)
    assert r.usage.prompt_tokens == len(served.engine.prompt_ids(PROMPT))
    # Sampling with a seed: choice i draws with seed + i.
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    pair = served.client.completions.create(n=2, seed=5, **kw)
    second = served.client.completions.create(n=1, seed=6, **kw)
    assert pair.choices[1].text == second.choices[0].text
    # Chat, streamed, n=2: each index gets its own deltas and finish.
    chunks = list(served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, n=2, stream=True
    ))  # fmt: skip
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == served.refs["chat"].text
        assert mine[-1].finish_reason == served.refs["chat"].finish_reason


def _close_to_reference(ref, token_ids: list[int], logprobs: list[float], tops: list[list]):
    """The engine's greedy reference: same tokens; logprobs and each step's top tokens within
    bfloat16's tolerance (a top token may swap with a neighbour as close as that)."""
    assert token_ids == ref.token_ids
    for got, want, top in zip(logprobs, ref.logprobs, tops):
        assert got <= 0 and abs(got - want.logprob) < LOGPROB_TOLERANCE
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        for (token, lp), (want_token, want_lp) in zip(top, want.top):
            assert abs(lp - want_lp) < LOGPROB_TOLERANCE
            assert token == want_token or abs(lp - want_lp) < LOGPROB_TOLERANCE / 2


def test_chat_logprobs(served):
    ref, tokenizer = served.refs["chat_logprobs"], served.engine.tokenizer
    ids = {tokenizer.decode([t], skip_special_tokens=False): t for t in range(tokenizer.vocab_size)}
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True,
          "top_logprobs": 3}  # fmt: skip
    r = served.client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].message.content.startswith("".join(e.token for e in content[:-1]))
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy: the most likely token was chosen
    _close_to_reference(
        ref,
        [ids[e.token] for e in content],
        [e.logprob for e in content],
        [[(ids[t.token], t.logprob) for t in e.top_logprobs] for e in content],
    )
    # Streamed: the same entries, spread over the chunks; none without logprobs: null.
    chunks = list(served.client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < LOGPROB_TOLERANCE
    plain = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert plain.choices[0].logprobs is None
    null = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": None}  # as some send
    assert (
        served.http.post("/v1/chat/completions", json=null).json()["choices"][0]["logprobs"] is None
    )
    only_chosen = served.client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert all(e.top_logprobs == [] for e in only_chosen.choices[0].logprobs.content)


def test_completion_logprobs(served):
    ref, tokenizer = served.refs["completion_logprobs"], served.engine.tokenizer
    ids = {tokenizer.decode([t], skip_special_tokens=False): t for t in range(tokenizer.vocab_size)}
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                         temperature=0, logprobs=2)  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    if r.choices[0].finish_reason == "length":
        assert "".join(lp.tokens) == r.choices[0].text
    tops = [sorted(((ids[t], v) for t, v in top.items()), key=lambda x: -x[1])
            for top in lp.top_logprobs]  # fmt: skip
    assert all(len(top) == 2 for top in tops)
    _close_to_reference(ref, [ids[t] for t in lp.tokens], lp.token_logprobs, tops)
    # Streamed: each chunk's offsets continue where the last chunk's tokens ended.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2,
            "stream": True}  # fmt: skip
    with served.http.stream("POST", "/v1/completions", json=body) as resp:
        events = [e for e in _sse(resp.iter_lines()) if e != "[DONE]"]
    parts = [e["choices"][0]["logprobs"] for e in events]
    assert [t for p in parts for t in p["tokens"]] == lp.tokens
    assert [o for p in parts for o in p["text_offset"]] == lp.text_offset
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=0)
    assert r.choices[0].logprobs.top_logprobs is None and len(r.choices[0].logprobs.tokens) == 3


def test_completion_echo_with_prompt_logprobs(served):
    ref, tokenizer = served.refs["echo"], served.engine.tokenizer
    prompt_ids = served.engine.prompt_ids(PROMPT)
    kw = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "echo": True}
    r = served.client.completions.create(max_tokens=4, logprobs=1, **kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT + ref.text
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False)
                         for t in prompt_ids + ref.token_ids]  # fmt: skip
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e.logprob for e in ref.prompt_logprobs[1:] + ref.logprobs]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < LOGPROB_TOLERANCE
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert r.usage.completion_tokens == len(ref.token_ids)
    # Streamed: the prompt and its logprobs open the stream; offsets run on.
    body = {**kw, "max_tokens": 4, "logprobs": 1, "stream": True}
    with served.http.stream("POST", "/v1/completions", json=body) as resp:
        events = [e["choices"][0] for e in _sse(resp.iter_lines()) if e != "[DONE]"]
    assert events[0]["text"].startswith(PROMPT)
    assert "".join(e["text"] for e in events) == r.choices[0].text
    assert [o for e in events for o in e["logprobs"]["text_offset"]] == lp.text_offset
    # max_tokens 0 scores the prompt alone; echo without logprobs is text only.
    scored = served.client.completions.create(max_tokens=0, logprobs=0, **kw)
    assert scored.choices[0].text == PROMPT and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1 : len(prompt_ids)], abs=LOGPROB_TOLERANCE
    )
    assert scored.choices[0].logprobs.top_logprobs is None
    plain = served.client.completions.create(max_tokens=4, **kw)
    assert plain.choices[0].text == r.choices[0].text and plain.choices[0].logprobs is None


def test_logit_bias(served):
    ref = served.refs["completion"]
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    first = str(ref.token_ids[0])
    banned = served.client.completions.create(logit_bias={first: -100}, logprobs=1, **kw)
    lp, banned_text = banned.choices[0].logprobs, served.engine.tokenizer.decode([ref.token_ids[0]])
    assert lp.tokens[0] != banned_text
    assert list(lp.top_logprobs[0]) == [banned_text]  # logprobs are the raw model's
    forced = served.client.completions.create(logit_bias={"504": 100}, logprobs=0, **kw)
    tokens = forced.choices[0].logprobs.tokens
    assert tokens == [served.engine.tokenizer.decode([504])] * 6
    chat = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                                 temperature=0, logit_bias={"504": 100})  # fmt: skip
    assert chat.choices[0].message.content == served.engine.tokenizer.decode([504] * 3)


def test_structured_output(served):
    """response_format json_schema (as the openai client's parse() sends a pydantic model's),
    json_object, and vLLM's structured_outputs choice / regex; streamed equals not."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        country: str
        population: int

    messages = [{"role": "user", "content": "Describe the largest city of Japan as JSON with its "
                 "name, country and population."}]  # fmt: skip
    kw = {"model": MODEL, "messages": messages, "max_tokens": 100, "temperature": 0}
    parsed = served.client.chat.completions.parse(response_format=City, **kw)
    assert isinstance(parsed.choices[0].message.parsed, City), parsed.choices[0].message.content
    assert parsed.choices[0].finish_reason == "stop"
    json_object = served.client.chat.completions.create(
        response_format={"type": "json_object"}, **kw
    )
    content = json_object.choices[0].message.content
    assert content.startswith("{")  # a model this small may run out of tokens in a string
    assert json_object.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict)
    stream = served.client.chat.completions.create(response_format={"type": "json_object"},
                                                   stream=True, **kw)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == json_object.choices[0].message.content
    choice = served.client.chat.completions.create(
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}}, **kw
    )
    assert choice.choices[0].message.content in ("red", "green", "blue")
    regex = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                             extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})  # fmt: skip
    assert re.fullmatch("[0-9]{3}", regex.choices[0].text), regex.choices[0].text


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
     "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                    "required": ["timezone"], "additionalProperties": False}}},
]  # fmt: skip


def test_tool_calls(served):
    """tool_choice required / named: the answer is tool calls (finish "tool_calls"), their
    arguments match the tool's schema, streamed as not; a conversation with the calls and the
    tool's answer goes on; auto: streamed equals not, whatever the model chose."""
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    kw = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 60,
          "parallel_tool_calls": False}  # fmt: skip
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_time"})):
        answer = served.client.chat.completions.create(tool_choice=choice, **kw).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        (call,) = answer.message.tool_calls
        assert call.type == "function" and call.function.name in names
        key = "city" if call.function.name == "get_weather" else "timezone"
        arguments = json.loads(call.function.arguments)
        assert list(arguments) == [key] and isinstance(arguments[key], str)
        chunks = list(served.client.chat.completions.create(tool_choice=choice, stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not "".join(d.content or "" for d in deltas)
        (streamed,) = [t for d in deltas for t in d.tool_calls or []]
        assert (streamed.function.name, streamed.function.arguments) == (
            call.function.name, call.function.arguments)  # fmt: skip
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The client's own helper: a pydantic model as a strict tool, its arguments parsed back.
    import pydantic

    class GetWeather(pydantic.BaseModel):
        """The weather in a city."""

        city: str

    tool = openai.pydantic_function_tool(GetWeather)
    parsed = served.client.chat.completions.parse(
        **{**kw, "tools": [tool], "tool_choice": "required"}
    ).choices[0]
    assert isinstance(parsed.message.tool_calls[0].function.parsed_arguments, GetWeather)
    # The calls and the tool's answer, as a client sends them back.
    history = [*messages, answer.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]  # fmt: skip
    follow = served.client.chat.completions.create(**{**kw, "messages": history})
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls
    auto = served.client.chat.completions.create(**kw).choices[0]
    chunks = list(served.client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert ("".join(d.content or "" for d in deltas) or None) == auto.message.content
    streamed = [(t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls or []]
    assert streamed == [(t.function.name, t.function.arguments)
                        for t in auto.message.tool_calls or []]  # fmt: skip


# A tool-aware template in Llama 3's manner: it describes the tools, asks for its JSON format,
# and writes earlier calls and tool answers itself.
LLAMA_STYLE = (
    '{%- if tools %}<|tools|>Respond in the format {"name": function name, "parameters": '
    "dictionary of argument name and its value}.\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}{% endif %}{% for m in messages %}<|{{ m.role }}|>{% if m.tool_calls %}"
    '{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": '
    "{{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tool_calls_in_the_format_the_template_teaches(served):
    """A model whose template teaches Llama 3's JSON calls: a forced answer is written in it
    (and comes back as tool_calls), and the calls and tool answers sent back are rendered by
    the template, structured, not as our Hermes blocks."""
    tok = served.engine.tokenizer
    saved = tok.chat_template
    tok.chat_template = LLAMA_STYLE
    try:
        messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
        kw = {"model": MODEL, "tools": TOOLS, "temperature": 0, "max_tokens": 60,
              "parallel_tool_calls": False, "tool_choice": "required"}  # fmt: skip
        answer = served.client.chat.completions.create(messages=messages, logprobs=True,
                                                       **kw).choices[0]  # fmt: skip
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        (call,) = answer.message.tool_calls
        arguments = json.loads(call.function.arguments)
        raw = "".join(t.token for t in answer.logprobs.content)  # the answer as generated
        assert raw.startswith('{"name": "') and '"parameters": {' in raw
        history = [*messages, answer.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "12 C"}]  # fmt: skip
        body = {"model": MODEL, "messages": history, "tools": TOOLS}
        rendered = served.http.post("/tokenize", json=body).json()["tokens"]
        text = tok.decode(rendered, skip_special_tokens=False)
        written = json.dumps({"name": call.function.name, "parameters": arguments})
        assert f"<|assistant|>{written}<|tool|>12 C<|assistant|>" in text
        assert "<tool_call>" not in text and "Respond in the format" in text
        stream = served.client.chat.completions.create(messages=messages, stream=True, **kw)
        deltas = [c.choices[0].delta for c in stream if c.choices]
        (streamed,) = [t for d in deltas for t in d.tool_calls or []]
        assert (streamed.function.name, streamed.function.arguments) == (
            call.function.name, call.function.arguments)  # fmt: skip
    finally:
        tok.chat_template = saved


def test_continue_final_message_and_add_generation_prompt(served):
    """vLLM's extensions: the model goes on with the last (assistant) message's content, greedy
    as a completion of the same ids; add_generation_prompt false leaves the turn unopened."""
    tok = served.engine.tokenizer
    started = [*CHAT, {"role": "assistant", "content": "1. Red"}]
    reply = served.client.chat.completions.create(
        model=MODEL, messages=started, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True})  # fmt: skip
    ids = tok.chat_ids(started, continue_final=True)
    assert tok.decode(ids).endswith("assistant\n1. Red")
    # The engine is the server's now: the reference is a completion of those very ids.
    reference = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                                 temperature=0).choices[0]  # fmt: skip
    assert reply.choices[0].message.content == reference.text
    assert reply.usage.prompt_tokens == len(ids)

    def count(**extra) -> int:
        return served.http.post("/tokenize", json={"model": MODEL, "messages": CHAT,
                                                   **extra}).json()["count"]  # fmt: skip

    opened = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert count() - count(add_generation_prompt=False) == len(opened)
    both = {"model": MODEL, "messages": started, "continue_final_message": True,
            "add_generation_prompt": True}  # fmt: skip
    r = served.http.post("/v1/chat/completions", json=both)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_the_served_engine_refuses_requests_from_other_threads(served):
    """While an AsyncEngine runs the engine, a request sent to the Engine itself is refused (it
    would corrupt the batch the engine thread holds); the server goes on serving."""
    with pytest.raises(RuntimeError, match="AsyncEngine runs this engine"):
        served.engine.generate(PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="AsyncEngine runs this engine"):
        served.engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="intruder")
    assert served.engine.scheduler.find("intruder") is None  # not queued beside the thread's
    with pytest.raises(RuntimeError, match="AsyncEngine runs this engine"):
        served.engine.step()
    ref = served.refs["completion"]
    out = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == ref.text
    assert served.http.get("/health").json() == {"status": "ok"}


# -- bad input ---------------------------------------------------------------------------------

_OK = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
_OK_CHAT = {"model": MODEL, "messages": CHAT, "max_tokens": 4}

BAD = [  # (endpoint, body (dict, or raw text), status, text the message holds, param)
    ("completions", "{not json", 400, "invalid JSON", None),
    ("completions", "[1, 2]", 400, "valid dictionary", None),
    ("completions", {"model": MODEL}, 400, "prompt: Field required", "prompt"),
    ("chat/completions", {"model": MODEL}, 400, "messages: Field required", "messages"),
    ("chat/completions", {**_OK_CHAT, "messages": []}, 400, "must not be empty", "messages"),
    ("chat/completions", {**_OK_CHAT, "messages": [{"role": "user"}]}, 400, "content", "messages"),
    ("completions", {**_OK, "max_tokens": "ten"}, 400, "valid integer", "max_tokens"),
    ("completions", {**_OK, "max_tokens": 1.5}, 400, "valid integer", "max_tokens"),
    ("completions", {**_OK, "temperature": "hot"}, 400, "valid number", "temperature"),
    ("completions", {**_OK, "min_p": 1.5}, 400, "min_p must be in [0, 1]", "min_p"),
    ("completions", {**_OK, "min_tokens": 5}, 400, "min_tokens must be an integer in",
     "min_tokens"),
    ("completions", {**_OK, "stop_token_ids": [10**9]}, 400, "outside the vocabulary",
     "stop_token_ids"),
    ("chat/completions", {**_OK_CHAT, "stop_token_ids": [-2]}, 400, "stop_token_ids must be",
     "stop_token_ids"),
    ("completions", {**_OK, "prompt": 5}, 400, "prompt must be", "prompt"),
    ("completions", {**_OK, "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0", "max_tokens"),
    ("completions", {**_OK, "max_tokens": -3}, 400, "max_tokens must be at least 1, got -3", "max_tokens"),
    ("chat/completions", {**_OK_CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens must be at least 1", "max_completion_tokens"),
    ("completions", {**_OK, "max_tokens": MAX_MODEL_LEN}, 400,
     f"maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
     f"{MAX_MODEL_LEN + 5} tokens (5 in the prompt, {MAX_MODEL_LEN} for the completion)",
     "max_tokens"),
    ("completions", {**_OK, "prompt": [1] * (MAX_MODEL_LEN + 6)}, 400,
     f"has {MAX_MODEL_LEN + 6} tokens; this engine serves up to max_model_len={MAX_MODEL_LEN}",
     "prompt"),
    ("completions", {**_OK, "prompt": ""}, 400, "empty", "prompt"),
    ("completions", {**_OK, "prompt": [1, 10**9]}, 400, "out of range", "prompt"),
    ("completions", {**_OK, "n": MAX_N + 1}, 400, f"n must be between 1 and {MAX_N}", "n"),
    ("completions", {**_OK, "n": 0}, 400, "n must be between", "n"),
    ("completions", {**_OK, "temperature": -1}, 400, "temperature must be", "temperature"),
    ("completions", {**_OK, "top_p": 1.5}, 400, "top_p must be in (0, 1]", "top_p"),
    ("completions", {**_OK, "top_k": -2}, 400, "top_k must be", "top_k"),
    ("completions", {**_OK, "presence_penalty": 3}, 400, "presence_penalty must be in [-2, 2]",
     "presence_penalty"),
    ("completions", {**_OK, "repetition_penalty": 0}, 400, "repetition_penalty must be",
     "repetition_penalty"),
    ("completions", {**_OK, "stop": [""]}, 400, "stop strings must be non-empty", "stop"),
    ("completions", {**_OK, "stop": [1]}, 400, "stop must be a string or a list", "stop"),
    ("completions", {**_OK, "logprobs": 21}, 400, "logprobs must be between 0 and 20, got 21",
     "logprobs"),
    ("completions", {**_OK, "logprobs": True}, 400, "valid integer", "logprobs"),
    ("chat/completions", {**_OK_CHAT, "top_logprobs": 2}, 400,
     "top_logprobs requires logprobs to be true", "top_logprobs"),
    ("chat/completions", {**_OK_CHAT, "logprobs": True, "top_logprobs": -1}, 400,
     "top_logprobs must be between 0 and 20", "top_logprobs"),
    ("chat/completions", {**_OK_CHAT, "logprobs": 1}, 400, "valid boolean", "logprobs"),
    ("completions", {**_OK, "echo": "yes"}, 400, "valid boolean", "echo"),
    ("completions", {**_OK, "logit_bias": {"x": 1}}, 400, "logit_bias keys must be token ids",
     "logit_bias"),
    ("completions", {**_OK, "logit_bias": {"²": 1}}, 400, "logit_bias keys must be token ids",
     "logit_bias"),
    ("chat/completions", {**_OK_CHAT, "logit_bias": {"5": 101}}, 400,
     "logit_bias must map token ids", "logit_bias"),
    ("completions", {**_OK, "logit_bias": {"49152": -1}}, 400,
     "logit_bias: token ids outside the vocabulary of 49152", "logit_bias"),
    ("completions", {**_OK, "suffix": "x"}, 400, "suffix is not supported", "suffix"),
    ("chat/completions", {**_OK_CHAT, "response_format": {"type": "xml"}}, 400,
     "response_format type must be text, json_object or json_schema", "response_format"),
    ("chat/completions", {**_OK_CHAT, "response_format": {"type": "json_schema"}}, 400,
     "needs a 'json_schema' object with a 'schema'", "response_format"),
    ("chat/completions", {**_OK_CHAT, "response_format": {"type": "json_schema", "json_schema":
     {"name": "x", "schema": {"type": "nope"}}}}, 400, "json_schema is not valid", "response_format"),
    ("completions", {**_OK, "structured_outputs": {"regex": "(a"}}, 400, "regex is not valid",
     "structured_outputs"),
    ("completions", {**_OK, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs must set one of", "structured_outputs"),
    ("completions", {**_OK, "structured_outputs": {"choice": []}}, 400,
     "choice must be a non-empty list", "structured_outputs"),
    ("completions", {**_OK, "tools": TOOLS}, 400, "tools is not supported", "tools"),
    ("chat/completions", {**_OK_CHAT, "tool_choice": "required"}, 400, "tool_choice needs tools",
     "tool_choice"),
    ("chat/completions", {**_OK_CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     400, "function.name must be 1-64 letters", "tools"),
    ("chat/completions", {**_OK_CHAT, "tools": TOOLS, "tool_choice": {"type": "function",
     "function": {"name": "nope"}}}, 400, "tool_choice must name one of the tools", "tool_choice"),
    ("chat/completions", {**_OK_CHAT, "tools": TOOLS, "tool_choice": "required",
     "response_format": {"type": "json_object"}}, 400, "cannot be combined with response_format",
     "tool_choice"),
    ("chat/completions", {**_OK_CHAT, "tools": [{"type": "function", "function": {"name": "f",
     "parameters": {"type": "nope"}}}], "tool_choice": "required"}, 400,
     "a tool's parameters are not a valid JSON schema", "tools"),
    ("chat/completions", {**_OK_CHAT, "messages": [{"role": "assistant", "tool_calls": [{}]}]}, 400,
     "messages[0].tool_calls[0] needs a function", "messages"),
    ("completions", {**_OK, "stream_options": {"include_usage": True}}, 400,
     "only allowed when stream is true", "stream_options"),
    ("completions", {**_OK, "model": "gpt-4"}, 404, "The model 'gpt-4' does not exist", "model"),
    ("no/such/route", {}, 404, "Not Found", None),
]  # fmt: skip


@pytest.mark.parametrize("endpoint, body, status, message, param", BAD)
def test_bad_input(served, endpoint, body, status, message, param):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = served.http.post(f"/v1/{endpoint}", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in r.text
    if "context length" in message:
        assert error["code"] == "context_length_exceeded"
    assert served.http.get("/health").status_code == 200


def test_openai_client_raises_on_bad_input(served):
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="nope", messages=CHAT)


# -- disconnects, health, metrics --------------------------------------------------------------


def test_client_disconnect_mid_stream_aborts(served):
    before = _metrics(served)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    with served.http.stream("POST", "/v1/completions", json=body) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 6:  # a few chunks (and their blank separators), then hang up
                break
    stats = _wait_idle(served.engine)
    key = ("specinfer:requests_finished_total", (("finished_reason", "abort"),))
    after = _metrics(served)
    assert after.get(key, 0) == before.get(key, 0) + 1
    gen = "specinfer:generation_tokens_total", ()
    assert stats["generation_tokens_total"] - before[gen] < 900  # it stopped early


def test_client_disconnect_without_stream_aborts(served):
    before = _metrics(served)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        served.http.post("/v1/completions", json=body, timeout=1.5)
    _wait_idle(served.engine)
    key = ("specinfer:requests_finished_total", (("finished_reason", "abort"),))
    assert _metrics(served).get(key, 0) == before.get(key, 0) + 1


def test_health_models_and_draining(served):
    assert served.http.get("/health").json() == {"status": "ok"}
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == MAX_MODEL_LEN
    state = served.app.state.server
    state.draining = True
    try:
        assert served.http.get("/health").status_code == 503
        r = served.http.post("/v1/completions", json=_OK)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    finally:
        state.draining = False
    assert served.http.get("/health").status_code == 200


def test_health_503_while_loading():
    app = build_app(None, MODEL)  # no engine yet: what `specinfer serve` runs while loading
    server = _ThreadedServer(app)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as http:
            assert http.get("/health").status_code == 503
            r = http.post("/v1/completions", json=_OK)
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
            assert http.get("/metrics").status_code == 200
    finally:
        server.stop()


def test_metrics(served):
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    stats = _wait_idle(served.engine)
    m = _metrics(served)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "spec_decode_mean_tokens_per_step",
                 "spec_decode_draft_acceptance_rate", "spec_decode_num_draft_tokens_total"):  # fmt: skip
        assert ("specinfer:" + name, ()) in m, name
    engine_counters = {"prompt_tokens_total": "prompt_tokens_total",
                       "generation_tokens_total": "generation_tokens_total",
                       "spec_decode_num_drafts_total": "spec_drafts_total",
                       "spec_decode_num_accepted_tokens_total": "spec_accepted_tokens_total"}  # fmt: skip
    for name, stat in engine_counters.items():
        assert m["specinfer:" + name, ()] == stats[stat] > 0, name
    per_pos = {dict(labels)["position"]: v for (n, labels), v in m.items()
               if n == "specinfer:spec_decode_num_accepted_tokens_per_pos_total"}  # fmt: skip
    assert per_pos == {str(d): float(v) for d, v in enumerate(stats["spec_accepted_per_depth"])}
    assert m["specinfer:spec_decode_mean_tokens_per_step", ()] == pytest.approx(
        stats["spec_emitted_tokens_total"] / stats["spec_steps_total"]
    )
    assert m["specinfer:spec_decode_mean_tokens_per_step", ()] >= 1.0
    assert m["specinfer:num_requests_running", ()] == 0.0
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):  # fmt: skip
        assert m[f"specinfer:{hist}_count", ()] > 0, hist
        assert m[f"specinfer:{hist}_sum", ()] > 0, hist
    assert m["specinfer:requests_finished_total", (("finished_reason", "length"),)] > 0


def test_http_requests_are_counted_by_route_and_status(served):
    def count(method: str, route: str, status: int) -> float:
        labels = (("method", method), ("route", route), ("status", str(status)))
        return _metrics(served).get(("specinfer:http_requests_total", labels), 0.0)

    cases = [("POST", "/v1/completions", 200, _OK), ("POST", "/v1/completions", 400,
             {**_OK, "max_tokens": 0}), ("GET", "/v1/models/{model:path}", 404, None),
             ("GET", "unmatched", 404, None)]  # fmt: skip
    before = [count(m, r, s) for m, r, s, _ in cases]
    served.http.post("/v1/completions", json=_OK)
    served.http.post("/v1/completions", json={**_OK, "max_tokens": 0})
    served.http.get("/v1/models/nope")
    served.http.get("/no/such/route/42")
    assert [count(m, r, s) - b for (m, r, s, _), b in zip(cases, before)] == [1, 1, 1, 1]
    # A server error (raised past the middleware to the app's handler) counts as a 500.
    from fastapi.testclient import TestClient

    app = build_app(None, MODEL)

    async def broken():
        raise RuntimeError("a bug")

    app.add_api_route("/broken", broken)
    assert TestClient(app, raise_server_exceptions=False).get("/broken").status_code == 500
    families = text_string_to_metric_families(generate_latest(app.state.server.metrics.registry)
                                              .decode())  # fmt: skip
    counted = {tuple(sorted(s.labels.items())): s.value for f in families for s in f.samples
               if s.name == "specinfer:http_requests_total"}  # fmt: skip
    assert counted == {(("method", "GET"), ("route", "/broken"), ("status", "500")): 1.0}


def test_tokenize_counts_what_generation_counts_and_detokenize_reverses_it(served):
    engine = served.engine

    def post(route, body):
        return served.http.post(route, json={"model": MODEL, **body})

    r = post("/tokenize", {"messages": CHAT}).json()
    assert r["tokens"] == engine.prompt_ids(CHAT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    chat = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert chat.usage.prompt_tokens == r["count"]
    assert post("/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == (
        engine.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    )
    text = post("/tokenize", {"prompt": PROMPT}).json()
    assert text["tokens"] == engine.prompt_ids(PROMPT)
    assert post("/detokenize", {"tokens": text["tokens"]}).json() == {"prompt": PROMPT}
    assert post("/tokenize", {"prompt": [1, 2, 3]}).json()["tokens"] == [1, 2, 3]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = post("/tokenize", {"messages": CHAT, "tools": tools}).json()
    assert with_tools["count"] > r["count"]  # the tools are described to the model
    bad = [({"prompt": "a", "messages": CHAT}, 400, "either 'prompt' or 'messages'"),
           ({}, 400, "either 'prompt' or 'messages'"),
           ({"messages": []}, 400, "messages must not be empty"),
           ({"messages": CHAT, "tools": [{"type": "function"}]}, 400, "function"),
           ({"prompt": [10**9]}, 400, "out of range"),
           ({"prompt": "x" * 20000}, 400, "max_model_len")]  # fmt: skip
    for body, status, words in bad:
        r = post("/tokenize", body)
        assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
    r = post("/detokenize", {"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = served.http.post("/tokenize", json={"model": "other", "prompt": "a"})
    assert r.status_code == 404


def test_usage_and_metrics_report_the_prefix_cache(served):
    """A chat sent twice: the second's prompt tokens but its last few come from the prefix
    cache (usage.prompt_tokens_details, as OpenAI reports cached tokens), same answer; the
    hits are counted in /metrics."""
    chat = [{"role": "system", "content": "You answer questions about rivers, briefly. " * 6},
            {"role": "user", "content": "Which river is the longest?"}]  # fmt: skip
    before = _metrics(served).get(("specinfer:prefix_cache_hits_total", ()), 0.0)
    first, second = (served.client.chat.completions.create(model=MODEL, messages=chat,
                                                           max_tokens=8, temperature=0)
                     for _ in range(2))  # fmt: skip
    assert second.choices[0].message.content == first.choices[0].message.content
    prompt, cached = second.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and prompt - 16 <= cached < prompt
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    _wait_idle(served.engine)
    m = _metrics(served)
    assert m["specinfer:prefix_cache_hits_total", ()] - before >= cached
    assert (
        m["specinfer:prefix_cache_queries_total", ()] >= m["specinfer:prefix_cache_hits_total", ()]
    )


def test_an_api_key_guards_the_v1_routes(served):
    """A second app over the same engine, with a key: the openai client with the key is
    served, without it or with another gets 401 (OpenAI's invalid_api_key); /health and
    /metrics stay open."""
    server = _ThreadedServer(build_app(served.app.state.server.async_engine, MODEL, "s3cret"))
    base = f"http://127.0.0.1:{server.port}"
    try:

        def client(key):
            return openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=60, max_retries=0)

        r = client("s3cret").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                                     temperature=0)  # fmt: skip
        assert r.choices[0].message.content == served.refs["chat"].text
        for key in ("wrong", "s3cret2", "bearer s3cret"):
            with pytest.raises(openai.AuthenticationError) as e:
                client(key).models.list()
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401  # no header
        body = {"model": MODEL, "prompt": "hi"}
        assert httpx.post(f"{base}/tokenize", json=body, timeout=10).status_code == 401
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
    finally:
        server.stop()


def test_allowed_origins_let_browsers_call_the_server():
    """CORS: a page of an allowed origin gets its preflight answered (before the key check) and
    the header on responses; another origin, or a server without allowed origins, does not."""
    page = "http://ui.example:3000"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    for origins, allowed in (([page], True), (None, False)):
        server = _ThreadedServer(build_app(None, MODEL, "s3cret", origins))
        base = f"http://127.0.0.1:{server.port}"
        try:
            r = httpx.options(f"{base}/v1/chat/completions", headers=preflight, timeout=10)
            assert (r.headers.get("access-control-allow-origin") == page) == allowed
            assert (r.status_code == 200) == allowed  # without CORS: the key check's 401
            key = {"Authorization": "Bearer s3cret"}
            r = httpx.get(f"{base}/v1/models", headers={**key, "Origin": page}, timeout=10)
            assert r.status_code == 200
            assert (r.headers.get("access-control-allow-origin") == page) == allowed
            other = httpx.get(f"{base}/v1/models", headers={**key, "Origin": "http://evil.example"},
                              timeout=10)  # fmt: skip
            assert "access-control-allow-origin" not in other.headers
        finally:
            server.stop()


# -- `specinfer serve` -------------------------------------------------------------------------


def test_serve_subprocess_sigterm(smollm_gguf, tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "specinfer.cli", "serve", "--model", str(smollm_gguf),
           "--port", str(port), "--served-model-name", MODEL, "--dtype", "bfloat16",
           "--max-batch-size", "2", "--max-model-len", "512", "--shutdown-timeout", "3",
           "--log-level", "warning"]  # fmt: skip
    out, err = open(tmp_path / "out.txt", "w+"), open(tmp_path / "err.txt", "w+")
    # The key from the environment (the client below sends it as its api_key).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECINFER_API_KEY": "x"}
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
    base = f"http://127.0.0.1:{port}"

    def logs() -> str:
        out.flush(), err.flush()
        return (tmp_path / "out.txt").read_text() + (tmp_path / "err.txt").read_text()

    try:
        with httpx.Client(base_url=base, timeout=60, headers={"Authorization": "Bearer x"}) as http:
            deadline, status = time.monotonic() + 120, None
            while status != 200:
                assert proc.poll() is None, f"serve exited early ({proc.returncode}):\n{logs()}"
                assert time.monotonic() < deadline, f"serve was not ready in 120 s:\n{logs()}"
                try:
                    status = http.get("/health").status_code
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            assert f"specinfer: serving {MODEL} on http://127.0.0.1:{port}" in logs()
            # The server warmed up on requests of its own (Engine.warm_up), which it does not count.
            assert re.search(r"^specinfer:prompt_tokens_total 0\.0$", http.get("/metrics").text,
                             re.MULTILINE)  # fmt: skip
            assert httpx.get(f"{base}/v1/models").status_code == 401  # the key is asked for
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
            r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
            assert r.choices[0].text and r.usage.completion_tokens >= 1
            # SIGTERM with a long stream in flight: /health turns 503, the stream is cut off
            # after --shutdown-timeout (finish_reason "abort") and still ends in [DONE].
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            with http.stream("POST", "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                with httpx.Client(base_url=base, timeout=5) as probe:
                    deadline = time.monotonic() + 3
                    while probe.get("/health").status_code != 503:
                        assert time.monotonic() < deadline, "/health did not turn 503"
                        time.sleep(0.05)
                events = _sse([first, *lines])
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=30) == 0, logs()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close(), err.close()
