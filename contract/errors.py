"""The errors a request can meet, as data that crosses every hop.

A request error carries a ``code`` (what kind of failure, which decides the status on each
protocol), the ``field`` at fault and the ``values`` that broke the rule (the limit, what was
sent), beside a message for people.

Inside the deployment a Python backend's error reaches tritonserver as a message string only, so
the model writes it with :func:`format_error`: the words first, then the data after :data:`MARK`
as one JSON object. Whoever reads tritonserver directly (the doors, the gateway, a BLS caller)
calls :func:`parse_error` and reads the code, field and values from the data, never from the
words, which may change.

At the public edges the doors take the data out of the words and put it where each protocol
carries it:

- HTTP (the front door's KServe ``infer`` and ``generate``, the stream door's ``generate_stream``
  error events): a JSON body :func:`error_body`, ``{"error": <words>, "code", "field",
  "values"}``; a client reads it with :func:`data_from_body`;
- gRPC unary (``ModelInfer`` through the gRPC door): the status code from the data
  (:data:`GRPC_STATUS`), the words as the details, the data as the trailing metadata
  :data:`ERROR_METADATA` (:func:`data_json`);
- a gRPC stream (``ModelStreamInfer``): its response has ``error_message`` and no status, and
  tritonclient hands a stream's callback that message alone, so the data stays after the words
  there (:func:`format_data`), as the models wrote it.

:func:`error_data` reads an exception, wherever its protocol put the data. The shims map each
code to a Triton error code (:data:`TRITON_CODES`); the gateway maps it to an HTTP status.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from contract.prose import tritonclient_rpc_error

# The codes, as the gateway and the clients see them.
INVALID = "invalid_value"  # a field broke a rule: 400 / INVALID_ARG
CONTEXT_LENGTH = "context_length_exceeded"  # prompt + max_tokens over the context: 400 / INVALID_ARG
TOO_LARGE = "request_too_large"  # an input over a size limit: 413 / INVALID_ARG
OVERLOADED = "overloaded"  # no capacity now, retry later: 503 / UNAVAILABLE
UNAVAILABLE = "unavailable"  # the model cannot serve now (unloading): 503 / UNAVAILABLE
INTERNAL = "internal"  # the server failed: 500 / INTERNAL
CODES = (INVALID, CONTEXT_LENGTH, TOO_LARGE, OVERLOADED, UNAVAILABLE, INTERNAL)
# Triton's TritonError code names for each code (pb_utils.TritonError.<name>).
TRITON_CODES = {
    INVALID: "INVALID_ARG",
    CONTEXT_LENGTH: "INVALID_ARG",
    TOO_LARGE: "INVALID_ARG",
    OVERLOADED: "UNAVAILABLE",
    UNAVAILABLE: "UNAVAILABLE",
    INTERNAL: "INTERNAL",
}
# gRPC's status for each code: what a stream error (which has none of its own) stands for.
GRPC_STATUS = {
    INVALID: "StatusCode.INVALID_ARGUMENT",
    CONTEXT_LENGTH: "StatusCode.INVALID_ARGUMENT",
    TOO_LARGE: "StatusCode.INVALID_ARGUMENT",
    OVERLOADED: "StatusCode.UNAVAILABLE",
    UNAVAILABLE: "StatusCode.UNAVAILABLE",
    INTERNAL: "StatusCode.INTERNAL",
}
HTTP_STATUS = {INVALID: 400, CONTEXT_LENGTH: 400, TOO_LARGE: 413, OVERLOADED: 503, UNAVAILABLE: 503, INTERNAL: 500}
# Where the data begins in a message: after the words, which never contain it.
MARK = " #error-data "
# The gRPC trailing metadata key of a unary error's data (data_json).
ERROR_METADATA = "error-data"


class ConfigError(ValueError):
    """The model configuration or its files are wrong: the model must fail to load."""


class RequestError(Exception):
    """One request failed; only that request (``code``, ``field``, ``values`` as data)."""

    code = INTERNAL

    def __init__(self, field: str | None, message: str, *, code: str | None = None, values: Mapping[str, Any] | None = None):
        self.field = field
        self.message = message
        if code is not None:
            self.code = code
        if self.code not in CODES:
            raise ValueError(f"unknown error code {self.code!r}")
        self.values = dict(values or {})
        super().__init__(f"{field}: {message}" if field else message)

    @property
    def data(self) -> ErrorData:
        """The error as the data that crosses hops."""
        return ErrorData(self.code, self.field, self.values, str(self))


class InputError(RequestError, ValueError):
    """One request's input is invalid. Only that request fails (Triton INVALID_ARG)."""

    code = INVALID

    def __init__(self, field: str, message: str, *, code: str | None = None, values: Mapping[str, Any] | None = None):
        super().__init__(field, message, code=code, values=values)


class Overloaded(RequestError, RuntimeError):
    """The request's class has no capacity left now: refused at once, not queued (Triton
    UNAVAILABLE; the project's clients retry it with backoff)."""

    code = OVERLOADED

    def __init__(self, message: str, *, values: Mapping[str, Any] | None = None):
        super().__init__(None, message, values=values)


class Unavailable(RequestError, RuntimeError):
    """The model cannot serve now (it is unloading or shutting down): retry, maybe elsewhere."""

    code = UNAVAILABLE

    def __init__(self, message: str):
        super().__init__(None, message)


@dataclass(frozen=True)
class ErrorData:
    """A request error as it crossed a hop: its code, field and values, and the words."""

    code: str
    field: str | None
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    message: str = ""

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)


def format_error(exc: BaseException, prefix: str = "") -> str:
    """The Triton error message of ``exc``: its words (after ``prefix``), then its data."""
    if isinstance(exc, RequestError):
        data = exc.data
    else:
        data = ErrorData(INTERNAL, None, {}, f"internal error: {exc}")
    return f"{prefix}{data.message}{MARK}{data_json(data)}"


def data_json(data: ErrorData) -> str:
    """The data of an error as one JSON object (``code``, ``field``, ``values``): what follows
    :data:`MARK` in a message, and what a gRPC error's ``error-data`` trailing metadata holds."""
    return json.dumps({"code": data.code, "field": data.field, "values": data.values}, separators=(",", ":"), default=str)


def format_data(data: ErrorData) -> str:
    """The message of an error another hop made (the doors' refusals): its words, then its data."""
    return f"{data.message}{MARK}{data_json(data)}"


def parse_error(text: str) -> ErrorData | None:
    """The data of a message :func:`format_error` wrote (anything may have been put in front of
    it on the way); None when the message holds none (Triton's own errors)."""
    words, mark, tail = text.rpartition(MARK)
    if not mark:
        return None
    return data_from_json(tail, words)


def data_from_json(text: str | bytes, words: str = "") -> ErrorData | None:
    """The data :func:`data_json` wrote (a message's tail, a gRPC error's ``error-data``
    metadata), with ``words``; None when it is not such data."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data_from_body({**obj, "error": words}) if isinstance(obj, dict) else None


def error_body(data: ErrorData) -> dict[str, Any]:
    """An HTTP JSON error body with the data as its own keys: ``{"error": <words>, "code",
    "field", "values"}`` (the front door's and the stream door's answers)."""
    return {"error": data.message, "code": data.code, "field": data.field, "values": data.values}


def data_from_body(body: Mapping[str, Any]) -> ErrorData | None:
    """The data of an HTTP JSON error body (:func:`error_body`); None when it has none (an
    error of tritonserver's own, a proxy's page)."""
    if body.get("code") not in CODES:
        return None
    name, values, words = body.get("field"), body.get("values"), body.get("error")
    return ErrorData(
        body["code"],
        name if isinstance(name, str) else None,
        values if isinstance(values, dict) else {},
        words if isinstance(words, str) else "",
    )


def public_body(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """tritonserver's JSON error body ``{"error": <words and data>}`` as a public edge answers
    it (:func:`error_body`); None when its message holds no data (left as it came)."""
    text = body.get("error")
    data = parse_error(text) if isinstance(text, str) else None
    return None if data is None else {**body, **error_body(data)}


def error_data(exc: BaseException) -> ErrorData | None:
    """The data of a failed call, wherever its protocol put it: read by a client from an HTTP
    body's keys (an ``error_data`` attribute), a gRPC error's :data:`ERROR_METADATA` trailing
    metadata (on the error itself or, for tritonclient's exception, on the gRPC error it was
    raised from: :func:`contract.prose.tritonclient_rpc_error`), else after the mark in its
    message (a gRPC stream's error, an internal hop)."""
    found = getattr(exc, "error_data", None)
    if isinstance(found, ErrorData):
        return found
    words = _message_of(exc)
    for rpc in (exc, tritonclient_rpc_error(exc)):
        data = _metadata_data(rpc, words) if rpc is not None else None
        if data is not None:
            return data
    return parse_error(words)


def _message_of(exc: BaseException) -> str:
    for name in ("message", "details"):  # tritonclient's InferenceServerException, a grpc.RpcError
        method = getattr(exc, name, None)
        if callable(method):
            try:
                text = method()
            except Exception:  # noqa: BLE001 (a failed call's accessors may raise)
                continue
            if isinstance(text, str):
                return text
    return str(exc)


def _metadata_data(rpc: BaseException, words: str) -> ErrorData | None:
    trailing = getattr(rpc, "trailing_metadata", None)
    if not callable(trailing):
        return None
    try:
        pairs: Iterable[tuple[str, Any]] = trailing() or ()
    except Exception:  # noqa: BLE001
        return None
    for key, value in pairs:
        if key == ERROR_METADATA:
            return data_from_json(value, words_of(words))
    return None


def words_of(text: str) -> str:
    """A Triton error message without its data: what a person reads."""
    words, mark, _ = text.rpartition(MARK)
    return words if mark else text


def error_from_message(text: str, prefix: str = "") -> Exception:
    """The error an error message from another hop (a BLS response) stands for: a RequestError of
    the same code, field and values when the message carries data, else a RuntimeError with its
    words. Triton 2.51's python backend drops a BLS error's Triton code, so the data is what
    tells an overloaded or invalid request from a failure."""
    data = parse_error(text)
    if data is None:
        return RuntimeError(f"{prefix}{text}")
    return RequestError(data.field, f"{prefix}{_without_field(data)}", code=data.code, values=data.values)


def _without_field(data: ErrorData) -> str:
    # RequestError puts "field: " in front of its message again.
    lead = f"{data.field}: "
    return data.message.split(lead, 1)[1] if data.field and lead in data.message else data.message
