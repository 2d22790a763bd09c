"""Clients of the ``text_generation`` model: whole answers and token streams, sync and asyncio.

The served model has the interface of Triton's vLLM backend (``text_input``, ``stream``,
``sampling_parameters`` JSON, ``exclude_input_in_output``, ``return_*``) plus this project's
``apply_chat_template`` (``text_input`` is then a JSON list of ``{"role", "content"}``
messages that the server renders with the model's chat template). Two transports:

- gRPC: the bidirectional stream of tritonclient (decoupled responses; the last one carries
  ``triton_final_response``). A whole answer is one request with ``stream`` false.
- HTTP: Triton's generate extension, ``POST /v2/models/<model>/generate`` (one JSON object)
  and ``/generate_stream`` (Server-Sent Events, one ``data: {...}`` event per text piece).

All sampling parameters travel in ``sampling_parameters`` on both protocols: Triton's
generate endpoint refuses a list (``stop``) as a request parameter.

    from clients.generation import GenerationClient

    with GenerationClient("127.0.0.1:8001", protocol="grpc") as client:
        answer = client.chat([{"role": "user", "content": "Capital of France?"}], max_tokens=16)
        print(answer.text, answer.finish_reason, answer.tokens_per_s)
        with client.stream("Once upon a time", max_tokens=64) as pieces:
            for piece in pieces:
                print(piece, end="", flush=True)
        print(pieces.result)

Closing a stream before its end (``close()``, leaving the ``with`` block, Ctrl-C) cancels
the request on the server: gRPC cancels the call, HTTP closes the connection; either way the
model sees the request cancelled and frees its KV blocks.

Several URLs (a list or ``"a:8001,b:8001"``) fail over as the embedding clients do
(clients/resilience.py): a request refused as UNAVAILABLE, or whose connection fails, is sent
again, to another endpoint when there is one, but only until its first response arrived;
after that an error is the caller's (the text already read cannot be taken back).
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from tritonclient.utils import InferenceServerException

from clients.embed import PROTOCOLS, Protocol, parse_urls, transport
from clients.resilience import (
    EndpointPool,
    RetryError,
    RetryPolicy,
    describe,
    make_retrier,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "text_generation"
# Sampling parameters the served model accepts (vLLM's names), with the JSON types each takes.
SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "max_tokens": (int,),
    "min_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "seed": (int,),
    "stop": (list,),
    "ignore_eos": (bool,),
    "repetition_penalty": (int, float),
}
ROLES = ("system", "user", "assistant")
STOP_TIMEOUT_S = 5.0  # at most this long to stop a cancelled gRPC stream
_ids = itertools.count(1)


class GenerationError(RuntimeError):
    """A generation request failed.

    ``server_message`` is Triton's (or the transport's) own message; for bad input it names
    the field, e.g. ``"max_tokens must be >= 1, got 0"``. ``status`` is the HTTP status
    (``"400"``) or the gRPC status code when there is one.
    """

    def __init__(self, server_message: str, *, model: str = DEFAULT_MODEL, status: str | None = None,
                 retry_note: str = "", attempts: int | None = None):
        self.server_message = server_message
        self.model = model
        self.status = status
        self.attempts = attempts
        code = f" [{status}]" if status else ""
        note = f"; {retry_note}" if retry_note else ""
        super().__init__(f"model '{model}'{code}: {server_message}{note}")


@dataclass(frozen=True)
class Generation:
    """A finished generation. Times are measured by the client, from sending the request."""

    text: str
    finish_reason: str | None  # "stop", "length", "abort", or None when the server did not say
    num_input_tokens: int | None
    num_output_tokens: int | None
    time_to_first_token_s: float | None  # None when no text came back
    total_time_s: float

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens per second over the whole request (None without a token count)."""
        if not self.num_output_tokens or self.total_time_s <= 0:
            return None
        return self.num_output_tokens / self.total_time_s


@dataclass(frozen=True)
class Piece:
    """One response of the model: a piece of text and whatever counts came with it."""

    text: str
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None


def sampling_parameters(**params: Any) -> dict[str, Any]:
    """The ``sampling_parameters`` JSON object of the given options; ``None`` values are left out.

    Checks names and JSON types only (TypeError/ValueError); ranges are the server's to judge,
    so its INVALID_ARG message (naming the field) reaches the caller unchanged. ``stop`` may be
    one string or a list of strings.
    """
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name not in SAMPLING_FIELDS:
            raise ValueError(f"unknown sampling parameter {name!r}; known: {', '.join(SAMPLING_FIELDS)}")
        if value is None:
            continue
        if name == "stop":
            value = [value] if isinstance(value, str) else list(value)
            if not all(isinstance(s, str) for s in value):
                raise TypeError("stop must be a string or a list of strings")
        elif isinstance(value, bool) != (SAMPLING_FIELDS[name] == (bool,)) or not isinstance(value, SAMPLING_FIELDS[name]):
            kinds = " or ".join(t.__name__ for t in SAMPLING_FIELDS[name])
            raise TypeError(f"{name} must be {kinds}, not {type(value).__name__}")
        out[name] = value
    return out


def chat_messages(messages: str | Sequence[Mapping[str, str]], system: str | None = None) -> list[dict[str, str]]:
    """A chat as the list of ``{"role", "content"}`` the server renders; a bare string is one
    user message, and ``system`` prepends a system message (replacing one already first)."""
    if isinstance(messages, str):
        items = [{"role": "user", "content": messages}]
    else:
        items = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise TypeError(f"messages[{i}] must be a mapping with string 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ValueError(f"messages[{i}]: role must be one of {', '.join(ROLES)}, not {m['role']!r}")
            items.append({"role": m["role"], "content": m["content"]})
    if not items:
        raise ValueError("no messages")
    if system is not None:
        if items[0]["role"] == "system":
            items = items[1:]
        items.insert(0, {"role": "system", "content": system})
    return items


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the model takes it: prompt (or chat JSON), sampling and flags."""

    text_input: str
    sampling: dict[str, Any] = field(default_factory=dict)
    chat: bool = False

    @classmethod
    def prompt(cls, prompt: str, **sampling: Any) -> GenerateRequest:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be str, not {type(prompt).__name__}")
        return cls(prompt, sampling_parameters(**sampling))

    @classmethod
    def from_chat(cls, messages: str | Sequence[Mapping[str, str]], system: str | None = None, **sampling: Any) -> GenerateRequest:
        text = json.dumps(chat_messages(messages, system), ensure_ascii=False)
        return cls(text, sampling_parameters(**sampling), chat=True)

    def flags(self, stream: bool) -> dict[str, bool]:
        flags = {
            "stream": stream,
            "exclude_input_in_output": True,
            "return_finish_reason": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
        }
        if self.chat:
            flags["apply_chat_template"] = True
        return flags

    def http_body(self, stream: bool) -> bytes:
        """The JSON body of ``/generate`` or ``/generate_stream`` (top-level fields are inputs)."""
        body: dict[str, Any] = {"text_input": self.text_input, **self.flags(stream)}
        if self.sampling:
            body["sampling_parameters"] = json.dumps(self.sampling)
        return json.dumps(body, ensure_ascii=False).encode("utf-8")

    def grpc_inputs(self, stream: bool) -> list[Any]:
        """tritonclient.grpc InferInputs (each ``[1]``: the model has no batch dimension)."""
        module = transport("grpc")

        def tensor(name: str, value: Any, datatype: str) -> Any:
            array = np.array([value], dtype=object if datatype == "BYTES" else bool)
            t = module.InferInput(name, [1], datatype)
            t.set_data_from_numpy(array)
            return t

        inputs = [tensor("text_input", self.text_input.encode("utf-8"), "BYTES")]
        if self.sampling:
            inputs.append(tensor("sampling_parameters", json.dumps(self.sampling).encode("utf-8"), "BYTES"))
        inputs += [tensor(name, value, "BOOL") for name, value in self.flags(stream).items()]
        return inputs


# --- responses -----------------------------------------------------------------------------


class SSEDecoder:
    """Incremental Server-Sent Events parser: bytes in, the ``data`` of each event out.

    Chunks may end anywhere, inside a line or a multi-byte UTF-8 character: only complete
    lines are decoded (a line break byte never occurs inside a UTF-8 sequence). Handles
    LF, CRLF and CR line ends, multi-line ``data``, comments and other fields.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event completed by ``chunk``."""
        self._buffer += chunk
        events = []
        while True:
            cut = self._line_end()
            if cut is None:
                return events
            end, skip = cut
            line = self._buffer[:end].decode("utf-8", "replace")
            self._buffer = self._buffer[end + skip :]
            event = self._line(line)
            if event is not None:
                events.append(event)

    def close(self) -> list[str]:
        """Events left when the stream ends (a last event without its blank line)."""
        events = []
        if self._buffer:
            line, self._buffer = self._buffer.decode("utf-8", "replace"), b""
            event = self._line(line)
            if event is not None:
                events.append(event)
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line_end(self) -> tuple[int, int] | None:
        buf = self._buffer
        lf, cr = buf.find(b"\n"), buf.find(b"\r")
        if cr != -1 and (lf == -1 or cr < lf):
            if cr == len(buf) - 1:
                return None  # a CR at the end may be the first half of CRLF
            return cr, 2 if buf[cr + 1 : cr + 2] == b"\n" else 1
        return None if lf == -1 else (lf, 1)

    def _line(self, line: str) -> str | None:
        if line == "":
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None  # event:, id:, retry: carry nothing this client needs


def _scalar(value: Any) -> Any:
    # The generate extension writes one-element outputs as scalars; accept lists too.
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _reason(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    # Non-final responses carry an empty reason (the vLLM backend writes "None").
    return None if value in (None, "", "None", "null") else str(value)


def _count(value: Any) -> int | None:
    return None if value is None else int(value)


def piece_from_json(data: str | Mapping[str, Any], model: str = DEFAULT_MODEL, status: str | None = None) -> Piece:
    """One generate-extension JSON response as a Piece; GenerationError for ``{"error": ...}``."""
    if isinstance(data, str):
        try:
            obj = json.loads(data)
        except json.JSONDecodeError as exc:
            raise GenerationError(f"malformed response from the server: {data[:200]!r}", model=model, status=status) from exc
    else:
        obj = data
    if not isinstance(obj, Mapping):
        raise GenerationError(f"malformed response from the server: {str(data)[:200]!r}", model=model, status=status)
    if "error" in obj:
        raise GenerationError(str(obj["error"]), model=model, status=status)
    text = _scalar(obj.get("text_output"))
    return Piece(
        text="" if text is None else str(text),
        finish_reason=_reason(_scalar(obj.get("finish_reason"))),
        num_input_tokens=_count(_scalar(obj.get("num_input_tokens"))),
        num_output_tokens=_count(_scalar(obj.get("num_output_tokens"))),
    )


def piece_from_result(result: Any) -> Piece:
    """One gRPC InferResult as a Piece (an empty final response gives an empty Piece)."""

    def first(name: str) -> Any:
        array = result.as_numpy(name)
        return None if array is None or array.size == 0 else array.reshape(-1)[0]

    text = first("text_output")
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return Piece(
        text=text or "",
        finish_reason=_reason(first("finish_reason")),
        num_input_tokens=_count(first("num_input_tokens")),
        num_output_tokens=_count(first("num_output_tokens")),
    )


def is_final(result: Any) -> bool:
    """Whether a decoupled gRPC response is the request's last one."""
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


class Tracker:
    """Accumulates the pieces of one request into a Generation, timing them from ``start``."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self.start = clock()
        self.first: float | None = None
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.num_input_tokens: int | None = None
        self.num_output_tokens: int | None = None

    def add(self, piece: Piece) -> str:
        if piece.text and self.first is None:
            self.first = self._clock()
        if piece.text:
            self.parts.append(piece.text)
        # The latest value wins: counts grow along the stream, the reason comes last.
        self.finish_reason = piece.finish_reason or self.finish_reason
        if piece.num_input_tokens is not None:
            self.num_input_tokens = piece.num_input_tokens
        if piece.num_output_tokens is not None:
            self.num_output_tokens = piece.num_output_tokens
        return piece.text

    def result(self) -> Generation:
        end = self._clock()
        return Generation(
            text="".join(self.parts),
            finish_reason=self.finish_reason,
            num_input_tokens=self.num_input_tokens,
            num_output_tokens=self.num_output_tokens,
            time_to_first_token_s=None if self.first is None else self.first - self.start,
            total_time_s=end - self.start,
        )


def transport_error(exc: BaseException, protocol: str, url: str, model: str, timeout_s: float | None) -> GenerationError:
    """A tritonclient, socket or aiohttp failure as a GenerationError with the server's words;
    a RetryError as its last error, noting the attempts and the deadline."""
    if isinstance(exc, RetryError):
        note = describe(exc.attempts, exc.elapsed_s, exc.deadline_s, exc.reason)
        if exc.last is None:
            return GenerationError("no endpoint available", model=model, retry_note=note, attempts=exc.attempts)
        last = transport_error(exc.last, protocol, url, model, timeout_s)
        return GenerationError(last.server_message, model=model, status=last.status, retry_note=note,
                               attempts=exc.attempts)
    if isinstance(exc, GenerationError):
        return exc
    if isinstance(exc, InferenceServerException):
        status = exc.status()
        message = exc.message() or str(exc)
        if status == "StatusCode.UNAVAILABLE":
            message = f"cannot reach the grpc server at {url}: {message}"
        elif status == "StatusCode.DEADLINE_EXCEEDED":
            message = f"no answer from the grpc server at {url} within {timeout_s} s: {message}"
        return GenerationError(message, model=model, status=status)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return GenerationError(f"no answer from the {protocol} server at {url} within {timeout_s} s", model=model)
    return GenerationError(f"cannot reach the {protocol} server at {url}: {exc}", model=model)


@dataclass(frozen=True)
class GenerationOptions:
    """Validated connection options shared by the sync and asyncio clients."""

    url: str
    protocol: Protocol = "grpc"
    model: str = DEFAULT_MODEL
    model_version: str = ""
    timeout_s: float | None = None  # longest wait for the next response (the first included)
    urls: tuple[str, ...] = ()  # the endpoints failed over across; url is the first
    retries: int | None = None
    deadline_s: float | None = None  # bounds the attempts before the first response (default timeout_s)

    @classmethod
    def create(cls, url: str | Sequence[str] | None = None, protocol: str = "grpc", model: str = DEFAULT_MODEL,
               model_version: str = "", timeout_s: float | None = None, retries: int | None = None,
               deadline_s: float | None = None) -> GenerationOptions:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
        urls = parse_urls(url, protocol)
        if not model:
            raise ValueError("model name is empty")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, not {timeout_s}")
        RetryPolicy.create(retries, deadline_s)
        return cls(urls[0], protocol, model, str(model_version), timeout_s, urls, retries, deadline_s)  # type: ignore[arg-type]

    def http_path(self, stream: bool) -> str:
        version = f"/versions/{self.model_version}" if self.model_version else ""
        return f"/v2/models/{self.model}{version}/{'generate_stream' if stream else 'generate'}"

    def host_port(self, url: str | None = None) -> tuple[str, int]:
        url = url or self.url
        host, _, port = url.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"url {url!r} must be host:port")
        return host.strip("[]"), int(port)


def _request_id() -> str:
    return f"gen-{os.getpid()}-{next(_ids)}"


# --- sync ----------------------------------------------------------------------------------


class TextStream(Iterator[str]):
    """The text pieces of one streamed generation, as they arrive.

    Iterate it (or ``for piece in client.stream(...)``); after the last piece ``result``
    holds the Generation. ``close()`` before the end cancels the request on the server; a
    ``with`` block closes it. Raises GenerationError from the iteration when the request fails.
    """

    def __init__(self, pieces: Iterator[Piece], tracker: Tracker, cancel):
        self._pieces = pieces
        self._tracker = tracker
        self._cancel = cancel
        self.result: Generation | None = None
        self._done = False

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        if self._done:
            raise StopIteration
        try:
            while True:
                piece = next(self._pieces)
                text = self._tracker.add(piece)
                if text:
                    return text
        except StopIteration:
            self._done = True
            self.result = self._tracker.result()
            raise
        except BaseException:
            self.close()
            raise

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._tracker.parts)

    def close(self) -> None:
        """Stop reading; a request still running is cancelled on the server."""
        if not self._done:
            self._done = True
            self._cancel()
            self._pieces.close()  # type: ignore[attr-defined]

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 (at interpreter shutdown the client may be gone)
            pass


class GenerationClient:
    """Blocking client for ``text_generation`` over gRPC (default) or HTTP.

    One request at a time per client (a gRPC client holds one stream); not thread-safe. Use as
    a context manager or call ``close()``. Several URLs, ``retries``, ``deadline_s`` (which
    bounds the attempts until the first response), ``policy`` and ``pool``: as for
    ``clients.EmbeddingClient``.
    """

    def __init__(self, url: str | Sequence[str] | None = None, protocol: Protocol = "grpc", model: str = DEFAULT_MODEL,
                 model_version: str = "", timeout_s: float | None = None, *, retries: int | None = None,
                 deadline_s: float | None = None, policy: RetryPolicy | None = None, pool: EndpointPool | None = None):
        self.options = GenerationOptions.create(url, protocol, model, model_version, timeout_s, retries, deadline_s)
        o = self.options
        self.retrier = make_retrier(o.urls, o.timeout_s, o.retries, o.deadline_s, policy, pool)
        self._grpcs: dict[str, Any] = {}
        self._grpc_busy = False
        self._closed = False

    # The public calls: prompts and chats, whole or streamed.
    def generate(self, prompt: str, **sampling: Any) -> Generation:
        """Complete ``prompt`` (no chat template) and return the whole answer."""
        return self._whole(GenerateRequest.prompt(prompt, **sampling))

    def stream(self, prompt: str, **sampling: Any) -> TextStream:
        """Complete ``prompt``, yielding text pieces as the server produces them."""
        return self._stream(GenerateRequest.prompt(prompt, **sampling), stream=True)

    def chat(self, messages: str | Sequence[Mapping[str, str]], system: str | None = None, **sampling: Any) -> Generation:
        """Answer a chat (the model's template applied on the server); whole answer."""
        return self._whole(GenerateRequest.from_chat(messages, system, **sampling))

    def chat_stream(self, messages: str | Sequence[Mapping[str, str]], system: str | None = None, **sampling: Any) -> TextStream:
        """Answer a chat, yielding text pieces as they arrive."""
        return self._stream(GenerateRequest.from_chat(messages, system, **sampling), stream=True)

    def _whole(self, request: GenerateRequest) -> Generation:
        if self.options.protocol == "http":
            if self._closed:
                raise RuntimeError("GenerationClient is closed")
            o = self.options
            try:
                return self.retrier.call(lambda url, timeout_s: self._http_whole(request, url, timeout_s), o.timeout_s)
            except RetryError as exc:
                raise transport_error(exc, "http", o.url, o.model, o.timeout_s) from exc
        with self._stream(request, stream=False) as pieces:
            for _ in pieces:
                pass
        assert pieces.result is not None
        return pieces.result

    def _stream(self, request: GenerateRequest, stream: bool) -> TextStream:
        if self._closed:
            raise RuntimeError("GenerationClient is closed")
        o = self.options
        if o.protocol == "grpc":
            if self._grpc_busy:
                raise RuntimeError("GenerationClient runs one gRPC stream at a time: close the previous stream first "
                                   "(or use AsyncGenerationClient for concurrent requests)")
            self._grpc_busy = True  # taken now, given back when the stream ends or is closed
        tracker = Tracker()
        current: dict[str, Any] = {"cancel": lambda: None, "holds": o.protocol == "grpc"}

        def release() -> None:
            # Once per stream: a stream closed late must not free the slot of a newer one.
            if current.pop("holds", False):
                self._grpc_busy = False

        def cancel() -> None:
            try:
                current["cancel"]()
            finally:
                release()

        def first_response(url: str, timeout_s: float | None) -> tuple[Iterator[Piece], Piece | None]:
            # One attempt: open the request and wait for its first response; until then a
            # failure may be retried (elsewhere), after it the stream is the caller's.
            if o.protocol == "http":
                pieces, cancel = self._http_stream(request, url, timeout_s)
            else:
                pieces, cancel = self._grpc_stream(request, stream, url, timeout_s)
            current["cancel"] = cancel
            try:
                return pieces, next(pieces)
            except StopIteration:
                return pieces, None

        def resilient() -> Iterator[Piece]:
            try:
                try:
                    pieces, first = self.retrier.call(first_response, o.timeout_s)
                except RetryError as exc:
                    raise transport_error(exc, o.protocol, o.url, o.model, o.timeout_s) from exc
                try:
                    if first is not None:
                        yield first
                        yield from pieces
                finally:
                    pieces.close()  # type: ignore[attr-defined]
            finally:
                release()

        return TextStream(resilient(), tracker, cancel)

    # gRPC: one bidirectional stream per request; responses reach a queue from tritonclient's thread.
    def _grpc_stream(self, request: GenerateRequest, stream: bool, url: str | None = None,
                     first_timeout_s: float | None = None):
        o = self.options
        url = url or o.url
        if url not in self._grpcs:
            self._grpcs[url] = transport("grpc").InferenceServerClient(url)
        client = self._grpcs[url]
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        state = {"open": True}

        def stop(cancel: bool) -> None:
            if state["open"]:
                state["open"] = False
                if not cancel:
                    client.stop_stream(cancel_requests=False)
                    return
                # Cancelling (Ctrl-C, close() mid-stream) must not hang the caller: tritonclient's
                # stop_stream joins its stream thread, which can wait on a call gRPC is still
                # tearing down. Bounded here; a client whose stream did not stop is replaced.
                stopper = threading.Thread(target=client.stop_stream, kwargs={"cancel_requests": True},
                                           name="generation-stream-stop", daemon=True)
                stopper.start()
                stopper.join(STOP_TIMEOUT_S)
                if stopper.is_alive():
                    log.warning("generate: the cancelled gRPC stream did not stop within %.0f s; "
                                "using a new connection", STOP_TIMEOUT_S)
                    if self._grpcs.get(url) is client:
                        del self._grpcs[url]

        def pieces() -> Iterator[Piece]:
            request_id = _request_id()
            log.debug("generate: %s %s via grpc %s", o.model, request_id, url)
            wait = first_timeout_s if first_timeout_s is not None else o.timeout_s
            try:
                try:
                    client.async_stream_infer(o.model, request.grpc_inputs(stream), model_version=o.model_version,
                                              request_id=request_id, enable_empty_final_response=True)
                except InferenceServerException:
                    # A stream that failed at once (server unreachable) refuses the request; the
                    # reason is the error its callback received, if it came.
                    try:
                        _, error = responses.get(timeout=1.0)
                    except queue.Empty:
                        raise
                    if error is None:
                        raise
                    raise error from None
                while True:
                    try:
                        result, error = responses.get(timeout=wait)
                    except queue.Empty:
                        raise TimeoutError from None
                    wait = o.timeout_s
                    if error is not None:
                        raise error
                    yield piece_from_result(result)
                    if is_final(result):
                        stop(cancel=False)
                        return
            except (InferenceServerException, OSError, TimeoutError) as exc:
                stop(cancel=True)
                raise transport_error(exc, "grpc", url, o.model, o.timeout_s) from exc

        return pieces(), lambda: stop(cancel=True)

    # HTTP: one connection per request, closed to cancel it.
    def _http_connection(self, url: str | None = None, timeout_s: float | None = None) -> http.client.HTTPConnection:
        host, port = self.options.host_port(url)
        return http.client.HTTPConnection(host, port, timeout=timeout_s if timeout_s is not None else self.options.timeout_s)

    def _http_post(self, conn: http.client.HTTPConnection, request: GenerateRequest, stream: bool) -> http.client.HTTPResponse:
        o = self.options
        log.debug("generate: %s via http %s:%s%s", o.model, conn.host, conn.port, o.http_path(stream))
        conn.request("POST", o.http_path(stream), body=request.http_body(stream),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream" if stream else "application/json"})
        return conn.getresponse()

    def _http_failure(self, response: http.client.HTTPResponse) -> GenerationError:
        body = response.read().decode("utf-8", "replace")
        return http_error(response.status, body, self.options.model)

    def _http_whole(self, request: GenerateRequest, url: str | None = None, timeout_s: float | None = None) -> Generation:
        o = self.options
        url = url or o.url
        tracker = Tracker()
        conn = self._http_connection(url, timeout_s)
        try:
            response = self._http_post(conn, request, stream=False)
            if response.status != 200:
                raise self._http_failure(response)
            tracker.add(piece_from_json(response.read().decode("utf-8", "replace"), o.model))
        except (OSError, http.client.HTTPException) as exc:
            raise transport_error(exc, "http", url, o.model, o.timeout_s) from exc
        finally:
            conn.close()
        generation = tracker.result()
        # One response: its arrival is the first token.
        return replace(generation, time_to_first_token_s=generation.total_time_s if generation.text else None)

    def _http_stream(self, request: GenerateRequest, url: str | None = None, first_timeout_s: float | None = None):
        o = self.options
        url = url or o.url
        conn = self._http_connection(url, first_timeout_s)

        def pieces() -> Iterator[Piece]:
            try:
                response = self._http_post(conn, request, stream=True)
                if response.status != 200:
                    raise self._http_failure(response)
                if conn.sock is not None and first_timeout_s is not None:
                    conn.sock.settimeout(o.timeout_s)  # the first response's wait was the attempt's
                decoder = SSEDecoder()
                while True:
                    chunk = response.read1(65536)
                    events = decoder.feed(chunk) if chunk else decoder.close()
                    for event in events:
                        yield piece_from_json(event, o.model)
                    if not chunk:
                        return
            except (OSError, http.client.HTTPException) as exc:
                raise transport_error(exc, "http", url, o.model, o.timeout_s) from exc
            finally:
                conn.close()

        return pieces(), conn.close

    def close(self) -> None:
        """Close the connections; the client cannot be used afterwards."""
        self._closed = True
        clients, self._grpcs = self._grpcs, {}
        for client in clients.values():
            client.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        o = self.options
        return f"GenerationClient({o.protocol}://{','.join(o.urls)}, model={o.model!r})"


def http_error(status: int, body: str, model: str = DEFAULT_MODEL) -> GenerationError:
    """A non-200 generate response as a GenerationError: its ``error`` field (a JSON body or an
    SSE event), else the body itself."""
    decoder = SSEDecoder()
    candidates = decoder.feed(body.encode("utf-8")) + decoder.close() if body.lstrip().startswith("data:") else [body]
    for candidate in candidates:
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, Mapping) and "error" in obj:
            return GenerationError(str(obj["error"]), model=model, status=str(status))
    return GenerationError(body.strip()[:500] or f"HTTP {status}", model=model, status=str(status))


def generate(prompt: str, url: str | None = None, protocol: Protocol = "grpc", **sampling: Any) -> Generation:
    """Complete ``prompt`` with a one-off client; the whole answer."""
    with GenerationClient(url, protocol) as client:
        return client.generate(prompt, **sampling)


def chat(messages: str | Sequence[Mapping[str, str]], system: str | None = None, url: str | None = None,
         protocol: Protocol = "grpc", **sampling: Any) -> Generation:
    """Answer a chat with a one-off client; the whole answer."""
    with GenerationClient(url, protocol) as client:
        return client.chat(messages, system, **sampling)


# --- asyncio -------------------------------------------------------------------------------


class AsyncTextStream(AsyncIterator[str]):
    """The asyncio twin of TextStream: ``async for piece in stream``; ``await aclose()`` (or
    ``async with``) before the end cancels the request; ``result`` after the end."""

    def __init__(self, pieces: AsyncIterator[Piece], tracker: Tracker, cancel):
        self._pieces = pieces
        self._tracker = tracker
        self._cancel = cancel
        self.result: Generation | None = None
        self._done = False

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
        if self._done:
            raise StopAsyncIteration
        try:
            while True:
                piece = await self._pieces.__anext__()
                text = self._tracker.add(piece)
                if text:
                    return text
        except StopAsyncIteration:
            self._done = True
            self.result = self._tracker.result()
            raise
        except BaseException:
            await self.aclose()
            raise

    @property
    def text(self) -> str:
        return "".join(self._tracker.parts)

    async def aclose(self) -> None:
        """Stop reading; a request still running is cancelled on the server."""
        if not self._done:
            self._done = True
            await self._cancel()
            await self._pieces.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncGenerationClient:
    """asyncio client for ``text_generation``: gRPC (grpc.aio streams) or HTTP (aiohttp).

    Many requests may run at once on one client (each gRPC request is its own call, each HTTP
    stream its own connection of a shared session), which is how the server's continuous
    batching gets its batch. The connections open on first use inside the running loop.
    Failover and retries before the first response: as ``GenerationClient``.
    """

    def __init__(self, url: str | Sequence[str] | None = None, protocol: Protocol = "grpc", model: str = DEFAULT_MODEL,
                 model_version: str = "", timeout_s: float | None = None, *, retries: int | None = None,
                 deadline_s: float | None = None, policy: RetryPolicy | None = None, pool: EndpointPool | None = None):
        self.options = GenerationOptions.create(url, protocol, model, model_version, timeout_s, retries, deadline_s)
        o = self.options
        self.retrier = make_retrier(o.urls, o.timeout_s, o.retries, o.deadline_s, policy, pool)
        self._clients: dict[str, Any] = {}
        self._closed = False

    async def generate(self, prompt: str, **sampling: Any) -> Generation:
        return await self._whole(GenerateRequest.prompt(prompt, **sampling))

    def stream(self, prompt: str, **sampling: Any) -> AsyncTextStream:
        return self._stream(GenerateRequest.prompt(prompt, **sampling), stream=True)

    async def chat(self, messages: str | Sequence[Mapping[str, str]], system: str | None = None, **sampling: Any) -> Generation:
        return await self._whole(GenerateRequest.from_chat(messages, system, **sampling))

    def chat_stream(self, messages: str | Sequence[Mapping[str, str]], system: str | None = None, **sampling: Any) -> AsyncTextStream:
        return self._stream(GenerateRequest.from_chat(messages, system, **sampling), stream=True)

    async def _whole(self, request: GenerateRequest) -> Generation:
        # HTTP uses /generate (one JSON object); gRPC one request with stream false.
        async with self._stream(request, stream=False) as pieces:
            async for _ in pieces:
                pass
        assert pieces.result is not None
        result = pieces.result
        if self.options.protocol == "http" and result.text:
            result = replace(result, time_to_first_token_s=result.total_time_s)
        return result

    def _connection(self, url: str | None = None) -> Any:
        if self._closed:
            raise RuntimeError("AsyncGenerationClient is closed")
        url = url or self.options.url
        if url not in self._clients:
            if self.options.protocol == "grpc":
                self._clients[url] = transport("grpc", aio=True).InferenceServerClient(url)
            else:
                import aiohttp

                self._clients[url] = aiohttp.ClientSession(f"http://{url}")
        return self._clients[url]

    def _stream(self, request: GenerateRequest, stream: bool) -> AsyncTextStream:
        self._connection()  # a closed client refuses at once
        o = self.options
        tracker = Tracker()
        current: dict[str, Any] = {}

        async def first_response(url: str, timeout_s: float | None) -> tuple[AsyncIterator[Piece], Piece | None]:
            # One attempt: open the request, wait for its first response (retried until then).
            client = self._connection(url)
            if o.protocol == "grpc":
                pieces, cancel = self._grpc_stream(client, request, stream, url, timeout_s)
            else:
                pieces, cancel = self._http_stream(client, request, stream, url, timeout_s)
            current["cancel"] = cancel
            try:
                return pieces, await pieces.__anext__()
            except StopAsyncIteration:
                return pieces, None
            except BaseException:
                # A cancelled or timed-out attempt must not leave its call open.
                await cancel()
                await pieces.aclose()  # type: ignore[attr-defined]
                raise

        async def resilient() -> AsyncIterator[Piece]:
            try:
                pieces, first = await self.retrier.acall(first_response, o.timeout_s)
            except RetryError as exc:
                raise transport_error(exc, o.protocol, o.url, o.model, o.timeout_s) from exc
            try:
                if first is not None:
                    yield first
                    async for piece in pieces:
                        yield piece
            finally:
                await pieces.aclose()  # type: ignore[attr-defined]

        async def cancel() -> None:
            if "cancel" in current:
                await current["cancel"]()

        return AsyncTextStream(resilient(), tracker, cancel)

    def _grpc_stream(self, client: Any, request: GenerateRequest, stream: bool, url: str | None = None,
                     first_timeout_s: float | None = None):
        import grpc
        from tritonclient.grpc._utils import get_error_grpc

        o = self.options
        url = url or o.url
        call: dict[str, Any] = {}

        async def requests():
            yield {"model_name": o.model, "inputs": request.grpc_inputs(stream), "model_version": o.model_version,
                   "request_id": _request_id(), "parameters": {"triton_enable_empty_final_response": True}}

        async def pieces() -> AsyncIterator[Piece]:
            log.debug("generate: %s via grpc.aio %s", o.model, url)
            iterator = client.stream_infer(requests())
            call["it"] = iterator
            wait = first_timeout_s if first_timeout_s is not None else o.timeout_s
            try:
                while True:
                    try:
                        result, error = await asyncio.wait_for(iterator.__anext__(), wait)
                    except StopAsyncIteration:
                        return
                    wait = o.timeout_s
                    if error is not None:
                        raise error
                    yield piece_from_result(result)
                    if is_final(result):
                        return
            except grpc.RpcError as exc:  # the call itself failed (server down, cancelled)
                raise transport_error(get_error_grpc(exc), "grpc", url, o.model, o.timeout_s) from exc
            except (TimeoutError, InferenceServerException, OSError) as exc:
                iterator.cancel()
                raise transport_error(exc, "grpc", url, o.model, o.timeout_s) from exc

        async def cancel() -> None:
            if "it" in call:
                call["it"].cancel()

        return pieces(), cancel

    def _http_stream(self, session: Any, request: GenerateRequest, stream: bool, url: str | None = None,
                     first_timeout_s: float | None = None):
        import aiohttp

        o = self.options
        url = url or o.url
        held: dict[str, Any] = {}

        async def pieces() -> AsyncIterator[Piece]:
            log.debug("generate: %s via aiohttp %s%s", o.model, url, o.http_path(stream))
            connect = first_timeout_s if first_timeout_s is not None else o.timeout_s
            timeout = aiohttp.ClientTimeout(total=None, sock_read=o.timeout_s, sock_connect=connect)
            try:
                response = await session.post(o.http_path(stream), data=request.http_body(stream), timeout=timeout,
                                              headers={"Content-Type": "application/json"})
                held["response"] = response
                try:
                    if response.status != 200:
                        raise http_error(response.status, (await response.read()).decode("utf-8", "replace"), o.model)
                    if not stream:
                        yield piece_from_json((await response.read()).decode("utf-8", "replace"), o.model)
                        return
                    decoder = SSEDecoder()
                    async for chunk in response.content.iter_any():
                        for event in decoder.feed(chunk):
                            yield piece_from_json(event, o.model)
                    for event in decoder.close():
                        yield piece_from_json(event, o.model)
                finally:
                    response.release()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise transport_error(exc, "http", url, o.model, o.timeout_s) from exc

        async def cancel() -> None:
            # close(), not release(): the connection must drop for the server to cancel.
            if "response" in held:
                held["response"].close()

        return pieces(), cancel

    async def close(self) -> None:
        """Close the connections; the client cannot be used afterwards."""
        self._closed = True
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        o = self.options
        return f"AsyncGenerationClient({o.protocol}://{','.join(o.urls)}, model={o.model!r})"
