"""One HTTP request -> its choices (an engine request each), their outputs merged as they come.

`prepare` tokenizes and checks everything before any engine request starts, so a bad input is a
400 and not a broken stream. `choice_outputs` runs each choice's `AsyncEngine.generate` in its own
task and yields (choice, output) in arrival order; however the consumer stops (finished, an
error, a client disconnect cancelling it), its `finally` cancels the tasks, whose iterators are
closed (`aclosing`), which aborts their engine requests and frees their KV rows.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from starlette.requests import Request

from specinfer.sampling import SamplingParams, check_token_ids
from specinfer.server.errors import APIError, error_body, logger
from specinfer.server.protocol import _Request
from specinfer.server.sse import DONE, event


@dataclass
class Choice:
    index: int  # the choice's index in the response: prompt_index * n + i
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache held
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprobs, when params.logprobs is set
    prompt_logprobs: list | None = None  # when params.prompt_logprobs is set (the first output's)
    score_only: bool = False  # echo with max_tokens 0: one token is generated, and not shown


@dataclass
class Job:
    """What a handler runs: its choices, when it arrived, and an id for the response."""

    id: str
    choices: list[Choice]
    n: int
    arrival: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict:
        """OpenAI's usage: each prompt counted once (and how many of its tokens were cached:
        those of its first choice), every choice's completion tokens."""
        firsts = [c for c in self.choices if c.index % self.n == 0]
        prompt = sum(len(c.prompt_ids) for c in firsts)
        completion = sum(c.completion_tokens for c in self.choices if not c.score_only)
        cached = sum(c.cached_tokens for c in firsts)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def prepare(state, body: _Request, prompts: list, param: str, id_prefix: str,
            default_max_tokens: int | None) -> Job:  # fmt: skip
    """Tokenize the prompts (text, token ids or chat messages) and build every choice's
    SamplingParams; APIError 400 for an empty or too long prompt, a bad value, or a completion
    that does not fit the context. default_max_tokens None: the rest of the context."""
    engine = state.engine
    context = engine.max_model_len
    requested, max_field = body.requested_max_tokens()
    # OpenAI's way to score a prompt alone (echo, logprobs, max_tokens 0): the engine generates
    # at least one token, which the response leaves out.
    score_only = getattr(body, "echo", False) and requested == 0
    if score_only:
        requested = 1
    try:  # a schema, regex or grammar the engine cannot compile, once for all choices
        engine.grammars.compile(SamplingParams(**body.structured()))
    except ValueError as e:
        raise body.structured_error(str(e)) from e
    choices = []
    for p_index, prompt in enumerate(prompts):
        try:
            ids = engine.prompt_ids(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param) from e
        room = context - len(ids)
        if requested is not None:
            max_tokens = requested
        else:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        params = [body.sampling_params(max_tokens, i) for i in range(body.n)]
        try:  # here, not when the engine takes the request: a stream has not started yet
            check_token_ids(params[0], engine.config.vocab_size)
        except ValueError as e:  # "logit_bias: ..." or "stop_token_ids: ..."
            raise APIError(400, str(e), str(e).split(":")[0]) from e
        if len(ids) + max_tokens > context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or {max_field}.",
                max_field,
                "context_length_exceeded",
            )
        for i, sp in enumerate(params):
            choices.append(Choice(p_index * body.n + i, p_index, ids, sp, score_only=score_only))
    return Job(f"{id_prefix}{uuid.uuid4().hex}", choices, body.n)


_END = object()  # a choice's generate() returned
_ABORT = object()  # end_all(): end the choice now, finish_reason "abort"


async def choice_outputs(state, job: Job) -> AsyncIterator[tuple[Choice, object]]:
    """(choice, RequestOutput) for every output of every choice, until all have finished. Each
    choice's text, completion_tokens and finish_reason are kept up to date."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        timer = state.metrics.timer(job.arrival)
        error = False
        try:
            gen = state.async_engine.generate(
                c.prompt_ids, c.params, request_id=f"{job.id}-{c.index}"
            )
            async with aclosing(gen):
                async for out in gen:
                    timer.output(out)
                    await queue.put((c, out))
            await queue.put((c, _END))
        except Exception as e:  # handed to the consumer, which raises it
            error = True
            await queue.put((c, e))
        finally:
            timer.close(error)

    tasks = [asyncio.create_task(pump(c)) for c in job.choices]
    state.jobs[job.id] = (job, queue)
    try:
        open_choices = {c.index for c in job.choices}
        while open_choices:
            c, item = await queue.get()
            if c.index not in open_choices:
                continue
            if item is _END:
                open_choices.discard(c.index)
                continue
            if isinstance(item, Exception):
                raise item
            if item is _ABORT:
                item = Aborted(c.completion_tokens)
            c.text += item.text
            c.logprobs += item.logprobs or []
            c.prompt_logprobs = c.prompt_logprobs or item.prompt_logprobs
            c.completion_tokens = max(c.completion_tokens, item.completion_tokens)  # abort: 0
            c.cached_tokens = max(c.cached_tokens, item.cached_tokens)
            if item.finished:
                c.finish_reason = item.finish_reason
                open_choices.discard(c.index)
            yield c, item
    finally:
        state.jobs.pop(job.id, None)
        for t in tasks:
            t.cancel()


def end_all(state) -> None:
    """End every unfinished choice of every running job now (finish_reason "abort"): after
    AsyncEngine.shutdown, so that no stream waits for an output that will not come."""
    for job, queue in list(state.jobs.values()):
        for c in job.choices:
            queue.put_nowait((c, _ABORT))


@dataclass
class Aborted:
    """The last output of a choice that end_all() ended (a RequestOutput's fields)."""

    completion_tokens: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    finished: bool = True
    finish_reason: str = "abort"
    logprobs: None = None
    prompt_logprobs: None = None
    cached_tokens: int = 0


async def run_to_end(state, job: Job) -> None:
    """Run every choice to its end (non-streaming)."""
    async with aclosing(choice_outputs(state, job)) as outputs:
        async for _ in outputs:
            pass


class ClientDisconnected(Exception):
    pass


async def unless_disconnected(request: Request, coro):
    """Await coro; if the client disconnects first, cancel it (aborting its engine requests) and
    raise ClientDisconnected. The body has been read, so the next ASGI message is the
    disconnect."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(coro), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected
    finally:
        watcher.cancel()
        task.cancel()


async def stream_events(state, job: Job, base: dict, choice_chunks, opening=(),
                        include_usage: bool = False) -> AsyncIterator[str]:  # fmt: skip
    """The SSE events of a streamed job: `opening` choice entries first (the chat role), then
    choice_chunks(choice, output) -> choice entries for each output, then (include_usage) a chunk
    with usage and no choices, then [DONE]. Each chunk is `base` plus its choices (and
    "usage": null when include_usage). An engine failure mid-stream is logged and sent as an
    error event."""

    def chunk(choices: list, usage=None) -> str:
        return event({**base, "choices": choices, **({"usage": usage} if include_usage else {})})

    try:
        for entry in opening:
            yield chunk([entry])
        async with aclosing(choice_outputs(state, job)) as outputs:
            async for c, out in outputs:
                for entry in choice_chunks(c, out):
                    yield chunk([entry])
        if include_usage:
            yield chunk([], job.usage())
    except Exception as e:
        logger.error("error in stream %s", job.id, exc_info=e)
        status, message = (
            (400, str(e)) if isinstance(e, ValueError) else (500, "internal server error")
        )
        yield event(error_body(status, message))
    yield DONE
