"""POST /v1/chat/completions: OpenAI's chat completions (object "chat.completion", chunks
"chat.completion.chunk"), streamed or not.

The messages are rendered with the model's chat template (engine.prompt_ids(messages), which adds
the assistant's generation prompt). max_completion_tokens (or the older max_tokens) defaults to
the rest of the context. A stream opens each choice with a {"role": "assistant"} delta and closes
it with an empty delta carrying finish_reason.
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

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = request.app.state.server
    state.admit(body.model)
    body.check()
    job = prepare(state, body, [body.messages], "messages", "chatcmpl", None)
    tokenizer = state.engine.tokenizer
    if body.stream:
        base = {"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                "model": state.model_name}  # fmt: skip
        opening = [_entry(c.index, {"role": "assistant", "content": ""}) for c in job.choices]

        def entries(c, out):
            if out.text or out.logprobs:
                logprobs = chat_logprobs(tokenizer, out.logprobs) if out.logprobs else None
                yield _entry(c.index, {"content": out.text}, logprobs=logprobs)
            if out.finished:
                yield _entry(c.index, {}, out.finish_reason)

        usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(stream_events(state, job, base, entries, opening, usage))
    try:
        await unless_disconnected(request, run_to_end(state, job))
    except ClientDisconnected:
        return Response(status_code=499)
    choices = [
        {"index": c.index, "message": {"role": "assistant", "content": c.text},
         "logprobs": (chat_logprobs(tokenizer, c.logprobs)
                      if c.params.logprobs is not None else None),
         "finish_reason": c.finish_reason}
        for c in job.choices
    ]  # fmt: skip
    return {"id": job.id, "object": "chat.completion", "created": job.created,
            "model": state.model_name, "choices": choices, "usage": job.usage()}  # fmt: skip


def _entry(index: int, delta: dict, finish_reason: str | None = None,
           logprobs: dict | None = None) -> dict:  # fmt: skip
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
