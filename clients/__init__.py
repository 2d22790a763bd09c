"""Clients of the text-embedding server: sync (``EmbeddingClient``, ``embed``), asyncio
(``AsyncEmbeddingClient``) and the ``embed`` command line (clients.embeddings); of the
text-generation model: ``GenerationClient``, ``AsyncGenerationClient`` and ``python -m clients
generate|chat`` (clients.generation). What both roles share: clients/transport.py (protocols,
URLs, tritonclient connections, the clients' skeleton), clients/errors.py (failures as the
clients' errors) and clients/resilience.py (retries, breakers, failover); the command lines'
common options, clients/cli_common.py.

    from clients import EmbeddingClient, cosine_similarity_matrix

    with EmbeddingClient("127.0.0.1:8000") as client:
        vectors = client.embed(["a sentence", "another one"])   # float32 [2, 384]
    print(cosine_similarity_matrix(vectors))
"""

from clients.embeddings import (
    DEFAULT_MODEL,
    DEFAULT_URLS,
    MAX_BATCH_SIZE,
    AsyncEmbeddingClient,
    EmbeddingClient,
    EmbeddingError,
    cosine_similarity_matrix,
    embed,
)
from clients.generation import AsyncGenerationClient, Generation, GenerationClient, GenerationError

__all__ = [
    "AsyncEmbeddingClient",
    "AsyncGenerationClient",
    "DEFAULT_MODEL",
    "DEFAULT_URLS",
    "MAX_BATCH_SIZE",
    "EmbeddingClient",
    "EmbeddingError",
    "Generation",
    "GenerationClient",
    "GenerationError",
    "cosine_similarity_matrix",
    "embed",
]
