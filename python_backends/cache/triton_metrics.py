"""The cache's custom metrics on Triton's metrics port (``pb_utils.MetricFamily``).

``pb_utils`` is passed in, as in ``python_backends.shim``. Names (all labelled ``model``):

- ``embedding_cache_lookups_total{level="l1"|"l2", result="hit"|"miss"}``: distinct texts
  looked up per level (an L1 miss goes on to L2 when L2 is configured);
- ``embedding_cache_evictions_total{level="l1", reason="lru"|"ttl"}``;
- ``embedding_cache_lookup_seconds``: histogram of one batch's L1 + L2 lookup time;
- ``embedding_cache_redis_errors_total{kind="connection"|"timeout"|"garbage"|"other"}``;
- ``embedding_cache_l1_bytes``, ``embedding_cache_l1_entries``, ``embedding_cache_redis_up``
  (gauges, also labelled ``instance``: each instance has its own L1 and Redis connection);
- ``embedding_cache_model_texts_total``: texts computed by the model (the misses).
"""

from __future__ import annotations

from typing import Any

from python_backends.cache.lru import LRUCache
from python_backends.cache.redis_l2 import ERROR_KINDS, RedisL2
from python_backends.cache.tiered import LookupCounts

LATENCY_BUCKETS = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]


class CacheMetrics:
    def __init__(self, pb_utils: Any, model: str, instance: str = ""):
        family = pb_utils.MetricFamily
        # A MetricFamily must outlive its Metric objects, or the next set() fails the request:
        # keep them all.
        self._families: list[Any] = []

        def fam(name: str, description: str, kind: Any) -> Any:
            f = family(name=name, description=description, kind=kind)
            self._families.append(f)
            return f

        base = {"model": model}
        lookups = fam("embedding_cache_lookups_total", "Distinct texts looked up, per cache level and result", family.COUNTER)
        self.lookups = {
            (lvl, res): lookups.Metric(labels={**base, "level": lvl, "result": res})
            for lvl in ("l1", "l2")
            for res in ("hit", "miss")
        }
        evictions = fam("embedding_cache_evictions_total", "L1 entries removed: lru = byte budget, ttl = expired", family.COUNTER)
        self.evictions = {r: evictions.Metric(labels={**base, "level": "l1", "reason": r}) for r in ("lru", "ttl")}
        errors = fam(
            "embedding_cache_redis_errors_total", "Redis (L2) failures by kind; each one was served without L2", family.COUNTER
        )
        self.errors = {k: errors.Metric(labels={**base, "kind": k}) for k in ERROR_KINDS}
        texts = fam("embedding_cache_model_texts_total", "Texts computed by the model (cache misses)", family.COUNTER)
        self.model_texts = texts.Metric(labels=base)
        # Counters of all instances add up (same labels, one series); gauges are per instance.
        own = {**base, "instance": instance}
        self.l1_bytes = fam("embedding_cache_l1_bytes", "Bytes held by this instance's L1", family.GAUGE).Metric(labels=own)
        self.l1_entries = fam("embedding_cache_l1_entries", "Entries held by this instance's L1", family.GAUGE).Metric(labels=own)
        self.redis_up = fam(
            "embedding_cache_redis_up", "1 when the last Redis call worked, 0 after a failure, -1 without L2", family.GAUGE
        ).Metric(labels=own)
        latency = fam("embedding_cache_lookup_seconds", "L1 + L2 lookup time of one batch", family.HISTOGRAM)
        self.latency = latency.Metric(labels=base, buckets=LATENCY_BUCKETS)
        self._seen = {"lru": 0, "ttl": 0, **{k: 0 for k in ERROR_KINDS}}
        self._gauges: dict[str, float] = {}

    def objects(self) -> list:
        """Every Metric and MetricFamily made here (for ``python_backends.shim.keep_metrics``)."""
        metrics = [
            *self.lookups.values(),
            *self.evictions.values(),
            *self.errors.values(),
            self.model_texts,
            self.l1_bytes,
            self.l1_entries,
            self.redis_up,
            self.latency,
        ]
        return metrics + list(self._families)

    def record(self, counts: LookupCounts, l1: LRUCache | None, l2: RedisL2 | None) -> None:
        l1_on = l1 is not None and l1.max_bytes > 0
        l1_misses = counts.distinct - counts.l1_hits if l1_on else counts.distinct
        if l1_on:
            self._inc(self.lookups[("l1", "hit")], counts.l1_hits)
            self._inc(self.lookups[("l1", "miss")], l1_misses)
        if l2 is not None:
            self._inc(self.lookups[("l2", "hit")], counts.l2_hits)
            self._inc(self.lookups[("l2", "miss")], l1_misses - counts.l2_hits)
        self.latency.observe(counts.seconds)
        self.sync(l1, l2)

    def model_computed(self, n: int) -> None:
        self._inc(self.model_texts, n)

    def sync(self, l1: LRUCache | None, l2: RedisL2 | None) -> None:
        """Cumulative library counters -> metric increments; gauges. Each metric call is a
        message to the server process (tens of µs), so only changes are sent: a batch of
        hits costs two (the L1 hit count and the latency)."""
        if l1 is not None:
            self._delta("lru", l1.stats.evictions, self.evictions["lru"])
            self._delta("ttl", l1.stats.expirations, self.evictions["ttl"])
            self._gauge("l1_bytes", self.l1_bytes, l1.stats.bytes)
            self._gauge("l1_entries", self.l1_entries, l1.stats.entries)
        if l2 is not None:
            for kind in ERROR_KINDS:
                self._delta(kind, l2.stats.errors[kind], self.errors[kind])
            self._gauge("redis_up", self.redis_up, 1 if l2.stats.up else 0)
        else:
            self._gauge("redis_up", self.redis_up, -1)

    def _gauge(self, name: str, metric: Any, value: float) -> None:
        if self._gauges.get(name) != value:
            metric.set(value)
            self._gauges[name] = value

    def _delta(self, name: str, total: int, metric: Any) -> None:
        if total > self._seen[name]:
            metric.increment(total - self._seen[name])
            self._seen[name] = total

    @staticmethod
    def _inc(metric: Any, n: int) -> None:
        if n > 0:
            metric.increment(n)
