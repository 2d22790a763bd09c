"""The blocking client: ``GenerationClient`` (one request at a time), its ``TextStream``, and
the one-off ``generate`` and ``chat``; and what the asyncio client (aio.py) shares with it,
written once: the constructor and the public calls (``GenerationBase``), a stream's state
(``StreamBase``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from clients.generation import grpc_transport, http_transport
from clients.generation.request import DEFAULT_MODEL, GenerateRequest, GenerationOptions
from clients.generation.response import Generation, Piece, Tracker, transport_error
from clients.resilience import EndpointPool, RetryError, RetryPolicy
from clients.transport import ClientBase, Protocol, SyncClient

W = TypeVar("W")  # a whole answer: Generation, or (asyncio) the coroutine that returns one
S = TypeVar("S")  # a stream: TextStream or AsyncTextStream
P = TypeVar("P")  # the pieces a stream reads: an iterator of Piece, blocking or asyncio


class StreamBase(Generic[P]):
    """The state of one streamed generation: its pieces, the Tracker that adds them up into
    ``result`` (after the last piece), and the call that cancels the request."""

    def __init__(self, pieces: P, tracker: Tracker, cancel: Callable[[], Any]):
        self._pieces = pieces
        self._tracker = tracker
        self._cancel = cancel
        self.result: Generation | None = None
        self._done = False

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._tracker.parts)


class GenerationBase(ClientBase, Generic[W, S]):
    """The constructor and the public calls of both generation clients. Each call builds its
    GenerateRequest here; the client's ``_whole`` and ``_stream`` send it, blocking or asyncio.
    Several URLs, ``retries``, ``deadline_s`` (which bounds the attempts until the first
    response), ``policy`` and ``pool``: as for ``clients.EmbeddingClient``."""

    options: GenerationOptions

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        protocol: Protocol = "grpc",
        model: str = DEFAULT_MODEL,
        model_version: str = "",
        timeout_s: float | None = None,
        *,
        retries: int | None = None,
        deadline_s: float | None = None,
        policy: RetryPolicy | None = None,
        pool: EndpointPool | None = None,
    ):
        options = GenerationOptions.create(
            url, protocol, model=model, model_version=model_version, timeout_s=timeout_s, retries=retries, deadline_s=deadline_s
        )
        super().__init__(options, policy, pool)

    # The public calls: prompts and chats, whole or streamed.
    def generate(self, prompt: str, **sampling: Any) -> W:
        """Complete ``prompt`` (no chat template) and return the whole answer."""
        return self._whole(GenerateRequest.prompt(prompt, **sampling))

    def stream(self, prompt: str, **sampling: Any) -> S:
        """Complete ``prompt``, yielding text pieces as the server produces them."""
        return self._stream(GenerateRequest.prompt(prompt, **sampling), stream=True)

    def chat(self, messages: str | Sequence[Mapping[str, str]], system: str | None = None, **sampling: Any) -> W:
        """Answer a chat (the model's template applied on the server); whole answer."""
        return self._whole(GenerateRequest.from_chat(messages, system, **sampling))

    def chat_stream(self, messages: str | Sequence[Mapping[str, str]], system: str | None = None, **sampling: Any) -> S:
        """Answer a chat, yielding text pieces as they arrive."""
        return self._stream(GenerateRequest.from_chat(messages, system, **sampling), stream=True)

    def _whole(self, request: GenerateRequest) -> W:
        raise NotImplementedError

    def _stream(self, request: GenerateRequest, stream: bool) -> S:
        raise NotImplementedError


class TextStream(StreamBase[Iterator[Piece]], Iterator[str]):
    """The text pieces of one streamed generation, as they arrive.

    Iterate it (or ``for piece in client.stream(...)``); after the last piece ``result``
    holds the Generation. ``close()`` before the end cancels the request on the server; a
    ``with`` block closes it. Raises GenerationError from the iteration when the request fails.
    """

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


class GenerationClient(GenerationBase[Generation, TextStream], SyncClient):
    """Blocking client for ``text_generation`` over gRPC (default) or HTTP.

    One request at a time per client (a gRPC client holds one stream); not thread-safe. Use as
    a context manager or call ``close()``. The options and calls: GenerationBase's.
    """

    _grpc_busy = False  # a gRPC stream is open (one at a time)

    def _whole(self, request: GenerateRequest) -> Generation:
        if self.options.protocol == "http":
            self._check_open()
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
        self._check_open()
        o = self.options
        if o.protocol == "grpc":
            if self._grpc_busy:
                raise RuntimeError(
                    "GenerationClient runs one gRPC stream at a time: close the previous stream first "
                    "(or use AsyncGenerationClient for concurrent requests)"
                )
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

    # One attempt on one endpoint per protocol (grpc_transport.py, http_transport.py).
    def _grpc_stream(self, request: GenerateRequest, stream: bool, url: str | None = None, first_timeout_s: float | None = None):
        return grpc_transport.grpc_stream(self._clients, self.options, request, stream, url, first_timeout_s)

    def _http_whole(self, request: GenerateRequest, url: str | None = None, timeout_s: float | None = None) -> Generation:
        return http_transport.http_whole(self.options, request, url, timeout_s)

    def _http_stream(self, request: GenerateRequest, url: str | None = None, first_timeout_s: float | None = None):
        return http_transport.http_stream(self.options, request, url, first_timeout_s)


def generate(prompt: str, url: str | None = None, protocol: Protocol = "grpc", **sampling: Any) -> Generation:
    """Complete ``prompt`` with a one-off client; the whole answer."""
    with GenerationClient(url, protocol) as client:
        return client.generate(prompt, **sampling)


def chat(
    messages: str | Sequence[Mapping[str, str]],
    system: str | None = None,
    url: str | None = None,
    protocol: Protocol = "grpc",
    **sampling: Any,
) -> Generation:
    """Answer a chat with a one-off client; the whole answer."""
    with GenerationClient(url, protocol) as client:
        return client.chat(messages, system, **sampling)
