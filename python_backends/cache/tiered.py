"""L1 then L2 lookups for a whole batch of texts, and the batch's misses as one list.

``EmbeddingCache.plan(texts, keys)`` looks every distinct key up in L1, the L1 misses in L2
(one MGET), promotes L2 hits into L1, and returns a ``BatchPlan``: which distinct texts are
still missing. The caller computes those in ONE model call, hands the vectors to
``plan.fill`` (which writes them back to L1 and L2), and reads each request's rows, in the
order they were sent, with ``plan.rows``. A text that appears twice in a batch is looked up
and computed once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from python_backends.cache.lru import LRUCache
from python_backends.cache.redis_l2 import RedisL2


@dataclass
class LookupCounts:
    texts: int = 0
    distinct: int = 0
    l1_hits: int = 0
    l2_hits: int = 0
    misses: int = 0  # distinct texts that go to the model
    seconds: float = 0.0  # time spent in L1 + L2 lookups


@dataclass
class BatchPlan:
    keys: list[str]  # per text, in request order
    found: dict[str, np.ndarray]
    miss_keys: list[str]
    miss_texts: list[str]
    counts: LookupCounts = field(default_factory=LookupCounts)

    def rows(self, start: int, stop: int, dim: int) -> np.ndarray | None:
        """Vectors of texts[start:stop] in order, or None if any of them has none."""
        out = np.empty((stop - start, dim), dtype=np.float32)
        for row, key in enumerate(self.keys[start:stop]):
            vector = self.found.get(key)
            if vector is None:
                return None
            out[row] = vector
        return out


class EmbeddingCache:
    """L1 (may be None or sized 0) and L2 (None when no Redis URL is configured)."""

    def __init__(self, dim: int, l1: LRUCache | None = None, l2: RedisL2 | None = None):
        self.dim = int(dim)
        self.l1 = l1
        self.l2 = l2

    def plan(self, texts: Sequence[str], keys: Sequence[str]) -> BatchPlan:
        start = time.perf_counter()
        distinct: dict[str, str] = {}
        for key, text in zip(keys, texts):
            distinct.setdefault(key, text)
        unique = list(distinct)
        found: dict[str, np.ndarray] = {}
        counts = LookupCounts(texts=len(texts), distinct=len(unique))
        missing = unique
        if self.l1 is not None and self.l1.max_bytes > 0:
            missing = []
            for key, vector in zip(unique, self.l1.get_many(unique)):
                if vector is None:
                    missing.append(key)
                else:
                    found[key] = vector
            counts.l1_hits = len(unique) - len(missing)
        if self.l2 is not None and missing:
            promoted = []
            still = []
            for key, vector in zip(missing, self.l2.get_many(missing)):
                if vector is None:
                    still.append(key)
                else:
                    found[key] = vector
                    promoted.append((key, vector))
            counts.l2_hits = len(promoted)
            if self.l1 is not None:
                self.l1.put_many(promoted)
            missing = still
        counts.misses = len(missing)
        counts.seconds = time.perf_counter() - start
        return BatchPlan(list(keys), found, missing, [distinct[k] for k in missing], counts)

    def fill(self, plan: BatchPlan, vectors: np.ndarray, store: bool = True, keys: Sequence[str] | None = None) -> None:
        """Give the plan the model's vectors for ``plan.miss_texts`` (same order), or for the
        misses ``keys`` only (those the model answered); with ``store`` also write them to L1
        and L2."""
        keys = plan.miss_keys if keys is None else list(keys)
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.shape != (len(keys), self.dim):
            raise ValueError(
                f"model returned shape {list(vectors.shape)} for {len(keys)} texts, expected [{len(keys)}, {self.dim}]"
            )
        items = list(zip(keys, vectors))
        for key, vector in items:
            plan.found[key] = vector
        if store:
            if self.l1 is not None:
                self.l1.put_many(items)
            if self.l2 is not None:
                self.l2.set_many(items)
