"""Clients of the ``text_embedding`` ensemble (TEXT -> EMBEDDING): ``EmbeddingClient`` and
``embed`` (blocking), ``AsyncEmbeddingClient`` (asyncio, many requests in flight), and the
``embed`` command (``cli``).

By role: ``core.py`` is what both clients share, written once (options, the texts as the model
takes them, one request's inputs and result, EmbeddingError); ``client.py`` and ``aio.py`` add
only the blocking or awaited call; ``cli.py`` is the command line. Every name is importable
from ``clients.embeddings`` (and the main ones from ``clients``).
"""

from clients.embeddings.aio import DEFAULT_CONCURRENCY, AsyncEmbeddingClient
from clients.embeddings.client import EmbeddingClient, embed
from clients.embeddings.core import (
    DEFAULT_MODEL,
    MAX_BATCH_SIZE,
    ClientOptions,
    EmbeddingError,
    EmbeddingRequest,
    Text,
    as_text_list,
    build_request,
    cosine_similarity_matrix,
    encode_texts,
    read_embeddings,
    server_timeout_us,
    split_batches,
    to_embedding_error,
)
from clients.transport import DEFAULT_URLS, PROTOCOLS, Protocol

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_MODEL",
    "DEFAULT_URLS",
    "MAX_BATCH_SIZE",
    "PROTOCOLS",
    "AsyncEmbeddingClient",
    "ClientOptions",
    "EmbeddingClient",
    "EmbeddingError",
    "EmbeddingRequest",
    "Protocol",
    "Text",
    "as_text_list",
    "build_request",
    "cosine_similarity_matrix",
    "embed",
    "encode_texts",
    "read_embeddings",
    "server_timeout_us",
    "split_batches",
    "to_embedding_error",
]
