"""build_app(): the FastAPI app over an AsyncEngine, and the state its routes share.

The app can exist before its engine (`specinfer serve` listens while the model loads): /health
answers 503 until `state.attach(async_engine)`, and again once `state.draining` is set
(shutdown), when every new generation request gets a 503 too. With an API key, every route asks
for it (`Authorization: Bearer KEY`, as OpenAI's clients send it; 401 otherwise) but /health and
/metrics, which stay open for load balancers and scrapers. With allowed origins, browsers may
call it from those pages (CORS; a preflight needs no key).
"""

from __future__ import annotations

import hmac
import time

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from specinfer.server import chat, completions, responses, tokens
from specinfer.server.errors import APIError, error_response, install_handlers
from specinfer.server.metrics import ServerMetrics

UNGUARDED = ("/health", "/metrics")  # routes an API key does not guard


class ServerState:
    def __init__(self, async_engine, model_name: str):
        self.model_name = model_name
        self.async_engine = None
        self.engine = None  # the AsyncEngine's Engine: tokenizer, max_model_len, stats()
        self.draining = False
        self.jobs: dict = {}  # job id -> (Job, its output queue), while it runs (generation.py)
        self.created = int(time.time())
        self.responses = responses.ResponseStore()  # stored /v1/responses answers
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine else None)
        if async_engine is not None:
            self.attach(async_engine)

    def attach(self, async_engine) -> None:
        self.engine = async_engine.engine
        self.async_engine = async_engine

    @property
    def status(self) -> str:
        if self.draining:
            return "shutting down"
        if self.async_engine is None:
            return "loading"
        return "ok" if self.async_engine.ready else "engine stopped"

    def admit(self, model: str) -> None:
        """Raise APIError unless a generation request for `model` may start now."""
        status = self.status
        if status == "shutting down":
            raise APIError(503, "the server is shutting down")
        if status == "loading":
            raise APIError(503, "the model is still loading")
        if status != "ok":
            raise APIError(503, "the engine has stopped (see the server's log)")
        if model != self.model_name:
            raise APIError(
                404, f"The model '{model}' does not exist (this server serves "
                f"'{self.model_name}')", "model", "model_not_found",
            )  # fmt: skip


class RequireKey:
    """ASGI middleware: a 401 for an HTTP request to a guarded route without the key."""

    def __init__(self, app, expected: bytes):
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in UNGUARDED:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                refusal = error_response(401, "missing or incorrect API key (send the header "
                                         "'Authorization: Bearer <key>')", None,
                                         "invalid_api_key")  # fmt: skip
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


class CountRequests:
    """ASGI middleware: each HTTP response counted by method, route template (set in the scope
    by routing; "unmatched" where none took it) and status, as it starts (a stream's chunks
    pass untouched)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        def count(status: int) -> None:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.counter.labels(scope["method"], route, str(status)).inc()

        async def counted(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:  # answered with a 500 further out, by the app's error handler
            if not started:
                count(500)
            raise


def build_app(async_engine, served_model_name: str, api_key: str | None = None,
              allowed_origins: list[str] | None = None) -> FastAPI:  # fmt: skip
    """The OpenAI-compatible app. async_engine may be None (not ready yet; see ServerState).
    allowed_origins: the web pages (origins, or "*") whose scripts may call it (CORS)."""
    app = FastAPI(title="specinfer", docs_url=None, redoc_url=None)
    state = ServerState(async_engine, served_model_name)
    app.state.server = state
    install_handlers(app)
    if api_key:
        app.add_middleware(RequireKey, expected=f"Bearer {api_key}".encode())

    app.add_middleware(CountRequests, counter=state.metrics.http)  # outside the key check

    if allowed_origins:  # added last, so outermost: a preflight is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])  # fmt: skip

    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses.router)
    app.include_router(tokens.router)

    @app.get("/health")
    async def health():
        status = state.status
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    def model_card() -> dict:
        card = {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "specinfer"}  # fmt: skip
        if state.engine is not None:
            card["max_model_len"] = state.engine.max_model_len
        return card

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != state.model_name:
            return error_response(
                404, f"The model '{model}' does not exist", "model", "model_not_found"
            )
        return model_card()

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
