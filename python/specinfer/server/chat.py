"""POST /v1/chat/completions: OpenAI's chat completions (object "chat.completion", chunks
"chat.completion.chunk"), streamed or not.

The messages are rendered with the model's chat template (engine.prompt_ids(messages), which adds
the assistant's generation prompt). max_completion_tokens (or the older max_tokens) defaults to
the rest of the context. A stream opens each choice with a {"role": "assistant"} delta and closes
it with an empty delta carrying finish_reason. With tools (tools.py), an answer made of tool-call
blocks is returned as the message's tool_calls (finish_reason "tool_calls"); a stream holds back
text from a tool-call opening on, and sends the calls in one delta at the end.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from specinfer.server.generation import (
    ClientDisconnected,
    prepare,
    run_to_end,
    stream_events,
    unless_disconnected,
)
from specinfer.server.logprobs import chat_logprobs
from specinfer.server.protocol import ChatCompletionRequest
from specinfer.server.sse import SSEResponse
from specinfer.server.tools import ToolStream

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = request.app.state.server
    state.admit(body.model)
    body.check()
    tools, tokenizer = body.tool_set, state.engine.tokenizer
    job = prepare(state, body, [body.chat_prompt(tokenizer)], "messages", "chatcmpl-", None)
    if body.stream:
        base = {"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                "model": state.model_name}  # fmt: skip
        opening = [_entry(c.index, {"role": "assistant", "content": ""}) for c in job.choices]
        held = {c.index: ToolStream(tools) for c in job.choices} if tools else {}

        def entries(c, out):
            text = held[c.index].feed(out.text) if tools else out.text
            if text or out.logprobs:
                logprobs = chat_logprobs(tokenizer, out.logprobs) if out.logprobs else None
                yield _entry(c.index, {"content": text}, logprobs=logprobs)
            if out.finished:
                rest, calls = held[c.index].finish(out.finish_reason) if tools else ("", [])
                if rest:
                    yield _entry(c.index, {"content": rest})
                if calls:
                    deltas = [{"index": i, **call} for i, call in enumerate(calls)]
                    yield _entry(c.index, {"tool_calls": deltas})
                yield _entry(c.index, {}, "tool_calls" if calls else out.finish_reason)

        usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(stream_events(state, job, base, entries, opening, usage))
    try:
        await unless_disconnected(request, run_to_end(state, job))
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for c in job.choices:
        content, calls = tools.parse(c.text, c.finish_reason) if tools else (c.text, [])
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": c.index, "message": message,
                        "logprobs": (chat_logprobs(tokenizer, c.logprobs)
                                     if c.params.logprobs is not None else None),
                        "finish_reason": "tool_calls" if calls else c.finish_reason})  # fmt: skip
    return {"id": job.id, "object": "chat.completion", "created": job.created,
            "model": state.model_name, "choices": choices, "usage": job.usage()}  # fmt: skip


def _entry(index: int, delta: dict, finish_reason: str | None = None,
           logprobs: dict | None = None) -> dict:  # fmt: skip
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
