"""The HTTP front of specinfer: an OpenAI-compatible API over an `AsyncEngine`.

Each module holds one job:

    app.py          build_app(): routes /health, /v1/models, /metrics; the server's state
    protocol.py     request bodies (pydantic) and their mapping to SamplingParams
    generation.py   one HTTP request -> n engine requests, their outputs merged, timed, aborted
    completions.py  /v1/completions      (text_completion, SSE chunks)
    chat.py         /v1/chat/completions (chat.completion, SSE chunks)
    responses.py    /v1/responses (the Responses API: response objects, typed SSE events, a store)
    responses_request.py  its body, read as the chat request it amounts to
    tokens.py       /tokenize, /detokenize
    tools.py        tool calling: tools described, calls parsed, a forced call's grammar
    sse.py          the SSE response (closes its generator however the stream ends)
    errors.py       OpenAI-style JSON errors and the exception handlers
    metrics.py      Prometheus metrics: server-side latencies, engine counters from stats()
    serve.py        `specinfer serve`: uvicorn, engine loading, graceful shutdown

Importing this package does not import FastAPI (the CLI imports it for --help); `build_app`
loads it on first use.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "build_app":
        from specinfer.server.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["build_app"]
