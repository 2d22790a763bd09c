"""The blocking client of the ``text_embedding`` ensemble: ``EmbeddingClient`` and the one-off
``embed``. What it sends, reads and raises is clients/embeddings/core.py's, as for the asyncio
client."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from clients.embeddings.core import (
    DEFAULT_MODEL,
    MAX_BATCH_SIZE,
    ClientOptions,
    EmbeddingRequest,
    Protocol,
    Text,
    as_text_list,
    split_batches,
)
from clients.resilience import EndpointPool, RetryPolicy
from clients.transport import ClientBase, SyncClient, request_failures, triton_client


class EmbeddingBase(ClientBase):
    """The constructor and ``repr`` of both embedding clients."""

    options: ClientOptions

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
        options = ClientOptions.create(
            url,
            protocol,
            model=model,
            model_version=model_version,
            timeout_s=timeout_s,
            priority=priority,
            batch_size=batch_size,
            retries=retries,
            deadline_s=deadline_s,
            truncation=truncation,
        )
        super().__init__(options, policy, pool)
        self._failures = request_failures(options.protocol, self.aio)

    def _describe(self) -> str:
        return f"{super()._describe()}, priority={self.options.priority}"


class EmbeddingClient(EmbeddingBase, SyncClient):
    """Blocking client for the text-embedding model over HTTP or gRPC.

    One request per ``batch_size`` texts, sent one after the other; for many concurrent
    requests use ``clients.AsyncEmbeddingClient``. Not thread-safe: use one client per
    thread. Use as a context manager or call ``close()``.

    ``url`` may name several equivalent servers (a list or ``"a:8000,b:8000"``): requests go
    round-robin, skipping an endpoint whose circuit breaker is open. A request that fails
    with UNAVAILABLE (or a dropped connection) is retried with backoff, on another endpoint
    when there is one, within ``deadline_s`` (default ``timeout_s``); ``retries`` retries at
    most (default 3). ``policy`` and ``pool`` (clients.resilience) replace those defaults;
    ``retrier.stats()`` counts retries and each endpoint's attempts and breaker moves.
    """

    def _open(self, url: str) -> Any:
        return triton_client(self.options.protocol, url, self.options.timeout_s)

    @property
    def _client(self) -> Any:
        """The first endpoint's connection (tests replace it with a fake transport)."""
        return self._connection(self.options.url)

    @_client.setter
    def _client(self, client: Any) -> None:
        self._clients[self.options.url] = client

    def embed(self, texts: Sequence[Text]) -> np.ndarray:
        """Embed ``texts``; returns float32 ``[len(texts), dim]`` rows in input order.

        Raises EmbeddingError (with the server's message) when a request fails, ValueError
        or TypeError for an empty list or non-text items.
        """
        self._check_open()
        items = as_text_list(texts)
        parts = [self._request(items, start, stop) for start, stop in split_batches(len(items), self.options.batch_size)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def _request(self, items: list[Text], start: int, stop: int) -> np.ndarray:
        request = EmbeddingRequest(self.options, items, start, stop, self._failures)

        def attempt(url: str, timeout_s: float | None) -> np.ndarray:
            with request.failures(url):
                return request.read(request.send(self._connection(url), url, timeout_s))

        with request.gave_up():
            return self.retrier.call(attempt, self.options.timeout_s)


def embed(
    texts: Sequence[Text],
    *,
    url: str | Sequence[str] | None = None,
    protocol: Protocol = "http",
    model: str = DEFAULT_MODEL,
    model_version: str = "",
    timeout_s: float | None = None,
    priority: int = 0,
    batch_size: int = MAX_BATCH_SIZE,
    retries: int | None = None,
    deadline_s: float | None = None,
    truncation: str | None = None,
) -> np.ndarray:
    """Embed ``texts`` with a one-off EmbeddingClient (same options); float32 ``[n, dim]``."""
    with EmbeddingClient(
        url,
        protocol,
        model,
        model_version,
        timeout_s,
        priority,
        batch_size,
        retries=retries,
        deadline_s=deadline_s,
        truncation=truncation,
    ) as client:
        return client.embed(texts)
