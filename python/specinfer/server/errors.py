"""OpenAI-style errors: every failure answers `{"error": {"message", "type", "param", "code"}}`.

400 invalid_request_error: bad JSON, wrong types, missing fields, bad values (SamplingParams'
ValueError message), too long a prompt or completion for the context; 401: a missing or wrong
API key (when the server has one); 404: unknown model or route; 503: the engine is loading or the server is shutting down; 500: anything else (logged
with its traceback here, never sent to the client).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("specinfer.server")

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code=None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code=None):
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def invalid(exc: ValidationError) -> APIError:
    """The 400 for a body part validated outside FastAPI's parsing (a chat request built from
    another route's body), worded as FastAPI's own are."""
    return APIError(400, *_validation_message(exc))


def _validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """The first problem pydantic found, as 'field: what is wrong', and the field's path."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    # A union reports a location per member type (e.g. 'stop.str'); keep the field's own path.
    tags = ("str", "int", "float", "bool", "list[", "dict[", "function-")
    loc = [p for p in loc if p not in tags[:4] and not p.startswith(tags[4:])]
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")  # our validators name their field
    if not message.startswith(param or "request body"):
        message = f"{param or 'request body'}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.error("error serving %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal server error ({type(exc).__name__})")
