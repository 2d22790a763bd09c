"""Synchronous client for the ``text_embedding`` ensemble (TEXT -> EMBEDDING).

The server takes requests of at most ``max_batch_size`` (64) texts, each an UTF-8 byte
string in a ``[n, 1]`` BYTES tensor, and returns L2-normalised FP32 embeddings ``[n, 384]``.
``EmbeddingClient.embed`` hides that: it takes any number of texts, splits them into
requests, and returns one float32 array in input order.

The pure helpers (``as_text_list``, ``split_batches``, ``encode_texts``,
``cosine_similarity_matrix``) are shared with the asyncio client and unit-tested without a
server.
"""

from __future__ import annotations

import http.client
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np
from tritonclient.utils import InferenceServerException

from clients.resilience import (
    EndpointPool,
    RetryError,
    RetryPolicy,
    describe,
    make_retrier,
    split_urls,
)
from contract.errors import parse_error, words_of
from contract.prose import tritonclient_undecodable

log = logging.getLogger(__name__)

Protocol = Literal["http", "grpc"]
Text = str | bytes

DEFAULT_MODEL = "text_embedding"
INPUT_NAME = "TEXT"
OUTPUT_NAME = "EMBEDDING"
# max_batch_size of model_repository/text_embedding/config.pbtxt; a bigger request is refused.
MAX_BATCH_SIZE = 64
DEFAULT_URLS: dict[str, str] = {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}
PROTOCOLS: tuple[Protocol, ...] = ("http", "grpc")
TRUNCATIONS = (None, "right", "left")  # ClientOptions.truncation


class EmbeddingError(RuntimeError):
    """A request to the embedding model failed.

    ``server_message`` is the server's (or transport's) own message, e.g.
    ``"in ensemble 'text_embedding', TEXT[1]: text is empty"``; the index in it counts from
    the start of the failed request, which covers ``texts[start:stop]`` of the caller's list.
    ``status`` is the HTTP status or gRPC status code when there is one. ``attempts`` is how
    many attempts the call made when it gave up on retrying (None: it failed on the first
    answer that is not worth retrying, e.g. INVALID_ARG).
    """

    def __init__(
        self,
        server_message: str,
        *,
        model: str = "",
        status: str | None = None,
        start: int | None = None,
        stop: int | None = None,
        total: int | None = None,
        retry_note: str = "",
        attempts: int | None = None,
    ):
        data = parse_error(server_message)  # the model's error data (contract/errors.py)
        self.server_message = words_of(server_message)
        self.code = data.code if data else None
        self.field = data.field if data else None
        self.values = data.values if data else {}
        self.model = model
        self.status = status
        self.start = start
        self.stop = stop
        self.attempts = attempts
        where = f"model '{model}'" if model else "embedding request"
        # Name the slice only when the call was split: otherwise it is simply "the texts".
        if start is not None and stop is not None and (start, stop) != (0, total):
            where += f", texts[{start}:{stop}]"
        code = f" [{status}]" if status else ""
        note = f"; {retry_note}" if retry_note else ""
        super().__init__(f"{where}{code}: {self.server_message}{note}")


def parse_urls(url: str | Sequence[str] | None, protocol: str) -> tuple[str, ...]:
    """One URL, a comma-separated list or a list of them, as tritonclient's ``host:port``
    (a pasted ``http://host:port/`` is accepted); the protocol's default when none."""
    urls = split_urls(url) or [DEFAULT_URLS[protocol]]
    out = []
    for u in urls:
        if "://" in u:
            # tritonclient wants host:port; accept a pasted http://host:port anyway.
            scheme, _, rest = u.partition("://")
            if scheme not in ("http", "grpc"):
                raise ValueError(f"url {u!r}: only plain http/grpc (no TLS) is supported")
            u = rest
        u = u.rstrip("/")
        if not u:
            raise ValueError("url is empty")
        out.append(u)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class ClientOptions:
    """Validated options shared by the sync and asyncio clients.

    ``url`` is the first of ``urls``, the endpoints the client fails over across;
    ``retries`` (None: the default policy's) and ``deadline_s`` (None: ``timeout_s``) shape
    the retry policy (clients/resilience.py).
    """

    url: str
    protocol: Protocol = "http"
    model: str = DEFAULT_MODEL
    model_version: str = ""
    timeout_s: float | None = None
    priority: int = 0
    batch_size: int = MAX_BATCH_SIZE
    urls: tuple[str, ...] = ()
    retries: int | None = None
    deadline_s: float | None = None
    # None: a text over the model's 256 tokens is refused (the server's default); "right" keeps
    # its first tokens, "left" its last (TRUNCATE / TRUNCATION_DIRECTION, docs/embeddings.md).
    truncation: str | None = None

    @classmethod
    def create(
        cls,
        url: str | Sequence[str] | None = None,
        protocol: str = "http",
        model: str = DEFAULT_MODEL,
        model_version: str = "",
        timeout_s: float | None = None,
        priority: int = 0,
        batch_size: int = MAX_BATCH_SIZE,
        retries: int | None = None,
        deadline_s: float | None = None,
        truncation: str | None = None,
    ) -> ClientOptions:
        """Check the options and fill in the protocol's default URL; ValueError on bad ones."""
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be None (refuse texts over the limit), 'right' or 'left', not {truncation!r}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
        urls = parse_urls(url, protocol)
        if not model:
            raise ValueError("model name is empty")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, not {timeout_s}")
        if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
            raise ValueError(f"priority must be an int >= 0 (0 = the model's default, 1 = highest), not {priority!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be an int in 1..{MAX_BATCH_SIZE} (the model's max_batch_size), not {batch_size!r}")
        RetryPolicy.create(retries, deadline_s)  # the same checks the client's policy makes
        return cls(
            urls[0],
            protocol,
            model,
            str(model_version),
            timeout_s,
            priority,
            batch_size,
            urls,
            retries,
            deadline_s,
            truncation,
        )

    def infer_kwargs(self, attempt_timeout_s: float | None = None) -> dict[str, Any]:
        """Keyword arguments of tritonclient's ``infer`` for priority and timeout.

        Both are sent as Triton defines them, but the shipped configs have no priority levels
        and no queue policy (on tritonserver 2.51 either stalls the dynamic batcher: docs/
        performance.md), so the server ignores ``priority`` and the ``timeout`` queue deadline
        today. The client-side deadline (``client_timeout`` for gRPC: ``attempt_timeout_s``,
        what is left of the call's deadline, else ``timeout_s``; the connection's network
        timeout for HTTP) always applies.
        """
        kwargs: dict[str, Any] = {"model_version": self.model_version, "priority": self.priority}
        if self.timeout_s is not None:
            kwargs["timeout"] = server_timeout_us(self.timeout_s)
        client_timeout = attempt_timeout_s if attempt_timeout_s is not None else self.timeout_s
        if self.protocol == "grpc" and client_timeout is not None:
            kwargs["client_timeout"] = client_timeout
        return kwargs


def server_timeout_us(timeout_s: float) -> int:
    """Seconds -> the integer microseconds of Triton's request ``timeout`` (at least 1)."""
    return max(1, round(timeout_s * 1_000_000))


def as_text_list(texts: Sequence[Text]) -> list[Text]:
    """Check the caller's texts and return them as a list.

    A bare ``str`` is refused (it would be embedded character by character), as are an
    empty list and items that are neither ``str`` nor ``bytes``. Empty or whitespace-only
    texts are left to the server, which refuses them with one error per request.
    """
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be a sequence of strings, not a single string; wrap it in a list")
    items = list(texts)
    if not items:
        raise ValueError("no texts to embed")
    for i, text in enumerate(items):
        if not isinstance(text, (str, bytes)):
            raise TypeError(f"texts[{i}] is {type(text).__name__}, expected str or bytes")
    return items


def split_batches(count: int, batch_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges that cover ``range(count)`` in order, each at most ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")
    return [(start, min(start + batch_size, count)) for start in range(0, count, batch_size)]


def encode_texts(texts: Sequence[Text]) -> np.ndarray:
    """The ``[n, 1]`` object array of UTF-8 bytes that the TEXT input takes.

    ``bytes`` pass unchanged. ``str`` is encoded with ``surrogateescape`` so that text read
    from a non-UTF-8 source with that handler reaches the server as its original bytes
    (and is refused there with the server's message) instead of failing here.
    """
    encoded = [t if isinstance(t, bytes) else t.encode("utf-8", "surrogateescape") for t in texts]
    array = np.empty((len(encoded), 1), dtype=object)
    array[:, 0] = encoded
    return array


def cosine_similarity_matrix(a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """Cosine similarity of every row of ``a`` with every row of ``b`` (default ``a``).

    Rows are normalised here, so the inputs need not be unit vectors; a zero row has
    similarity 0 with everything. 1-D inputs count as one row. Returns float32 ``[n, m]``.
    """
    a2 = _rows(a, "a")
    b2 = a2 if b is None else _rows(b, "b")
    if a2.shape[1] != b2.shape[1]:
        raise ValueError(f"dimension mismatch: a has {a2.shape[1]} columns, b has {b2.shape[1]}")
    an = _normalise(a2)
    bn = an if b is None else _normalise(b2)
    sim = an @ bn.T
    # Rounding can push identical unit vectors just past 1.
    return np.clip(sim, -1.0, 1.0).astype(np.float32)


def _rows(x: np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 1-D or 2-D, got shape {arr.shape}")
    return arr


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def transport(protocol: str, aio: bool = False) -> ModuleType:
    """The tritonclient module for a protocol, imported on first use (each pulls in gevent,
    grpc or aiohttp, which a caller of the other protocol need not pay for)."""
    if protocol == "http":
        if aio:
            import tritonclient.http.aio as module
        else:
            import tritonclient.http as module
    elif protocol == "grpc":
        if aio:
            import tritonclient.grpc.aio as module
        else:
            import tritonclient.grpc as module
    else:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
    return module


def build_request(options: ClientOptions, texts: Sequence[Text]) -> tuple[list[Any], list[Any]]:
    """The tritonclient (inputs, outputs) of one request for ``texts``."""
    # InferInput/InferRequestedOutput live in the sync modules; the aio clients reuse them.
    module = transport(options.protocol)
    data = encode_texts(texts)
    text_input = module.InferInput(INPUT_NAME, list(data.shape), "BYTES")
    text_input.set_data_from_numpy(data)
    inputs = [text_input]
    if options.truncation is not None:  # one choice per text, as the model takes it
        truncate = module.InferInput("TRUNCATE", list(data.shape), "BOOL")
        truncate.set_data_from_numpy(np.ones(data.shape, dtype=bool))
        direction = module.InferInput("TRUNCATION_DIRECTION", list(data.shape), "BYTES")
        direction.set_data_from_numpy(np.full(data.shape, options.truncation.encode("ascii"), dtype=object))
        inputs += [truncate, direction]
    return inputs, [module.InferRequestedOutput(OUTPUT_NAME)]


def read_embeddings(result: Any, expected_rows: int, options: ClientOptions) -> np.ndarray:
    """The EMBEDDING output of an InferResult as float32 ``[expected_rows, dim]``."""
    embeddings = result.as_numpy(OUTPUT_NAME)
    if embeddings is None:
        raise EmbeddingError(f"the response has no {OUTPUT_NAME} output", model=options.model)
    if embeddings.ndim != 2 or embeddings.shape[0] != expected_rows:
        raise EmbeddingError(
            f"expected {OUTPUT_NAME} with {expected_rows} rows, got shape {list(embeddings.shape)}",
            model=options.model,
        )
    return embeddings.astype(np.float32, copy=False)


def to_embedding_error(
    exc: BaseException, options: ClientOptions, start: int, stop: int, total: int, *, url: str | None = None
) -> EmbeddingError:
    """Turn a tritonclient or transport exception into an EmbeddingError with the server's words.

    A RetryError (the retries ran out) gives its last error, noting the attempts and deadline.
    """
    where: dict[str, Any] = dict(model=options.model, start=start, stop=stop, total=total)
    url = url or options.url
    if isinstance(exc, RetryError):
        note = describe(exc.attempts, exc.elapsed_s, exc.deadline_s, exc.reason)
        if exc.last is None:
            return EmbeddingError(
                f"no endpoint of {', '.join(options.urls)} available", retry_note=note, attempts=exc.attempts, **where
            )
        last = to_embedding_error(exc.last, options, start, stop, total)
        return EmbeddingError(last.server_message, status=last.status, retry_note=note, attempts=exc.attempts, **where)
    if isinstance(exc, EmbeddingError):
        return EmbeddingError(exc.server_message, status=exc.status, **where)
    if isinstance(exc, InferenceServerException):
        message = exc.message() or str(exc)
        status = exc.status()
        if status in ("502", "503", "504") and tritonclient_undecodable(message):
            # Not Triton's JSON error: a proxy (the front door) whose upstream is down or restarting.
            message = f"the http server at {url} answered {status} without a Triton error (is tritonserver behind it down?)"
        elif status == "StatusCode.UNAVAILABLE":
            message = f"cannot reach the grpc server at {url}: {message}"
        elif status == "StatusCode.DEADLINE_EXCEEDED":
            message = f"no answer from the grpc server at {url} within {options.timeout_s} s: {message}"
        return EmbeddingError(message, status=status, **where)
    if isinstance(exc, TimeoutError):
        return EmbeddingError(
            f"no answer from the {options.protocol} server at {url} within {options.timeout_s} s",
            **where,
        )
    return EmbeddingError(f"cannot reach the {options.protocol} server at {url}: {exc}", **where)


# What a failed request raises on either transport (socket errors, tritonclient's, a response
# cut short): mapped to EmbeddingError, then retried or not by clients.resilience.
SYNC_FAILURES: tuple[type[BaseException], ...] = (InferenceServerException, OSError, EmbeddingError, http.client.HTTPException)


class EmbeddingClient:
    """Blocking client for the text-embedding model over HTTP or gRPC.

    One request per ``batch_size`` texts, sent one after the other; for many concurrent
    requests use ``clients.aio.AsyncEmbeddingClient``. Not thread-safe: use one client per
    thread. Use as a context manager or call ``close()``.

    ``url`` may name several equivalent servers (a list or ``"a:8000,b:8000"``): requests go
    round-robin, skipping an endpoint whose circuit breaker is open. A request that fails
    with UNAVAILABLE (or a dropped connection) is retried with backoff, on another endpoint
    when there is one, within ``deadline_s`` (default ``timeout_s``); ``retries`` retries at
    most (default 3). ``policy`` and ``pool`` (clients.resilience) replace those defaults;
    ``retrier.stats()`` counts retries and each endpoint's attempts and breaker moves.
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

    def _connection(self, url: str) -> Any:
        client = self._clients.get(url)
        if client is None:
            module = transport(self.options.protocol)
            timeout_s = self.options.timeout_s
            if self.options.protocol == "http":
                # The HTTP client has no per-request deadline; its socket timeouts are the bound.
                kwargs = {} if timeout_s is None else {"connection_timeout": timeout_s, "network_timeout": timeout_s}
                client = module.InferenceServerClient(url, **kwargs)
            else:
                client = module.InferenceServerClient(url)
            self._clients[url] = client
        return client

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
        if self._closed:
            raise RuntimeError("EmbeddingClient is closed")
        items = as_text_list(texts)
        o = self.options
        parts = []
        for start, stop in split_batches(len(items), o.batch_size):
            inputs, outputs = build_request(o, items[start:stop])

            def attempt(
                url: str,
                timeout_s: float | None,
                start: int = start,
                stop: int = stop,
                inputs: list = inputs,
                outputs: list = outputs,
            ) -> np.ndarray:
                log.debug("embed: %s texts[%d:%d] via %s %s", o.model, start, stop, o.protocol, url)
                try:
                    result = self._connection(url).infer(o.model, inputs, outputs=outputs, **o.infer_kwargs(timeout_s))
                    return read_embeddings(result, stop - start, o)
                except SYNC_FAILURES as exc:
                    raise to_embedding_error(exc, o, start, stop, len(items), url=url) from exc

            try:
                parts.append(self.retrier.call(attempt, o.timeout_s))
            except RetryError as exc:
                raise to_embedding_error(exc, o, start, stop, len(items)) from exc
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def close(self) -> None:
        """Close the connection; the client cannot be used afterwards."""
        if not self._closed:
            self._closed = True
            clients, self._clients = self._clients, {}
            for client in clients.values():
                client.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        o = self.options
        return f"EmbeddingClient({o.protocol}://{','.join(o.urls)}, model={o.model!r}, priority={o.priority})"


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
