"""POST /v1/responses (OpenAI's Responses API) through the real `openai` client.

One uvicorn server in a background thread over Engine(bfloat16, default SSM + n-gram). Greedy
answers are checked against the chat route's for the same conversation (itself checked against
Engine.generate in test_server.py) and, once, against Engine.generate; a stream's events against
the same response unstreamed.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

for _module in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
import openai  # noqa: E402

from specinfer import SamplingParams  # noqa: E402
from specinfer.engine import AsyncEngine, Engine  # noqa: E402
from specinfer.server import build_app  # noqa: E402
from specinfer.server.errors import APIError  # noqa: E402
from specinfer.server.responses import ResponseStore, Stored  # noqa: E402
from test_server import _ThreadedServer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "Name three colors."
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}  # fmt: skip
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def served(smollm_gguf):
    engine = Engine(smollm_gguf, dtype="bfloat16", ssm=["default", "ngram"], max_batch_size=4,
                    max_model_len=1024)  # fmt: skip
    reference = engine.generate([{"role": "user", "content": QUESTION}],
                                SamplingParams(max_tokens=12))[0]  # fmt: skip
    async_engine = AsyncEngine(engine)
    server = _ThreadedServer(build_app(async_engine, MODEL))
    base = f"http://127.0.0.1:{server.port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
    http = httpx.Client(base_url=base, timeout=60)
    try:
        yield SimpleNamespace(engine=engine, client=client, http=http, reference=reference)
    finally:
        http.close()
        server.stop()
        asyncio.run(async_engine.shutdown(5))


def _chat(served, messages, **kw) -> str:
    """The chat route's greedy answer to the same conversation."""
    kw = {"temperature": 0.0, "max_tokens": 12, **kw}
    return served.client.chat.completions.create(model=MODEL, messages=messages, **kw).choices[0]


def test_text_input_equals_generate(served):
    r = served.client.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    ref = served.reference
    assert r.output_text == ref.text and r.object == "response" and r.id.startswith("resp_")
    assert r.usage.input_tokens == ref.prompt_tokens
    assert r.usage.output_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    finished = {"stop": ("completed", None), "length": ("incomplete", "max_output_tokens")}
    status, reason = finished[ref.finish_reason]
    assert r.status == status and message.status == status
    assert (r.incomplete_details and r.incomplete_details.reason) == reason
    assert served.client.responses.retrieve(r.id).model_dump() == r.model_dump()


def test_instructions_and_items_equal_chat(served):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello! How can I help?"}]},
             {"role": "user", "content": QUESTION}]  # fmt: skip
    r = served.client.responses.create(model=MODEL, instructions="Be brief.", input=items, **GREEDY)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": QUESTION}]  # fmt: skip
    assert r.output_text == _chat(served, messages).message.content
    assert r.instructions == "Be brief."


def test_previous_response_continues_the_conversation(served):
    first = served.client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                           **GREEDY)  # fmt: skip
    second = served.client.responses.create(model=MODEL, input="And three animals?",
                                            previous_response_id=first.id, **GREEDY)  # fmt: skip
    # The earlier turns, not the earlier instructions (OpenAI's rule).
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And three animals?"}]  # fmt: skip
    assert second.output_text == _chat(served, messages).message.content
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the prefix cache held turn one
    # The same conversation sent as items (the first answer's output items passed back).
    again = served.client.responses.create(
        model=MODEL, input=[{"role": "user", "content": QUESTION},
                            *[o.model_dump(exclude_none=True) for o in first.output],
                            {"role": "user", "content": "And three animals?"}], **GREEDY)  # fmt: skip
    assert again.output_text == second.output_text
    unstored = served.client.responses.create(model=MODEL, input=QUESTION, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        served.client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        served.client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id)
    served.client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        served.client.responses.retrieve(first.id)
    assert served.client.responses.retrieve(second.id).id == second.id


def test_input_items_list_a_stored_responses_input(served):
    """GET /v1/responses/{id}/input_items: the request's own input items (ids, input_text
    parts), newest first by default; the client's pager walks pages of one."""
    items = [{"role": "user", "content": "Hi!"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]  # fmt: skip
    r = served.client.responses.create(model=MODEL, input=items, **GREEDY)
    listed = served.client.responses.input_items.list(r.id)
    texts = [(i.role, i.content[0].text) for i in listed.data]
    assert texts == [("user", QUESTION), ("assistant", "Hello!"), ("user", "Hi!")]
    assert listed.data[-1].content[0].type == "input_text" and not listed.has_more
    paged = [i.id for i in served.client.responses.input_items.list(r.id, limit=1, order="asc")]
    assert paged == [i.id for i in reversed(listed.data)] and len(set(paged)) == 3
    follow = served.client.responses.create(model=MODEL, input="And a fourth?",
                                            previous_response_id=r.id, **GREEDY)  # fmt: skip
    (own,) = served.client.responses.input_items.list(follow.id).data
    assert own.content[0].text == "And a fourth?"
    bad = served.http.get(f"/v1/responses/{r.id}/input_items", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_stream_events_add_up_to_the_response(served):
    kw = {"model": MODEL, "input": QUESTION, "include": ["message.output_text.logprobs"],
          "top_logprobs": 2, **GREEDY}  # fmt: skip
    whole = served.client.responses.create(**kw)
    events = list(served.client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert "".join(e.delta for e in deltas) == final.output_text == whole.output_text
    streamed = [(lp.token, lp.logprob) for e in deltas for lp in e.logprobs]
    (part,) = whole.output[0].content
    assert len(streamed) == len(part.logprobs) == whole.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    for (token, logprob), lp in zip(streamed, part.logprobs):
        assert token == lp.token and logprob == pytest.approx(lp.logprob, abs=0.05)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert served.client.responses.retrieve(final.id).output_text == whole.output_text


def test_function_calls_and_their_output(served):
    kw = {"model": MODEL, "input": "What is the weather like in Paris today?", "tools": [TOOL],
          "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0.0,
          "max_output_tokens": 60}  # fmt: skip
    r = served.client.responses.create(**kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    assert list(json.loads(call.arguments)) == ["city"]
    events = list(served.client.responses.create(stream=True, **kw))
    assert [e.type for e in events][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]  # fmt: skip
    done = events[-2].item
    assert (done.name, done.arguments) == (call.name, call.arguments)
    named = served.client.responses.create(**{**kw, "tool_choice": {"type": "function",
                                                                    "name": "get_weather"}})  # fmt: skip
    assert named.output[0].name == "get_weather"
    # The tool's answer, sent back after the call: what the chat route answers to the same turns.
    follow = served.client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[TOOL], temperature=0.0, max_output_tokens=24,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}])  # fmt: skip
    messages = [{"role": "user", "content": kw["input"]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"}]  # fmt: skip
    chat = _chat(served, messages, tools=[CHAT_TOOL], max_tokens=24)
    assert follow.output_text == (chat.message.content or "")
    # As items: a turn's text and its call are one assistant message.
    said = {"type": "message", "role": "assistant", "content": "Let me check."}
    items = [{"role": "user", "content": kw["input"]}, said,
             *[o.model_dump(exclude_none=True) for o in r.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}]  # fmt: skip
    follow = served.client.responses.create(model=MODEL, input=items, tools=[TOOL],
                                            temperature=0.0, max_output_tokens=24)  # fmt: skip
    messages[1]["content"] = "Let me check."
    chat = _chat(served, messages, tools=[CHAT_TOOL], max_tokens=24)
    assert follow.output_text == (chat.message.content or "")
    # tool_choice auto: text that might open a call is held back, then sent; streamed = not.
    # (an answer in lines: the whitespace before each is held back until text follows)
    auto = {**kw, "input": "List three cities in France, one per line.", "tool_choice": "auto",
            "max_output_tokens": 40, "include": ["message.output_text.logprobs"]}  # fmt: skip
    whole = served.client.responses.create(**auto)
    events = list(served.client.responses.create(stream=True, **auto))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text and events[-1].response.output_text == text
    if whole.output[0].type == "message":  # held-back text's logprobs come with it
        (done,) = [e for e in events if e.type == "response.output_text.done"]
        assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in done.logprobs]
    assert [o.type for o in events[-1].response.output] == [o.type for o in whole.output]


def test_json_schema_text_format(served):
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    r = served.client.responses.create(model=MODEL, input="A person as JSON.",
                                       text={"format": fmt}, max_output_tokens=40,
                                       temperature=0.0)  # fmt: skip
    assert r.status == "completed"
    assert isinstance(json.loads(r.output_text)["age"], int)
    # The client's stream helper, with a pydantic model for the format: it assembles the events.
    import pydantic

    class Person(pydantic.BaseModel):
        age: int

    with served.client.responses.stream(model=MODEL, input="A person as JSON.", text_format=Person,
                                        max_output_tokens=40, temperature=0.0) as stream:  # fmt: skip
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Person) and final.output_text == deltas


def test_truncation_auto_drops_the_oldest_turns(served):
    """A conversation longer than the context: refused as it is ("disabled", the default); with
    "auto" answered as the chat route answers its latest turns that fit (whole turns, from a
    user message, the instructions kept)."""
    filler = "The quick brown fox jumps over the lazy dog. " * 16
    turns = []
    for i in range(8):
        turns += [{"role": "user", "content": f"Story {i}: {filler}"},
                  {"role": "assistant", "content": f"Noted story {i}."}]  # fmt: skip
    turns.append({"role": "user", "content": QUESTION})
    kw = {"model": MODEL, "input": turns, "instructions": "Be brief.", **GREEDY}
    with pytest.raises(openai.BadRequestError, match="max_model_len=1024"):
        served.client.responses.create(**kw)
    r = served.client.responses.create(truncation="auto", **kw)
    assert r.truncation == "auto" and r.usage.input_tokens + 12 <= 1024

    def tokens(messages) -> int:  # as the chat route renders them (too long for /tokenize)
        return len(served.engine.tokenizer.chat_ids(messages))

    system = [{"role": "system", "content": "Be brief."}]
    start = next(i for i in range(0, len(turns), 2) if tokens(system + turns[i:]) + 12 <= 1024)
    assert 0 < start < len(turns) - 1
    kept = system + turns[start:]
    assert r.usage.input_tokens == tokens(kept)
    assert r.output_text == _chat(served, kept).message.content


_OK = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}
BAD = [  # (body, text the message holds, param)
    ({"model": MODEL}, "input: Field required", "input"),
    ({**_OK, "max_output_tokens": 0}, "max_output_tokens must be at least 1", "max_output_tokens"),
    ({**_OK, "max_output_tokens": 5000}, "Please reduce the prompt or max_output_tokens",
     "max_output_tokens"),
    ({**_OK, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "only text content is supported", "input"),
    ({**_OK, "input": [{"role": "robot", "content": "x"}]}, "input[0].role must be one of", "input"),
    ({**_OK, "input": [{"type": "function_call", "name": "f"}]}, "needs string call_id", "input"),
    ({**_OK, "input": [{"type": "item_reference", "id": "x"}]}, "'item_reference' are not",
     "input"),
    ({**_OK, "input": [5]}, "input[0] must be an object", "input"),
    ({**_OK, "input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]},
     "needs content", "input"),
    ({**_OK, "tools": [TOOL], "tool_choice": {"type": "function", "name": ["get_weather"]}},
     "tool_choice must name one of the tools", "tool_choice"),
    ({**_OK, "tools": [{"type": "web_search"}]}, "only function tools", "tools"),
    ({**_OK, "tools": [{**TOOL, "name": "a b"}]}, "name must be", "tools"),
    ({**_OK, "tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
    ({**_OK, "text": {"format": {"type": "yaml"}}}, "must be text, json_object or json_schema",
     "text.format"),
    ({**_OK, "text": {"format": {"type": "json_schema", "name": "x"}}}, "needs a 'json_schema'",
     "text.format"),
    ({**_OK, "top_logprobs": 21}, "top_logprobs must be between 0 and 20", "top_logprobs"),
    ({**_OK, "background": True}, "background responses are not supported", "background"),
    ({**_OK, "truncation": "middle"}, "truncation must be 'auto' or 'disabled'", "truncation"),
    ({**_OK, "previous_response_id": "resp_nope"}, "'resp_nope' not found",
     "previous_response_id"),
    ({**_OK, "temperature": "hot"}, "valid number", "temperature"),
]  # fmt: skip


@pytest.mark.parametrize("body, message, param", BAD)
def test_bad_input(served, body, message, param):
    r = served.http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param, error
    assert served.http.get("/health").status_code == 200


def test_truncation_keeps_whole_turns_with_their_tool_calls(default_tokenizer):
    """fitted(): a turn is a user message with what follows it (calls, tool results); the
    oldest go first, the system message and the last turn stay even if they alone do not fit."""
    from specinfer.server.protocol import ChatCompletionRequest
    from specinfer.server.responses import fitted

    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    turn = [{"role": "user", "content": "Weather? " * 40},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "12 C " * 40}]  # fmt: skip
    system = [{"role": "system", "content": "Be brief."}]
    chat = ChatCompletionRequest(model="m", messages=system + turn + turn[:1])
    whole = len(chat.chat_prompt(default_tokenizer))
    fit, prompt = fitted(chat, default_tokenizer, whole + 10, 10)
    assert fit.messages == chat.messages and len(prompt) == whole  # it fits: nothing dropped
    fit, prompt = fitted(chat, default_tokenizer, whole, 10)
    assert fit.messages == chat.messages[:1] + chat.messages[-1:]  # the call and result with it
    assert prompt == fit.chat_prompt(default_tokenizer)
    tail = ChatCompletionRequest(model="m", messages=system + turn)  # one turn: nothing to drop
    assert fitted(tail, default_tokenizer, 8, 4)[0].messages == tail.messages


def test_store_keeps_the_most_recently_used():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(Stored({"id": f"r{i}"}, [{"role": "user", "content": str(i)}], []))
        if i == 1:
            store.get("r0")  # used: r1 is now the oldest
    assert sorted(store.items) == ["r0", "r2"]
    assert store.get("r2").conversation == [{"role": "user", "content": "2"}]
    with pytest.raises(APIError) as e:
        store.get("r1", "previous_response_id")
    assert (e.value.status, e.value.param) == (400, "previous_response_id")
    with pytest.raises(APIError) as e:
        store.get("r1")
    assert e.value.status == 404
