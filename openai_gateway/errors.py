"""OpenAI's error object, and the HTTP status of each kind of failure.

Every error the gateway sends has the shape the ``openai`` SDK parses::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "input", "code": null}}
"""

from __future__ import annotations

from typing import Any

import orjson

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_cancelled",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """One request's failure: an HTTP status and OpenAI's error fields.

    ``param`` names the request field at fault (``"input[3]"``, ``"max_tokens"``) and the
    message names the limit where one was broken.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
        data: Any = None,
    ):
        super().__init__(message)
        # The model's error data (contract.errors.ErrorData) when a model refused the request.
        self.data = data
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        """The error object as JSON bytes."""
        return orjson.dumps(self.body())


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request broke a rule; ``param`` names the field."""
    return APIError(400, message, param=param, code=code)


def too_large(message: str, param: str | None = None) -> APIError:
    """413: an input over a size limit, which the message names."""
    return APIError(413, message, param=param, code="request_too_large")


def model_not_found(model: Any, kind: str, served: list[str]) -> APIError:
    """404 for a model that is not served, listing those that are."""
    names = ", ".join(served) or "none"
    return APIError(
        404,
        f"The model {model!r} does not exist or is not a served {kind} model (served: {names})",
        param="model",
        code="model_not_found",
    )


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    """503 with ``Retry-After``: Triton or a model is not ready."""
    return APIError(503, message, headers={"Retry-After": str(retry_after_s)}, code="triton_unavailable")
