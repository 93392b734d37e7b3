"""The asyncio front: the engine loop on its own thread, one asyncio queue of outputs per request.

Callers (the HTTP server) `async for` over `generate(...)`; leaving the loop early (a client
that disconnected, a cancelled task) aborts the request, which frees its rows at the next step.
The engine itself is touched by its thread only: requests and aborts reach it through a queue
(and the Engine refuses them from any other thread while this one runs it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from specinfer.engine.llm_engine import Engine, Prompt
from specinfer.engine.sequence import RequestOutput
from specinfer.sampling import SamplingParams

log = logging.getLogger("specinfer.engine")


class EngineDeadError(RuntimeError):
    """The engine loop failed; the requests it held were ended with this error."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", seq, sink) / ("abort", id)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._accepting = True
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="specinfer-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return (self._accepting and self._thread.is_alive() and self._error is None
                and self.engine.failure is None)  # fmt: skip

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """The request's outputs as its steps run, the last with finished=True. Bad input
        raises ValueError before anything is queued."""
        if not self.ready:
            raise RuntimeError("the engine is not accepting requests (shutting down)")
        seq = self.engine.make_sequence(prompt, params, request_id)
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", seq, (asyncio.get_running_loop(), sink)))
        finished = False
        try:
            while not finished:
                out = await sink.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"the engine failed: {out!r}") from out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(seq.request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def stats(self) -> dict:
        return self.engine.stats()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop admitting; let running requests finish for up to timeout_s, then abort them."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self._sinks and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        for request_id in list(self._sinks):
            self.abort(request_id)
        self._stop.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self.engine.close()  # its tensor-parallel workers, if any

    # -- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        self.engine.driver = threading.get_ident()  # other threads may no longer change it
        try:
            self._serve()
        finally:  # the aborts shutdown() queued last reach their requests
            self._drain(block=False)
            self.engine.driver = None

    def _serve(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.has_unfinished())
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug must not hang the clients: end every request
                log.exception("engine step failed")
                self._error = e
                for request_id in list(self._sinks):
                    self._send(request_id, e)
                    engine.abort(request_id)
                self._sinks.clear()
                return
            for out in outputs:
                self._send(out.request_id, out)
                if out.finished:
                    self._sinks.pop(out.request_id, None)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload, sink = item
            if kind == "add":
                try:
                    self.engine.add_sequence(payload)
                    self._sinks[payload.request_id] = sink
                except ValueError as e:  # a duplicate id
                    loop, q = sink
                    loop.call_soon_threadsafe(q.put_nowait, e)
            elif self.engine.abort(payload):
                self._send(payload, _aborted(payload))
                self._sinks.pop(payload, None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _send(self, request_id: str, out) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            loop, q = sink
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass


def _aborted(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, "", [], True, "abort", 0, 0)
