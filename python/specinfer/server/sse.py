"""Server-sent events: `data: {json}\\n\\n` lines, ending in `data: [DONE]`.

Starlette cancels a streaming response when the client disconnects; the cancellation lands
wherever the response is waiting, which may be in `send` with the event generator parked at a
`yield`. `SSEResponse` then closes the generator itself (shielded from that cancellation), so
its `finally` (which aborts the engine requests) runs now, not whenever it is collected.
"""

from __future__ import annotations

import json

import anyio
from starlette.responses import StreamingResponse


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    def __init__(self, events):
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()


def typed_event(payload: dict) -> str:
    """An event named by its payload's type (the Responses API's stream: no [DONE] follows)."""
    return f"event: {payload['type']}\n{event(payload)}"
