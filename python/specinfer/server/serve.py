"""`specinfer serve`: the OpenAI-compatible server under uvicorn.

Order of events: the server listens first (GET /health answers 503 "loading"), the engine loads on
a thread and serves two short requests of its own (Engine.warm_up), then /health answers 200 and
one line says so on stdout: `specinfer: serving <name> on http://<host>:<port>`. SIGTERM or
SIGINT starts a graceful shutdown: new requests get 503, in-flight ones may finish for
--shutdown-timeout seconds and are then aborted (their streams end with finish_reason "abort"),
uvicorn closes, the exit status is 0.
A second SIGINT stops at once. A model that fails to load: the error on stderr, status 2.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_name(model: str | None) -> str:
    """The default --served-model-name: the model file's name without .gguf, or its directory's."""
    from specinfer.default_model import GGUF_NAME

    if model is None or Path(model).name == GGUF_NAME:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def build_engine(args):
    """The Engine the serve options describe (speculation defaults as `specinfer generate`'s),
    warmed up unless --no-warm-up or --offload (whose forwards stream every layer: slow)."""
    from specinfer.cli import engine_from_args

    engine = engine_from_args(args, max_batch_size=args.max_batch_size,
                              max_model_len=args.max_model_len, kv_budget=args.kv_budget,
                              prefix_caching=None if args.prefix_caching else False)  # fmt: skip
    if args.warm_up and not args.offload:
        engine.warm_up()
    return engine


def run(args) -> int:
    import uvicorn

    from specinfer.server.app import build_app

    name = args.served_model_name or served_name(args.model)
    app = build_app(None, name, args.api_key or os.environ.get("SPECINFER_API_KEY"),
                    args.allowed_origins)  # fmt: skip

    class Server(uvicorn.Server):
        """A signal starts our drain (not uvicorn's immediate stop) and is not re-raised after
        serve() returns (uvicorn re-raises it, which would end the process by SIGTERM)."""

        def __init__(self, config) -> None:
            super().__init__(config)
            self.loop: asyncio.AbstractEventLoop | None = None
            self.stop = asyncio.Event()

        def handle_exit(self, sig, frame) -> None:
            if self.stop.is_set() and sig == signal.SIGINT:  # a second Ctrl-C: stop now
                self.should_exit = self.force_exit = True
            elif self.loop is not None:
                self.loop.call_soon_threadsafe(self.stop.set)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            lifespan="off", timeout_graceful_shutdown=5)  # fmt: skip
    server = Server(config)
    return asyncio.run(_serve(server, app.state.server, name, args))


async def _serve(server, state, name: str, args) -> int:
    from specinfer.engine import AsyncEngine
    from specinfer.server.generation import end_all

    loop = server.loop = asyncio.get_running_loop()
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():  # could not bind: uvicorn logged why
            return 1
        await asyncio.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]

    # The engine loads on a daemon thread: a signal during loading need not wait for it.
    loaded: asyncio.Future = loop.create_future()

    def load() -> None:
        try:
            result = build_engine(args)
        except BaseException as e:  # noqa: BLE001 - handed to the event loop
            loop.call_soon_threadsafe(_settle, loaded, None, e)
        else:
            loop.call_soon_threadsafe(_settle, loaded, result, None)

    threading.Thread(target=load, name="specinfer-load", daemon=True).start()
    stop = asyncio.create_task(server.stop.wait())
    await asyncio.wait({loaded, stop, serving}, return_when=asyncio.FIRST_COMPLETED)
    if not loaded.done():
        print("specinfer: stopped before the model loaded", file=sys.stderr)
        return await _close(server, serving, 0)
    if loaded.exception() is not None:
        print(f"specinfer: error: {loaded.exception()}", file=sys.stderr)
        return await _close(server, serving, 2)
    async_engine = AsyncEngine(loaded.result())
    state.attach(async_engine)
    print(f"specinfer: serving {name} on http://{host}:{port}", flush=True)

    await asyncio.wait({stop, serving}, return_when=asyncio.FIRST_COMPLETED)
    state.draining = True  # /health and new requests: 503
    print(f"specinfer: shutting down (in-flight requests get {args.shutdown_timeout:g} s)",
          file=sys.stderr, flush=True)  # fmt: skip
    await async_engine.shutdown(args.shutdown_timeout)
    end_all(state)  # a request the engine did not end (it has stopped) ends here, "abort"
    return await _close(server, serving, 0)


async def _close(server, serving: asyncio.Task, status: int) -> int:
    server.should_exit = True
    await serving
    return status


def _settle(future: asyncio.Future, result, error) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
