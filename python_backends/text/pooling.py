"""Attention-masked mean pooling and L2 normalisation (sentence-transformers' recipe)."""

from __future__ import annotations

import numpy as np

from python_backends.errors import InputError


def mean_pool(token_embeddings: np.ndarray, attention_mask: np.ndarray, normalize: bool = True) -> np.ndarray:
    """[n, L, H] float, [n, L] int -> [n, H] float32, padding tokens excluded.

    Raises InputError when the shapes disagree or a row has no real token.
    """
    if token_embeddings.ndim != 3:
        raise InputError("token_embeddings", f"expected 3 dims [batch, tokens, hidden], got shape {list(token_embeddings.shape)}")
    if attention_mask.shape != token_embeddings.shape[:2]:
        raise InputError(
            "attention_mask",
            f"shape {list(attention_mask.shape)} does not match token_embeddings {list(token_embeddings.shape[:2])}",
        )
    mask = (attention_mask > 0).astype(np.float32)
    counts = mask.sum(axis=1, keepdims=True)
    if np.any(counts == 0):
        row = int(np.argmax(counts[:, 0] == 0))
        raise InputError(f"attention_mask[{row}]", "has no real token (all zeros)")
    summed = np.einsum("nlh,nl->nh", token_embeddings.astype(np.float32, copy=False), mask)
    pooled = summed / counts
    if normalize:
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        pooled = pooled / np.maximum(norms, 1e-12)
    return pooled.astype(np.float32, copy=False)
