"""POST /v1/completions: OpenAI's text completions (object "text_completion"), streamed or not.

A prompt is a string, token ids, or a list of either (up to protocol.MAX_PROMPTS); each prompt
gets n choices, numbered prompt_index * n + i. max_tokens defaults to 16, as OpenAI's.
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
from specinfer.server.logprobs import completion_logprobs
from specinfer.server.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS, CompletionRequest
from specinfer.server.sse import SSEResponse

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = request.app.state.server
    state.admit(body.model)
    body.check()
    job = prepare(state, body, body.prompts(), "prompt", "cmpl", COMPLETIONS_DEFAULT_MAX_TOKENS)
    base = {"id": job.id, "object": "text_completion", "created": job.created,
            "model": state.model_name}  # fmt: skip
    top, tokenizer = body.requested_logprobs(), state.engine.tokenizer
    if body.stream:
        offsets = dict.fromkeys(range(len(job.choices)), 0)  # where a choice's next token starts

        def entries(c, out):
            if out.text or out.finished or out.logprobs:
                reason = out.finish_reason if out.finished else None
                logprobs = None
                if top is not None:
                    logprobs = completion_logprobs(
                        tokenizer, out.logprobs or [], top, offsets[c.index]
                    )
                    offsets[c.index] += sum(map(len, logprobs["tokens"]))
                yield {"index": c.index, "text": out.text, "logprobs": logprobs,
                       "finish_reason": reason}  # fmt: skip

        usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(stream_events(state, job, base, entries, include_usage=usage))
    try:
        await unless_disconnected(request, run_to_end(state, job))
    except ClientDisconnected:
        return Response(status_code=499)
    choices = [
        {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
         "logprobs": None if top is None else completion_logprobs(tokenizer, c.logprobs, top)}
        for c in job.choices
    ]  # fmt: skip
    return {**base, "choices": choices, "usage": job.usage()}
