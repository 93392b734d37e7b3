"""POST /v1/completions: OpenAI's text completions (object "text_completion"), streamed or not.

A prompt is a string, token ids, or a list of either (up to protocol.MAX_PROMPTS); each prompt
gets n choices, numbered prompt_index * n + i. max_tokens defaults to 16, as OpenAI's. echo puts
the prompt before the completion, and with logprobs the prompt's logprobs before the
completion's (the first prompt token's null); echo with max_tokens 0 scores the prompt alone.
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
from specinfer.server.logprobs import CompletionLogprobs
from specinfer.server.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS, CompletionRequest
from specinfer.server.sse import SSEResponse

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = request.app.state.server
    state.admit(body.model)
    body.check()
    job = prepare(state, body, body.prompts(), "prompt", "cmpl-", COMPLETIONS_DEFAULT_MAX_TOKENS)
    base = {"id": job.id, "object": "text_completion", "created": job.created,
            "model": state.model_name}  # fmt: skip
    top, tokenizer, prompts = body.requested_logprobs(), state.engine.tokenizer, body.prompts()
    pieces = {c.index: _Pieces(c, prompts[c.prompt_index], tokenizer, top, body.echo)
              for c in job.choices}  # fmt: skip
    if body.stream:

        def entries(c, out):
            p = pieces[c.index]
            if out.text or out.finished or out.logprobs or p.echo_pending:
                text, logprobs = p.next(out.text, out.logprobs or [], out.prompt_logprobs)
                yield {"index": c.index, "text": text, "logprobs": logprobs,
                       "finish_reason": out.finish_reason if out.finished else None}  # fmt: skip

        usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(stream_events(state, job, base, entries, include_usage=usage))
    try:
        await unless_disconnected(request, run_to_end(state, job))
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for c in job.choices:
        text, logprobs = pieces[c.index].next(c.text, c.logprobs, c.prompt_logprobs)
        choices.append({"index": c.index, "text": text, "logprobs": logprobs,
                        "finish_reason": c.finish_reason})  # fmt: skip
    return {**base, "choices": choices, "usage": job.usage()}


class _Pieces:
    """One choice's text and logprobs, output by output: with echo the first starts with the
    prompt (its text as given, or decoded from token ids) and the prompt's logprobs; a choice
    that only scores its prompt shows nothing of what was generated."""

    def __init__(self, choice, prompt, tokenizer, top: int | None, echo: bool):
        self.prompt_ids, self.score_only = choice.prompt_ids, choice.score_only
        self.prompt_text = None
        if echo:
            self.prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        self.format = CompletionLogprobs(tokenizer, top) if top is not None else None

    @property
    def echo_pending(self) -> bool:
        return self.prompt_text is not None

    def next(
        self, text: str, logprobs: list, prompt_logprobs: list | None
    ) -> tuple[str, dict | None]:
        if self.score_only:
            text, logprobs = "", []
        ids, entries = [e.token_id for e in logprobs], list(logprobs)
        if self.echo_pending:
            text, self.prompt_text = self.prompt_text + text, None
            ids = self.prompt_ids + ids  # an abort before the first token: no prompt logprobs
            entries = (prompt_logprobs or [None] * len(self.prompt_ids)) + entries
        return text, self.format.chunk(ids, entries) if self.format else None
