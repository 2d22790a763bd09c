"""What comes back: pieces of text with their counts, the finished Generation, and failures
as GenerationError (the server's own words, its status, the retries made)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clients.errors import ClientError, translate
from clients.generation.request import DEFAULT_MODEL
from contract.errors import ErrorData, data_from_body


class GenerationError(ClientError):
    """A generation request failed.

    ``server_message`` is Triton's (or the transport's) own message; for bad input it names
    the field, e.g. ``"max_tokens: must be > 0, got 0"``. ``status`` is the HTTP status
    (``"400"``) or the gRPC status code, a stream error's included (the model's error data
    says it). The model's errors also come as data: ``code`` (``"invalid_value"``,
    ``"context_length_exceeded"``, ``"overloaded"``, ...), ``field`` and ``values`` (the limit
    and what was sent), contract/errors.py; None and {} for other failures.
    """

    def __init__(
        self,
        server_message: str,
        *,
        model: str = DEFAULT_MODEL,
        status: str | None = None,
        retry_note: str = "",
        attempts: int | None = None,
        data: ErrorData | None = None,
    ):
        super().__init__(
            server_message,
            where=f"model '{model}'",
            model=model,
            status=status,
            retry_note=retry_note,
            attempts=attempts,
            data=data,
        )


@dataclass(frozen=True)
class Generation:
    """A finished generation. Times are measured by the client, from sending the request."""

    text: str
    finish_reason: str | None  # "stop", "length", "abort", or None when the server did not say
    num_input_tokens: int | None
    num_output_tokens: int | None
    time_to_first_token_s: float | None  # None when no text came back
    total_time_s: float
    num_cached_tokens: int | None = None  # of the prompt's, found in the server's prefix cache
    # When asked (sampling logprobs=N): OpenAI's token objects, one per generated token.
    logprobs: list[dict] | None = None
    # When asked (sampling prompt_logprobs=N): one per prompt token, None for the first.
    prompt_logprobs: list[dict | None] | None = None

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
    num_cached_tokens: int | None = None
    logprobs: list[dict] | None = None  # OpenAI's token objects of this piece's text, when asked
    index: int = 0  # the choice this piece belongs to (sampling parameter n > 1)
    token_ids: tuple[int, ...] = ()  # the ids whose text this piece completes, when asked (return_token_ids)
    prompt_logprobs: list[dict | None] | None = None  # with the choice's first piece, when asked


def _logprobs(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    return json.loads(value) if isinstance(value, str) else list(value)


def _prompt_logprobs(value: Any) -> list[dict | None] | None:
    entries = _logprobs(value)
    return None if entries is None else list(entries)


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
        events: list[str] = []
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
    if "error" in obj:  # the data as the body's keys (the front door, the stream door), else after the words
        raise GenerationError(str(obj["error"]), model=model, status=status, data=data_from_body(obj))
    text = _scalar(obj.get("text_output"))
    return Piece(
        text="" if text is None else str(text),
        finish_reason=_reason(_scalar(obj.get("finish_reason"))),
        num_input_tokens=_count(_scalar(obj.get("num_input_tokens"))),
        num_output_tokens=_count(_scalar(obj.get("num_output_tokens"))),
        num_cached_tokens=_count(_scalar(obj.get("num_cached_tokens"))),
        logprobs=_logprobs(_scalar(obj.get("logprobs"))),
        index=_count(_scalar(obj.get("index"))) or 0,
        prompt_logprobs=_prompt_logprobs(_scalar(obj.get("prompt_logprobs"))),
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
        num_cached_tokens=_count(first("num_cached_tokens")),
        logprobs=_logprobs(first("logprobs")),
        index=_count(first("index")) or 0,
        token_ids=_ids(result.as_numpy("token_ids")),
        prompt_logprobs=_prompt_logprobs(first("prompt_logprobs")),
    )


def _ids(array: Any) -> tuple[int, ...]:
    return () if array is None else tuple(int(t) for t in array.reshape(-1).tolist())


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
        self.num_cached_tokens: int | None = None
        self.logprobs: list[dict] | None = None
        self.prompt_logprobs: list[dict | None] | None = None

    def add(self, piece: Piece) -> str:
        """Take one piece (its time if it is the first text); its text."""
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
        if piece.num_cached_tokens is not None:
            self.num_cached_tokens = piece.num_cached_tokens
        if piece.logprobs is not None:
            self.logprobs = (self.logprobs or []) + piece.logprobs
        if piece.prompt_logprobs is not None:
            self.prompt_logprobs = piece.prompt_logprobs
        return piece.text

    def result(self) -> Generation:
        """The Generation of the pieces so far, timed until now."""
        end = self._clock()
        return Generation(
            text="".join(self.parts),
            finish_reason=self.finish_reason,
            num_input_tokens=self.num_input_tokens,
            num_output_tokens=self.num_output_tokens,
            time_to_first_token_s=None if self.first is None else self.first - self.start,
            total_time_s=end - self.start,
            num_cached_tokens=self.num_cached_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


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
            return GenerationError(str(obj["error"]), model=model, status=str(status), data=data_from_body(obj))
    return GenerationError(body.strip()[:500] or f"HTTP {status}", model=model, status=str(status))


def transport_error(exc: BaseException, protocol: str, url: str, model: str, timeout_s: float | None) -> GenerationError:
    """A tritonclient, socket or aiohttp failure as a GenerationError with the server's words;
    a RetryError as its last error, noting the attempts and the deadline (clients/errors.py)."""

    def make(message: str, **kwargs: Any) -> GenerationError:
        return GenerationError(message, model=model, **kwargs)

    return translate(exc, make, protocol, url, timeout_s)
