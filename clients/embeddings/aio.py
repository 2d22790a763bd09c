"""asyncio client for the ``text_embedding`` ensemble, for many concurrent requests.

Triton's dynamic batchers form batches out of concurrent requests, so many small requests
in flight (``embed_many(per_request=1)``) batch on the server as well as one big request
does, and a bad text then fails only its own request. What it sends, reads and raises is
clients/embeddings/core.py's, as for the blocking client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np

from clients.embeddings.client import EmbeddingBase
from clients.embeddings.core import MAX_BATCH_SIZE, EmbeddingError, EmbeddingRequest, Text, as_text_list, split_batches
from clients.transport import AsyncClient, triton_client

DEFAULT_CONCURRENCY = 16


class AsyncEmbeddingClient(EmbeddingBase, AsyncClient):
    """asyncio client for the text-embedding model over HTTP (aiohttp) or gRPC (grpc.aio).

    Same options as ``clients.EmbeddingClient``, retries and failover included (each attempt
    is also cut at what is left of the deadline). The connections are opened on first use
    inside the running event loop; use ``async with`` or ``await close()``.
    """

    def _open(self, url: str) -> Any:
        # Created lazily: aiohttp's session must be made inside the event loop it runs on.
        return triton_client(self.options.protocol, url, self.options.timeout_s, aio=True)

    @property
    def _client(self) -> Any:
        """The first endpoint's connection, None before first use (tests put a fake here)."""
        return self._clients.get(self.options.url)

    @_client.setter
    def _client(self, client: Any) -> None:
        self._clients[self.options.url] = client

    async def _request(self, items: list[Text], start: int, stop: int) -> np.ndarray:
        request = EmbeddingRequest(self.options, items, start, stop, self._failures)

        async def attempt(url: str, timeout_s: float | None) -> np.ndarray:
            with request.failures(url):
                return request.read(await request.send(self._connection(url), url, timeout_s))

        with request.gave_up():
            # gRPC cuts the attempt itself (client_timeout); aiohttp's timeout is the session's.
            return await self.retrier.acall(attempt, self.options.timeout_s, cut=self.options.protocol != "grpc")

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
