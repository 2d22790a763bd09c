"""Multi-level result cache for text embeddings (L1 in-process LRU with TTL, L2 Redis).

Used by the ``text_embedding_cached`` model (a BLS Python model in front of the
``text_embedding`` ensemble). Nothing here imports ``triton_python_backend_utils``:
``triton_metrics`` takes it as an argument, like ``python_backends.shim``.
"""
