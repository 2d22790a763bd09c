"""The clients' errors, written once for both roles: ``ClientError`` (the base of EmbeddingError
and GenerationError) carries the server's words and the model's error data (contract/errors.py);
``translate`` turns a tritonclient, socket or aiohttp failure, or a RetryError, into one.

The data is read where each protocol carries it (contract.errors.error_data): an HTTP error
body's keys (tritonclient keeps only its ``error``: ``ServerError`` keeps the rest), a gRPC call's
``error-data`` trailing metadata, and after the words only in a gRPC stream's error, which has no
other field. The only prose read here is tritonclient's own (contract/prose.py): its message for
an HTTP body that is not Triton's error, i.e. a proxy whose upstream is down.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from tritonclient.utils import InferenceServerException

from clients.resilience import RetryError, describe
from contract.errors import GRPC_STATUS, ErrorData, data_from_body, error_data, parse_error, words_of
from contract.prose import tritonclient_undecodable

E = TypeVar("E", bound="ClientError")


class ServerError(InferenceServerException):
    """tritonclient's exception for a server's error that carries data (contract/errors.py) beside
    its words: ``error_data``, which tritonclient's own exception drops."""

    def __init__(self, data: ErrorData, status: str | None = None):
        super().__init__(msg=data.message, status=status)
        self.error_data = data


def raise_body_data(body: bytes, status: int) -> None:
    """Raise ServerError for an HTTP error body with the data as its keys; nothing for any other
    body (tritonclient then reads it as it always does)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return
    data = data_from_body(obj) if isinstance(obj, dict) else None
    if data is not None:
        raise ServerError(data, str(status))


def with_rpc_data(error: InferenceServerException, rpc: Any) -> InferenceServerException:
    """tritonclient's exception for a failed gRPC call (``get_error_grpc``, which drops the trailing
    metadata), as ServerError when the call's metadata carries the data."""
    data = error_data(rpc)
    return ServerError(data, error.status()) if data is not None else error


class ClientError(RuntimeError):
    """A request failed. ``server_message``: the server's (or transport's) own words, the error
    data taken out; ``code``, ``field`` and ``values``: the model's error data (None and {} for
    other failures); ``status``: the HTTP status or gRPC status code when there is one;
    ``attempts``: how many attempts the call made when it gave up on retrying (None: it failed on
    the first answer not worth retrying). ``where`` starts the message (``model 'x'``, ...)."""

    def __init__(
        self,
        server_message: str,
        *,
        where: str,
        model: str = "",
        status: str | None = None,
        retry_note: str = "",
        attempts: int | None = None,
        data: ErrorData | None = None,
    ):
        # The model's error data (contract/errors.py) as the protocol carried it, else after the words.
        data = data if data is not None else parse_error(server_message)
        self.server_message = words_of(server_message)
        self.code = data.code if data else None
        self.field = data.field if data else None
        self.values = data.values if data else {}
        self.model = model
        self.status = status
        self.attempts = attempts
        code = f" [{status}]" if status else ""
        note = f"; {retry_note}" if retry_note else ""
        super().__init__(f"{where}{code}: {self.server_message}{note}")

    def keep_data(self: E, other: ClientError) -> E:
        """This error with ``other``'s error data (a rewrapped message has lost it); itself."""
        self.code, self.field, self.values = other.code, other.field, other.values
        return self


def failure_words(
    exc: BaseException, protocol: str, url: str, timeout_s: float | None
) -> tuple[str, str | None, ErrorData | None]:
    """The message, status and error data of a failed attempt at ``url``: the model's error as it
    came (a stream error's status taken from its data), else what the transport's failure means."""
    if isinstance(exc, InferenceServerException):
        status = exc.status()
        message = exc.message() or str(exc)
        data = error_data(exc)
        if data is not None:  # the model's own error: a stream's carries its status only in its data
            return words_of(message), status or GRPC_STATUS[data.code], data
        if status in ("502", "503", "504") and tritonclient_undecodable(message):
            # Not Triton's JSON error: a proxy (the front door) whose upstream is down or restarting.
            words = f"the http server at {url} answered {status} without a Triton error (is tritonserver behind it down?)"
            return words, status, None
        if status == "StatusCode.UNAVAILABLE":
            message = f"cannot reach the grpc server at {url}: {message}"
        elif status == "StatusCode.DEADLINE_EXCEEDED":
            message = f"no answer from the grpc server at {url} within {timeout_s} s: {message}"
        return message, status, None
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return f"no answer from the {protocol} server at {url} within {timeout_s} s", None, None
    return f"cannot reach the {protocol} server at {url}: {exc}", None, None


def translate(
    exc: BaseException,
    make: Callable[..., E],
    protocol: str,
    url: str,
    timeout_s: float | None,
    no_endpoint: str = "no endpoint available",
) -> E:
    """``exc`` as the client's error, built by ``make(message, status=, retry_note=, attempts=)``.

    A RetryError (the retries ran out) gives its last error, noting the attempts and the
    deadline; the client's own error is rebuilt by ``make`` (which may name more, e.g. the slice
    of texts), keeping its status and data.
    """
    if isinstance(exc, RetryError):
        note = describe(exc.attempts, exc.elapsed_s, exc.deadline_s, exc.reason)
        if exc.last is None:
            return make(no_endpoint, retry_note=note, attempts=exc.attempts)
        last = translate(exc.last, make, protocol, url, timeout_s, no_endpoint)
        return make(last.server_message, status=last.status, retry_note=note, attempts=exc.attempts).keep_data(last)
    if isinstance(exc, ClientError):
        return make(exc.server_message, status=exc.status).keep_data(exc)
    message, status, data = failure_words(exc, protocol, url, timeout_s)
    return make(message, status=status, data=data)
