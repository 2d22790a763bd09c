"""Exceptions as responses: every failure a route raises, or FastAPI and Starlette raise for
it, leaves as OpenAI's error object with a fitting status (a client gone: 499, no body)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from openai_gateway.errors import APIError
from openai_gateway.responses import error_response
from openai_gateway.state import request_info
from openai_gateway.streaming import ClientGone

log = logging.getLogger("openai_gateway")


async def on_api_error(request: Request, exc: APIError) -> Response:
    """A refusal of the gateway's own checks or of Triton: its status and error object."""
    request_info(request)["error"] = exc.type
    return error_response(exc)


async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
    """A body that is not JSON (400 invalid_json) or does not fit the schema (422, naming the
    first field at fault and up to five errors)."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        err = APIError(
            400, f"The body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", code="invalid_json"
        )
    else:
        param = ".".join(loc) or None
        details = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]
        )
        err = APIError(422, f"Invalid request: {details}", param=param, code="invalid_request")
    request_info(request)["error"] = err.type
    return error_response(err)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Routing's 404 and 405, and a body over the limit read inside a route (413)."""
    message = {404: f"Unknown path {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    err = APIError(
        exc.status_code,
        message.get(exc.status_code, str(exc.detail)),
        code="request_too_large" if exc.status_code == 413 else None,
    )
    return error_response(err)


async def on_client_gone(request: Request, exc: ClientGone) -> Response:
    """The client left before its answer: 499 in the log and the metrics."""
    request_info(request)["error"] = "client_disconnected"
    return Response(status_code=499)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    """A bug: logged with its traceback, answered 500 with the request id to quote."""
    info = request_info(request)
    log.exception("request %s failed", info.get("request_id"))
    info["error"] = "server_error"
    return error_response(APIError(500, f"Internal error (request id {info.get('request_id')})"))


EXCEPTION_HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    APIError: on_api_error,
    RequestValidationError: on_validation_error,
    StarletteHTTPException: on_http_error,
    ClientGone: on_client_gone,
    Exception: on_unexpected,
}
