"""What the sync and asyncio clients of the ``text_embedding`` ensemble (TEXT -> EMBEDDING)
share, written once: the options, the texts as the model takes them, one request's inputs, its
result read back, and failures as EmbeddingError.

The server takes requests of at most ``max_batch_size`` (64) texts, each an UTF-8 byte
string in a ``[n, 1]`` BYTES tensor, and returns L2-normalised FP32 embeddings ``[n, 384]``.
The clients hide that: they take any number of texts, split them into requests
(``split_batches``), and return one float32 array in input order. ``EmbeddingRequest`` is one
such request, what either client sends and reads back; the clients only add the blocking or
awaited call and the retries. The pure helpers are unit-tested without a server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from clients.errors import ClientError, translate
from clients.resilience import RetryError
from clients.transport import ConnectionOptions, Protocol, tritonclient_module
from contract.errors import ErrorData

log = logging.getLogger(__name__)

Text = str | bytes

DEFAULT_MODEL = "text_embedding"
INPUT_NAME = "TEXT"
OUTPUT_NAME = "EMBEDDING"
# max_batch_size of model_repository/text_embedding/config.pbtxt; a bigger request is refused.
MAX_BATCH_SIZE = 64
TRUNCATIONS = (None, "right", "left")  # ClientOptions.truncation


class EmbeddingError(ClientError):
    """A request to the embedding model failed.

    ``server_message`` is the server's (or transport's) own message, e.g.
    ``"in ensemble 'text_embedding', TEXT[1]: text is empty"``; the index in it counts from
    the start of the failed request, which covers ``texts[start:stop]`` of the caller's list.
    ``status`` is the HTTP status or gRPC status code when there is one. ``attempts`` is how
    many attempts the call made when it gave up on retrying (None: it failed on the first
    answer that is not worth retrying, e.g. INVALID_ARG). ``code``, ``field``, ``values``: the
    model's error data (clients/errors.py).
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
        data: ErrorData | None = None,
    ):
        self.start = start
        self.stop = stop
        where = f"model '{model}'" if model else "embedding request"
        # Name the slice only when the call was split: otherwise it is simply "the texts".
        if start is not None and stop is not None and (start, stop) != (0, total):
            where += f", texts[{start}:{stop}]"
        super().__init__(
            server_message, where=where, model=model, status=status, retry_note=retry_note, attempts=attempts, data=data
        )


@dataclass(frozen=True)
class ClientOptions(ConnectionOptions):
    """Validated options shared by the sync and asyncio clients: the connection's
    (clients.transport.ConnectionOptions) and the embedding model's.

    ``ClientOptions.create(url, protocol, model=..., ...)`` checks them (ValueError on a bad one)
    and fills in the protocol's default URL.
    """

    protocol: Protocol = "http"
    model: str = DEFAULT_MODEL
    priority: int = 0
    batch_size: int = MAX_BATCH_SIZE
    # None: a text over the model's 256 tokens is refused (the server's default); "right" keeps
    # its first tokens, "left" its last (TRUNCATE / TRUNCATION_DIRECTION, docs/embeddings.md).
    truncation: str | None = None

    def check(self) -> None:
        """The embedding model's own options."""
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be None (refuse texts over the limit), 'right' or 'left', not {self.truncation!r}")
        priority, batch_size = self.priority, self.batch_size
        if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
            raise ValueError(f"priority must be an int >= 0 (0 = the model's default, 1 = highest), not {priority!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be an int in 1..{MAX_BATCH_SIZE} (the model's max_batch_size), not {batch_size!r}")

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


def build_request(options: ClientOptions, texts: Sequence[Text]) -> tuple[list[Any], list[Any]]:
    """The tritonclient (inputs, outputs) of one request for ``texts``."""
    # InferInput/InferRequestedOutput live in the sync modules; the aio clients reuse them.
    module = tritonclient_module(options.protocol)
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
    """Turn a tritonclient or transport exception into an EmbeddingError with the server's words
    (clients/errors.py), naming the request's slice of the texts.

    A RetryError (the retries ran out) gives its last error, noting the attempts and deadline.
    """

    def make(message: str, **kwargs: Any) -> EmbeddingError:
        return EmbeddingError(message, model=options.model, start=start, stop=stop, total=total, **kwargs)

    no_endpoint = f"no endpoint of {', '.join(options.urls)} available"
    return translate(exc, make, options.protocol, url or options.url, options.timeout_s, no_endpoint)


class EmbeddingRequest:
    """One request, ``texts[start:stop]`` of the caller's list: its inputs (built once, sent by
    every attempt), its result read back, its failures as EmbeddingError. The sync and asyncio
    clients differ only in whether they await ``send``::

        def attempt(url, timeout_s):
            with request.failures(url):
                return request.read(request.send(connection, url, timeout_s))

        with request.gave_up():
            return retrier.call(attempt, timeout_s)
    """

    __slots__ = ("options", "start", "stop", "total", "inputs", "outputs", "failure_types")

    def __init__(
        self, options: ClientOptions, items: Sequence[Text], start: int, stop: int, failures: tuple[type[BaseException], ...]
    ):
        self.options = options
        self.start, self.stop, self.total = start, stop, len(items)
        self.inputs, self.outputs = build_request(options, items[start:stop])
        self.failure_types = failures  # what an attempt's failure may be (clients.transport.request_failures)

    def send(self, connection: Any, url: str, timeout_s: float | None) -> Any:
        """``connection.infer`` of one attempt at ``url``: the result, or (asyncio) its awaitable."""
        o = self.options
        log.debug("embed: %s texts[%d:%d] via %s %s", o.model, self.start, self.stop, o.protocol, url)
        return connection.infer(o.model, self.inputs, outputs=self.outputs, **o.infer_kwargs(timeout_s))

    def read(self, result: Any) -> np.ndarray:
        """The request's rows of the result."""
        return read_embeddings(result, self.stop - self.start, self.options)

    def error(self, exc: BaseException, url: str | None = None) -> EmbeddingError:
        """``exc`` as this request's EmbeddingError."""
        return to_embedding_error(exc, self.options, self.start, self.stop, self.total, url=url)

    def failures(self, url: str) -> _Raise:
        """A ``with`` block around one attempt at ``url``: its failure is raised as EmbeddingError."""
        return _Raise(self, url, self.failure_types)

    def gave_up(self) -> _Raise:
        """A ``with`` block around the retried call: its RetryError is raised as EmbeddingError."""
        return _Raise(self, None, RetryError)


class _Raise:
    __slots__ = ("request", "url", "types")

    def __init__(self, request: EmbeddingRequest, url: str | None, types: type[BaseException] | tuple[type[BaseException], ...]):
        self.request, self.url, self.types = request, url, types

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None and isinstance(exc, self.types):
            raise self.request.error(exc, self.url) from exc
