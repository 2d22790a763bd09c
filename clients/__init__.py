"""Clients of the text-embedding server: sync (``EmbeddingClient``, ``embed``), asyncio
(``AsyncEmbeddingClient``) and the ``embed`` command line (``clients.cli``); of the
text-generation model: ``GenerationClient``, ``AsyncGenerationClient`` (clients.generation)
and ``python -m clients generate|chat`` (clients.generation_cli).

    from clients import EmbeddingClient, cosine_similarity_matrix

    with EmbeddingClient("127.0.0.1:8000") as client:
        vectors = client.embed(["a sentence", "another one"])   # float32 [2, 384]
    print(cosine_similarity_matrix(vectors))
"""

from clients.aio import AsyncEmbeddingClient
from clients.embed import (
    DEFAULT_MODEL,
    DEFAULT_URLS,
    MAX_BATCH_SIZE,
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
