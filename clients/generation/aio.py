"""The asyncio client: ``AsyncGenerationClient`` (many requests at once on one client) and its
``AsyncTextStream``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from typing import Any

from clients.generation import grpc_transport, http_transport
from clients.generation.client import GenerationBase, StreamBase
from clients.generation.request import GenerateRequest
from clients.generation.response import Generation, Piece, Tracker, transport_error
from clients.resilience import RetryError
from clients.transport import AsyncClient, triton_client


class AsyncTextStream(StreamBase[AsyncIterator[Piece]], AsyncIterator[str]):
    """The asyncio twin of TextStream: ``async for piece in stream``; ``await aclose()`` (or
    ``async with``) before the end cancels the request; ``result`` after the end."""

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


class AsyncGenerationClient(GenerationBase[Coroutine[Any, Any, Generation], AsyncTextStream], AsyncClient):
    """asyncio client for ``text_generation``: gRPC (grpc.aio streams) or HTTP (aiohttp).

    Many requests may run at once on one client (each gRPC request is its own call, each HTTP
    stream its own connection of a shared session), which is how the server's continuous
    batching gets its batch. The connections open on first use inside the running loop.
    Failover and retries before the first response: as ``GenerationClient``. The options and
    calls: GenerationBase's (``generate`` and ``chat`` return the coroutine to await).
    """

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

    def _open(self, url: str) -> Any:
        # Opened inside the running loop: aiohttp's session belongs to the loop it is made in.
        if self.options.protocol == "grpc":
            return triton_client("grpc", url, aio=True)
        import aiohttp

        return aiohttp.ClientSession(f"http://{url}")

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
                await pieces.aclose()
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

    # One attempt on one endpoint per protocol (grpc_transport.py, http_transport.py).
    def _grpc_stream(
        self, client: Any, request: GenerateRequest, stream: bool, url: str | None = None, first_timeout_s: float | None = None
    ):
        return grpc_transport.grpc_aio_stream(self.options, client, request, stream, url, first_timeout_s)

    def _http_stream(
        self, session: Any, request: GenerateRequest, stream: bool, url: str | None = None, first_timeout_s: float | None = None
    ):
        return http_transport.http_aio_stream(self.options, session, request, stream, url, first_timeout_s)
