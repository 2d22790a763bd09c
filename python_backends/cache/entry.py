"""The cached entry model (``text_embedding_cached`` and its priority-class entries) without Triton.

``CachedEntry`` reads and checks the entry's config at load: the class it serves, its
admission into the class's lane, the cache levels. ``embed`` serves one batch: keys for the
encoder identity that serves now, L1 and L2 lookups, ONE call of ``compute`` (the shim's BLS
call to the target model) for the misses, admitted into the lane, and each request's rows:
its vectors and each text's token count. A cache entry holds both: the vector's ``dim``
float32 values, then the token count as one more float32 (exact below 2**24). See
docs/result-cache.md and docs/priority-classes.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from python_backends.admission.classes import check_request_class, class_named
from python_backends.admission.controller import Admission
from python_backends.admission.inflight import SharedInflight, default_directory
from python_backends.cache.identity import IdentityResolver
from python_backends.cache.keys import KeyMaker
from python_backends.cache.lru import LRUCache
from python_backends.cache.redis_l2 import RedisL2
from python_backends.cache.settings import CacheSettings
from python_backends.cache.tiered import EmbeddingCache
from python_backends.config import ModelConfig

log = logging.getLogger(__name__)

# texts -> their vectors [len(texts), dim] and token counts [len(texts)], from the target model in one call
ComputeFn = Callable[[list], tuple[np.ndarray, np.ndarray]]
Rows = tuple[np.ndarray, np.ndarray]  # one request's vectors [n, dim] float32 and token counts [n] int32


def pack(vectors: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Cache entries [n, dim + 1]: each vector, then its text's token count."""
    counts = np.asarray(counts).reshape(-1)
    if len(counts) != len(vectors):
        raise ValueError(f"the model returned {len(counts)} token counts for {len(vectors)} vectors")
    return np.concatenate([np.asarray(vectors, dtype=np.float32), counts.astype(np.float32)[:, None]], axis=1)


def unpack(entries: np.ndarray) -> Rows:
    """(vectors, token counts) of cache entries [n, dim + 1]."""
    return entries[:, :-1], entries[:, -1].astype(np.int32)


class CachedEntry:
    """One instance's cache, admission and identity; ``compute`` is called only for misses
    (or for every text while no single encoder version serves)."""

    def __init__(
        self,
        config: ModelConfig,
        repository: Path,
        is_ready: Callable[[str, str], bool],
        compute: ComputeFn,
        environ: Mapping[str, str] = os.environ,
        admission_dir: Path | None = None,
    ):
        self.text = config.require("input", "TEXT", "TYPE_STRING", (1,)).name
        out = config.require("output", "EMBEDDING", "TYPE_FP32")
        if len(out.dims) != 1 or out.dims[0] < 1:
            raise ValueError(f"output EMBEDDING must have dims [d], config says {list(out.dims)}")
        self.dim = out.dims[0]
        config.require("output", "NUM_TOKENS", "TYPE_INT32", (1,))
        self.target = config.param("target_model", "text_embedding")
        self.max_text_bytes = config.param_int("max_text_bytes", 65536, minimum=1)
        self.cls = class_named(config.param("priority_class", "default"), "parameter priority_class")
        limit = config.param_int("admission_rows", 128, minimum=1)
        inflight = SharedInflight(admission_dir or default_directory(), self.cls.name, limit)
        self.admission = Admission(self.cls, inflight)
        # A flood is refused only while an instance is free to refuse it: the instances that
        # can wait in the lane with full batches must hold more than the limit.
        if limit > (config.instance_count() - 1) * max(1, config.max_batch_size):
            log.warning(
                "%s: admission_rows %d >= (instances - 1) x max_batch_size: "
                "a flood queues instead of being refused (docs/priority-classes.md)",
                config.name,
                limit,
            )
        settings = CacheSettings.from_config(config, environ)
        encoder = config.param("encoder_model", "text_encoder")
        self.resolver = IdentityResolver(Path(repository), self.target, encoder, None, is_ready)
        l1 = LRUCache(settings.l1_max_bytes, settings.l1_ttl_s)
        l2 = None
        if settings.l2_redis_url:
            l2 = RedisL2(
                settings.l2_redis_url,
                self.dim + 1,
                settings.l2_ttl_s,
                settings.l2_timeout_s,
                settings.l2_retry_interval_s,
                settings.warn_interval_s,
            )
        self.cache = EmbeddingCache(self.dim + 1, l1, l2)  # entries: pack()
        self.compute = compute
        self.metrics: Any = None
        self._keys: KeyMaker | None = None

    def use_metrics(self, metrics: Any) -> None:
        """Report to ``metrics`` (a cache.triton_metrics.CacheMetrics) from now on."""
        self.metrics = metrics
        metrics.sync(self.cache.l1, self.cache.l2)

    def check_class(self, parameters: str | dict | None) -> None:
        """InputError for a request naming another class (the entry that serves it is named)."""
        check_request_class(parameters, self.cls)

    def key_maker(self, version: str | None = None) -> KeyMaker | None:
        """The one place the key's model identity comes from (``version``: a caller's choice);
        None while no single version serves (the cache is then bypassed)."""
        identity = self.resolver.identity(version)
        if identity is None:
            return None
        if self._keys is None or self._keys.identity != identity:
            self._keys = KeyMaker(identity)
        return self._keys

    def _compute(self, texts: list) -> np.ndarray:
        """Cache entries of ``texts`` (pack()), from one admitted call of ``compute``."""
        with self.admission.rows(len(texts)):
            vectors, counts = self.compute(texts)
        return pack(vectors, counts)

    def embed(self, batch: Sequence[Sequence[str]]) -> list[Rows | BaseException]:
        """For each request's texts in ``batch``, their (vectors [len(texts), dim], token counts
        [len(texts)]) or the exception that failed them. A request answered entirely from cache
        succeeds even when the model call failed."""
        if not batch:
            return []
        texts = [text for request in batch for text in request]
        spans, start = [], 0
        for request in batch:
            spans.append((start, start + len(request)))
            start += len(request)
        keys = self.key_maker()
        if keys is None:  # no single encoder version serves: no identity, no cache; the model answers
            try:
                entries = self._compute(texts)
            except Exception as exc:
                return [exc] * len(spans)
            return [unpack(entries[start:stop]) for start, stop in spans]

        plan = self.cache.plan(texts, [keys(t) for t in texts])
        failure = None
        if plan.miss_texts:
            try:
                vectors = self._compute(plan.miss_texts)
                # Written back only if the identity did not change during the call (a hot swap
                # in between could have computed them with the new model under the old keys).
                after = self.key_maker()
                self.cache.fill(plan, vectors, store=after is not None and after.identity == keys.identity)
                if self.metrics is not None:
                    self.metrics.model_computed(len(plan.miss_texts))
            except Exception as exc:
                failure = exc
        if self.metrics is not None:
            self.metrics.record(plan.counts, self.cache.l1, self.cache.l2)
        out: list[Rows | BaseException] = []
        for start, stop in spans:
            rows = plan.rows(start, stop, self.dim + 1)
            out.append(unpack(rows) if rows is not None else failure or RuntimeError("no embedding was produced"))
        return out

    def close(self) -> None:
        if self.cache.l2 is not None:
            self.cache.l2.close()
