"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items:
OpenAI's Responses API.

A request is read as the chat request it amounts to (responses_request.py) and generated as one
choice. Its answer is a message item with one output_text part, and/or function_call items (an
answer of tool-call blocks, parsed as the chat route parses them). Status "completed", or
"incomplete": cut by max_output_tokens (incomplete_details.reason "max_output_tokens") or by the
server's shutdown. Streamed, it is the API's typed events (`event: TYPE` and `data: {...}` with
a sequence_number): response.created, response.in_progress, then per output item its
output_item.added, content_part.added, output_text.delta ..., output_text.done,
content_part.done, output_item.done (a function call: function_call_arguments.delta and .done),
then response.completed or response.incomplete. Text that may begin a tool call is held back
until the answer ends, as on the chat route.

Stored responses (store, the default): the last MAX_STORED are kept in memory with the
conversation that led to them, so that GET returns one and previous_response_id continues one
(its input and output come before the new input; its instructions do not, as OpenAI's).
With truncation "auto" the oldest turns are dropped until the prompt fits (`fitted`), and the
conversation stored is the one answered.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import APIRouter, Request
from starlette.responses import Response

from specinfer.server.errors import APIError, logger
from specinfer.server.generation import (
    ClientDisconnected,
    choice_outputs,
    prepare,
    run_to_end,
    unless_disconnected,
)
from specinfer.server.logprobs import chat_logprobs
from specinfer.server.responses_request import ResponsesRequest, renamed
from specinfer.server.sse import SSEResponse, typed_event
from specinfer.server.tools import ToolStream

MAX_STORED = 1000  # responses kept for GET and previous_response_id, least recently used dropped
AUTO_ROOM = 256  # truncation "auto" without max_output_tokens leaves the answer this much room

router = APIRouter()


@dataclass
class Stored:
    response: dict  # the response object, as returned
    conversation: list[dict]  # the chat messages up to its answer (previous_response_id's)
    inputs: list[dict]  # its request's input items, with ids (input_items lists them)


class ResponseStore:
    """Stored responses by id, the least recently used dropped past `capacity`."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity, self.items = capacity, OrderedDict()

    def put(self, stored: Stored) -> None:
        self.items[stored.response["id"]] = stored
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        if response_id not in self.items:
            status = 400 if param else 404  # a body's reference is a bad request; a path, not found
            raise APIError(status, f"Response with id '{response_id}' not found.", param)
        self.items.move_to_end(response_id)
        return self.items[response_id]


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state = request.app.state.server
    state.admit(body.model)
    body.check()
    history = []
    if body.previous_response_id is not None:
        history = state.responses.get(
            body.previous_response_id, "previous_response_id"
        ).conversation
    chat = body.chat_request(history)
    tokenizer = state.engine.tokenizer
    try:
        if body.truncation == "auto":
            context = state.engine.max_model_len
            room = body.max_output_tokens or min(AUTO_ROOM, context // 4)
            chat, prompt = fitted(chat, tokenizer, context, room)
        else:
            prompt = chat.chat_prompt(tokenizer)
        job = prepare(state, chat, [prompt], "messages", "resp_", None)
    except APIError as e:
        raise renamed(e) from e
    answer = Answer(body, chat, job, state)
    if body.stream:
        return SSEResponse(answer.events())
    try:
        await unless_disconnected(request, run_to_end(state, job))
    except ClientDisconnected:
        return Response(status_code=499)
    return answer.finish()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return request.app.state.server.responses.get(response_id).response


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request, order: str = "desc", limit: int = 20,
                      after: str | None = None):  # fmt: skip
    """A stored response's input items (its own request's, not earlier responses'), a page of
    `limit` (1 to 100) in `order`, after the item `after`; the openai client pages through."""
    items = request.app.state.server.responses.get(response_id).inputs
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", "order")
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be between 1 and 100, got {limit}", "limit")
    items = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"no input item {after!r} in response {response_id!r}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}  # fmt: skip


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    store = request.app.state.server.responses
    store.get(response_id)
    del store.items[response_id]
    return {"id": response_id, "object": "response", "deleted": True}


def fitted(chat, tokenizer, context: int, room: int) -> tuple:
    """truncation "auto": the chat request without its oldest turns (after its leading system
    messages; a turn is a user message and what follows it up to the next: an answer, its tool
    calls and their results) until its prompt leaves `room` tokens of the context; (that
    request, its prompt ids). The last turn is never dropped: what still does not fit is
    prepare()'s error."""
    messages = chat.messages
    first = next((i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")),
                 len(messages))  # fmt: skip
    while True:
        prompt = chat.chat_prompt(tokenizer)
        rest = messages[first:]
        turn = next((i for i in range(1, len(rest)) if rest[i]["role"] == "user"), None)
        if len(prompt) + room <= context or turn is None:
            return chat, prompt
        messages = messages[:first] + rest[turn:]
        chat = chat.model_copy(update={"messages": messages})


class Answer:
    """One response being generated: its object, its output items, and (streamed) its events."""

    def __init__(self, body: ResponsesRequest, chat, job, state):
        self.body, self.chat, self.job, self.state = body, chat, job, state
        self.choice, self.tools = job.choices[0], chat.tool_set
        self.tokenizer = state.engine.tokenizer
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.logprobs = self.choice.params.logprobs is not None

    @property
    def status(self) -> str:
        """The finished answer's: "completed" if it ended, "incomplete" if it was cut."""
        return "completed" if self.choice.finish_reason == "stop" else "incomplete"

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        body, c = self.body, self.choice
        incomplete = {"reason": "max_output_tokens"} if c.finish_reason == "length" else None
        return {
            "id": self.job.id, "object": "response", "created_at": self.job.created,
            "status": status, "error": None,
            "incomplete_details": incomplete if status == "incomplete" else None,
            "completed_at": int(time.time()) if status == "completed" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.state.model_name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": c.params.temperature, "top_p": c.params.top_p,
            "top_logprobs": body.top_logprobs, "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "truncation": body.truncation or "disabled",
            "store": body.store,
            "metadata": body.metadata or {}, "usage": usage,
        }  # fmt: skip

    def output(self) -> tuple[list[dict], dict]:
        """The finished choice's output items, and the assistant message it adds to the
        conversation (chat shape)."""
        c = self.choice
        content, calls = self.tools.parse(c.text, c.finish_reason) if self.tools else (c.text, [])
        items = []
        if content is not None or not calls:
            items.append(self._message(content or "", self.status, c.logprobs))
        for call in calls:
            items.append({"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}",
                          "call_id": call["id"], "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"], "status": "completed"})  # fmt: skip
        turn = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        return items, turn

    def finish(self) -> dict:
        """The finished response (stored if asked)."""
        items, turn = self.output()
        usage = self.job.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        response = self.response(self.status, items, {
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage["total_tokens"],
        })  # fmt: skip
        if self.body.store:
            system = 1 if self.body.instructions else 0  # not carried over
            conversation = [*self.chat.messages[system:], turn]
            self.state.responses.put(Stored(response, conversation, self.body.input_items()))
        return response

    def _message(self, text: str, status: str, logprobs: list) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self._part(text, logprobs)]}  # fmt: skip

    def _part(self, text: str, logprobs: list) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self._logprobs(logprobs)}  # fmt: skip

    def _logprobs(self, entries: list) -> list:
        return chat_logprobs(self.tokenizer, entries)["content"] if self.logprobs else []

    async def events(self):
        """The streamed response's SSE events."""
        seq = itertools.count()

        def event(kind: str, **fields) -> str:
            return typed_event({"type": kind, "sequence_number": next(seq), **fields})

        def text_event(kind: str, **fields) -> str:
            return event(kind, item_id=self.message_id, output_index=0, content_index=0, **fields)

        def opening() -> list[str]:  # the message item and its text part, announced
            item = {**self._message("", "in_progress", []), "content": []}
            return [event("response.output_item.added", output_index=0, item=item),
                    text_event("response.content_part.added", part=self._part("", []))]  # fmt: skip

        held = ToolStream(self.tools) if self.tools else None
        opened, pending = False, []  # pending: the logprobs of text held back, sent with it
        start = self.response("in_progress", [])
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        try:
            async with aclosing(choice_outputs(self.state, self.job)) as outputs:
                async for _, out in outputs:
                    text = held.feed(out.text) if held else out.text
                    pending += out.logprobs or []
                    # Held text may turn out to be tool calls: a message is opened by text only.
                    if text or (pending and not held):
                        for e in [] if opened else opening():
                            yield e
                        opened = True
                        yield text_event("response.output_text.delta", delta=text,
                                         logprobs=self._logprobs(pending))  # fmt: skip
                        pending = []
        except Exception as e:
            logger.error("error in stream %s", self.job.id, exc_info=e)
            message = str(e) if isinstance(e, ValueError) else "internal server error"
            yield event("error", code="server_error", message=message, param=None)
            failed = {**self.response("failed", []),
                      "error": {"code": "server_error", "message": message}}  # fmt: skip
            yield event("response.failed", response=failed)
            return
        response = self.finish()
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                for e in [] if opened else opening():
                    yield e
                part = item["content"][0]
                rest = part["text"][held.sent :] if held else ""  # what was held back
                if rest or pending:
                    yield text_event("response.output_text.delta", delta=rest,
                                     logprobs=self._logprobs(pending))  # fmt: skip
                yield text_event("response.output_text.done", text=part["text"],
                                 logprobs=part["logprobs"])  # fmt: skip
                yield text_event("response.content_part.done", part=part)
            else:
                yield event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})  # fmt: skip
                yield event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=item["arguments"])  # fmt: skip
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, arguments=item["arguments"])  # fmt: skip
            yield event("response.output_item.done", output_index=index, item=item)
        final = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield event(final, response=response)
