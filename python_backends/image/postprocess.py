"""Logits -> top-k (label, class index, probability), for the image classifier's last step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.errors import ConfigError, InputError


def load_labels(path: str | Path, expected: int | None = None) -> list[str]:
    """One class name per line, in class-index order. Raises ConfigError when the file is
    missing, has blank names or a count other than ``expected``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"labels file not found: {path} (run `make export`)")
    labels = path.read_text(encoding="utf-8").splitlines()
    while labels and labels[-1] == "":
        labels.pop()
    blank = [i for i, label in enumerate(labels) if not label.strip()]
    if blank:
        raise ConfigError(f"labels file {path}: line {blank[0] + 1} is blank")
    if expected is not None and len(labels) != expected:
        raise ConfigError(f"labels file {path} has {len(labels)} labels; the model has {expected} classes")
    return labels


def softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis, in float32 (float64 accumulation)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


@dataclass(frozen=True)
class TopK:
    labels: np.ndarray  # [n, k] object (bytes, UTF-8)
    indices: np.ndarray  # [n, k] int64
    scores: np.ndarray  # [n, k] float32 probabilities, descending


class TopKClassifier:
    """Turns [n, classes] logits into the k most probable classes with their names."""

    def __init__(self, labels: list[str], k: int):
        if not 1 <= k <= len(labels):
            raise ConfigError(f"top_k must be between 1 and the number of classes ({len(labels)}), got {k}")
        self.k = k
        self.num_classes = len(labels)
        self._names = np.array([label.encode("utf-8") for label in labels], dtype=object)

    def __call__(self, logits: np.ndarray, field: str = "logits") -> TopK:
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[1] != self.num_classes:
            raise InputError(field, f"expected shape [n, {self.num_classes}], got {list(logits.shape)}")
        if not np.all(np.isfinite(logits)):
            row = int(np.argmax(~np.isfinite(logits).all(axis=1)))
            raise InputError(f"{field}[{row}]", "contains NaN or infinity")
        probs = softmax(logits)
        # Stable sort of the negated probabilities: equal scores keep index order.
        order = np.argsort(-probs, axis=1, kind="stable")[:, : self.k]
        return TopK(
            labels=self._names[order],
            indices=order.astype(np.int64),
            scores=np.take_along_axis(probs, order, axis=1),
        )

    def per_request(self, arrays: list[np.ndarray], field: str = "logits") -> list[TopK | Exception]:
        """Classify several requests' logits with one softmax and sort; one result per request.

        If the whole batch fails (a request with NaN logits, a wrong shape), each request is
        classified alone so that only the offending one gets its error.
        """
        if not arrays:
            return []
        try:
            top = self(np.concatenate(arrays), field)
        except Exception:  # noqa: BLE001 - isolate the failure to its request
            results: list[TopK | Exception] = []
            for array in arrays:
                try:
                    results.append(self(array, field))
                except Exception as exc:  # noqa: BLE001
                    results.append(exc)
            return results
        offsets = np.cumsum([0] + [len(a) for a in arrays])
        return [TopK(top.labels[lo:hi], top.indices[lo:hi], top.scores[lo:hi]) for lo, hi in zip(offsets[:-1], offsets[1:])]
