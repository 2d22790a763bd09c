"""JSON responses, and errors as responses in OpenAI's shape."""

from __future__ import annotations

from fastapi.responses import Response

from openai_gateway.errors import APIError

JSON = "application/json"


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    """A response of already serialised JSON (the gateway serialises with orjson itself)."""
    return Response(body, status_code=status, media_type=JSON, headers=headers)


def error_response(err: APIError) -> Response:
    """``err`` as OpenAI's error object, with its status and headers (``Retry-After``)."""
    return json_response(err.status, err.json(), err.headers)
