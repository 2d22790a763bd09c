"""asyncio client for the ``text_embedding`` ensemble, for many concurrent requests.

Triton's dynamic batchers form batches out of concurrent requests, so many small requests
in flight (``embed_many(per_request=1)``) batch on the server as well as one big request
does, and a bad text then fails only its own request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
from tritonclient.utils import InferenceServerException

from clients.embed import (
    DEFAULT_MODEL,
    MAX_BATCH_SIZE,
    ClientOptions,
    EmbeddingError,
    Protocol,
    Text,
    as_text_list,
    build_request,
    read_embeddings,
    split_batches,
    to_embedding_error,
    transport,
)
from clients.resilience import EndpointPool, RetryError, RetryPolicy, make_retrier

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 16


def _request_failures(protocol: str) -> tuple[type[BaseException], ...]:
    """The exceptions that mean "this request failed" rather than a bug in the caller."""
    failures: tuple[type[BaseException], ...] = (InferenceServerException, EmbeddingError, OSError, asyncio.TimeoutError)
    if protocol == "http":
        # A refused or dropped connection surfaces as aiohttp's own errors; aiohttp comes
        # with tritonclient's HTTP extra, so it is imported only for that protocol.
        import aiohttp

        failures += (aiohttp.ClientError,)
    return failures


class AsyncEmbeddingClient:
    """asyncio client for the text-embedding model over HTTP (aiohttp) or gRPC (grpc.aio).

    Same options as ``clients.EmbeddingClient``, retries and failover included (each attempt
    is also cut at what is left of the deadline). The connections are opened on first use
    inside the running event loop; use ``async with`` or ``await close()``.
    """

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        protocol: Protocol = "http",
        model: str = DEFAULT_MODEL,
        model_version: str = "",
        timeout_s: float | None = None,
        priority: int = 0,
        batch_size: int = MAX_BATCH_SIZE,
        *,
        retries: int | None = None,
        deadline_s: float | None = None,
        policy: RetryPolicy | None = None,
        pool: EndpointPool | None = None,
        truncation: str | None = None,
    ):
        self.options = ClientOptions.create(
            url, protocol, model, model_version, timeout_s, priority, batch_size, retries, deadline_s, truncation
        )
        o = self.options
        self.retrier = make_retrier(o.urls, o.timeout_s, o.retries, o.deadline_s, policy, pool)
        self._clients: dict[str, Any] = {}
        self._closed = False
        self._failures = _request_failures(self.options.protocol)

    def _connection(self, url: str) -> Any:
        # Created lazily: aiohttp's session must be made inside the event loop it runs on.
        if self._closed:
            raise RuntimeError("AsyncEmbeddingClient is closed")
        client = self._clients.get(url)
        if client is None:
            o = self.options
            module = transport(o.protocol, aio=True)
            if o.protocol == "http":
                # aiohttp's total timeout is the per-request bound; tritonclient's default is 60 s.
                kwargs = {} if o.timeout_s is None else {"conn_timeout": o.timeout_s}
                client = module.InferenceServerClient(url, **kwargs)
            else:
                client = module.InferenceServerClient(url)
            self._clients[url] = client
        return client

    @property
    def _client(self) -> Any:
        """The first endpoint's connection, None before first use (tests put a fake here)."""
        return self._clients.get(self.options.url)

    @_client.setter
    def _client(self, client: Any) -> None:
        self._clients[self.options.url] = client

    async def _request(self, items: list[Text], start: int, stop: int) -> np.ndarray:
        o = self.options
        inputs, outputs = build_request(o, items[start:stop])

        async def attempt(url: str, timeout_s: float | None) -> np.ndarray:
            client = self._connection(url)
            log.debug("embed: %s texts[%d:%d] via %s %s", o.model, start, stop, o.protocol, url)
            try:
                result = await client.infer(o.model, inputs, outputs=outputs, **o.infer_kwargs(timeout_s))
                return read_embeddings(result, stop - start, o)
            except self._failures as exc:
                raise to_embedding_error(exc, o, start, stop, len(items), url=url) from exc

        try:
            # gRPC cuts the attempt itself (client_timeout); aiohttp's timeout is the session's.
            return await self.retrier.acall(attempt, o.timeout_s, cut=o.protocol != "grpc")
        except RetryError as exc:
            raise to_embedding_error(exc, o, start, stop, len(items)) from exc

    async def embed(self, texts: Sequence[Text], concurrency: int = DEFAULT_CONCURRENCY) -> np.ndarray:
        """Embed ``texts`` in requests of ``batch_size``, up to ``concurrency`` at a time.

        Returns float32 ``[len(texts), dim]`` in input order; raises EmbeddingError on the
        first failed request (the others are cancelled).
        """
        return await self.embed_many(texts, concurrency=concurrency, per_request=self.options.batch_size)

    @overload
    async def embed_many(
        self,
        texts: Sequence[Text],
        concurrency: int = ...,
        per_request: int = ...,
        return_exceptions: Literal[False] = ...,
    ) -> np.ndarray: ...

    @overload
    async def embed_many(
        self,
        texts: Sequence[Text],
        concurrency: int = ...,
        per_request: int = ...,
        *,
        return_exceptions: Literal[True],
    ) -> list[np.ndarray | EmbeddingError]: ...

    async def embed_many(
        self,
        texts: Sequence[Text],
        concurrency: int = DEFAULT_CONCURRENCY,
        per_request: int = 1,
        return_exceptions: bool = False,
    ) -> np.ndarray | list[np.ndarray | EmbeddingError]:
        """Embed ``texts`` as many concurrent requests of ``per_request`` texts each.

        At most ``concurrency`` requests are in flight. Results are in input order.

        With ``return_exceptions=False`` returns float32 ``[len(texts), dim]`` and raises the
        first EmbeddingError (cancelling the requests still running). With
        ``return_exceptions=True`` returns one item per text: its ``[dim]`` embedding, or the
        EmbeddingError of its request. The server fails a whole request for one bad text, so
        ``per_request=1`` confines a failure to that text.
        """
        items = as_text_list(texts)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, not {concurrency!r}")
        if isinstance(per_request, bool) or not isinstance(per_request, int) or not 1 <= per_request <= MAX_BATCH_SIZE:
            raise ValueError(
                f"per_request must be an int in 1..{MAX_BATCH_SIZE} (the model's max_batch_size), not {per_request!r}"
            )
        ranges = split_batches(len(items), per_request)
        gate = asyncio.Semaphore(concurrency)

        async def bounded(start: int, stop: int) -> np.ndarray:
            async with gate:
                return await self._request(items, start, stop)

        tasks = [asyncio.ensure_future(bounded(start, stop)) for start, stop in ranges]
        if not return_exceptions:
            try:
                parts = await asyncio.gather(*tasks)
            except BaseException:
                # Do not leave requests running for a result nobody will read.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        results: list[np.ndarray | EmbeddingError] = []
        for (start, stop), outcome in zip(ranges, outcomes):
            if isinstance(outcome, EmbeddingError):
                results.extend([outcome] * (stop - start))
            elif isinstance(outcome, BaseException):
                # Not a request failure but a bug or a cancellation: do not hide it.
                raise outcome
            else:
                results.extend(outcome)
        return results

    async def close(self) -> None:
        """Close the connection; the client cannot be used afterwards."""
        self._closed = True
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        o = self.options
        return f"AsyncEmbeddingClient({o.protocol}://{','.join(o.urls)}, model={o.model!r}, priority={o.priority})"
