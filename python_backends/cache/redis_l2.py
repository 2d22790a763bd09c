"""L2: Redis shared by all replicas, with bounded timeouts and a failure policy.

Values are the raw little-endian float32 bytes of one entry of ``dim`` values (the cached
entry's: a 384-float vector and its token count, 385 x 4 = 1540 bytes), written with ``SET key
value EX ttl`` in one pipeline and read with one ``MGET`` per batch.

Failures never fail a request. Whatever goes wrong (connection refused, a timeout because
Redis is slow or stopped, an unexpected reply, a value of the wrong size or with NaN/inf) is
counted by kind, logged as a warning at most once per ``warn_interval_s`` (with how many
happened since the last warning), and treated as a miss. After a connection error or
timeout, Redis is skipped for ``retry_interval_s`` so a dead Redis costs nothing per batch;
the next batch after that tries again, and when it works L2 is used again with no restart
(logged once: "Redis is back").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from python_backends.redaction import redact_url

log = logging.getLogger(__name__)

ERROR_KINDS = ("connection", "timeout", "garbage", "other")


@dataclass
class L2Stats:
    hits: int = 0
    misses: int = 0
    skipped: int = 0  # lookups not tried because Redis was down (counted as misses too)
    errors: dict[str, int] = field(default_factory=lambda: {k: 0 for k in ERROR_KINDS})
    up: bool = True


class RedisL2:
    """Batched get/set of float32 vectors in Redis; see the module docstring for failures."""

    def __init__(
        self,
        url: str,
        dim: int,
        ttl_s: int,
        timeout_s: float = 0.05,
        retry_interval_s: float = 2.0,
        warn_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        client: Any = None,
    ):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        self.url = url
        self.dim = int(dim)
        self.ttl_s = int(ttl_s)
        self.retry_interval_s = float(retry_interval_s)
        self.warn_interval_s = float(warn_interval_s)
        self._clock = clock
        # No client-side retries: one bounded attempt per batch, the retry policy is ours.
        self.client = client or redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            max_connections=4,
        )
        self.stats = L2Stats()
        self._down_until = 0.0
        self._last_warning: float | None = None
        self._unwarned = 0

    # ---- public --------------------------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        """One MGET for all keys; None for a miss, and for everything when Redis fails."""
        if not keys:
            return []
        if not self._available():
            self.stats.skipped += len(keys)
            self.stats.misses += len(keys)
            return [None] * len(keys)
        try:
            raw = self.client.mget(list(keys))
        except Exception as exc:  # noqa: BLE001 - any failure means "no L2 this time"
            self._failed(exc, "MGET")
            self.stats.misses += len(keys)
            return [None] * len(keys)
        if not isinstance(raw, list) or len(raw) != len(keys):
            self._garbage(
                f"MGET returned {type(raw).__name__} of length {len(raw) if isinstance(raw, list) else '-'} for {len(keys)} keys"
            )
            self.stats.misses += len(keys)
            return [None] * len(keys)
        self._succeeded()
        out: list[np.ndarray | None] = []
        for key, value in zip(keys, raw):
            vector = None if value is None else self._decode(key, value)
            if vector is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            out.append(vector)
        return out

    def set_many(self, items: Sequence[tuple[str, np.ndarray]]) -> None:
        """SET key value EX ttl for each item, in one pipeline round trip."""
        if not items or not self._available():
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, vector in items:
                pipe.set(key, np.ascontiguousarray(vector, dtype="<f4").tobytes(), ex=self.ttl_s)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001
            self._failed(exc, "SET")
            return
        self._succeeded()

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail too
            pass

    # ---- internals -----------------------------------------------------------------------

    def _decode(self, key: str, value: Any) -> np.ndarray | None:
        expected = self.dim * 4
        if not isinstance(value, (bytes, bytearray)) or len(value) != expected:
            size = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
            self._garbage(f"value of {key} is {size} bytes, expected {expected} (float32 x {self.dim})")
            return None
        vector = np.frombuffer(bytes(value), dtype="<f4").astype(np.float32)
        if not np.isfinite(vector).all():
            self._garbage(f"value of {key} holds NaN or infinity")
            return None
        return vector

    def _available(self) -> bool:
        return self._clock() >= self._down_until

    def _failed(self, exc: BaseException, what: str) -> None:
        redis = self._redis
        if isinstance(exc, redis.exceptions.TimeoutError):
            kind = "timeout"
        elif isinstance(exc, redis.exceptions.ConnectionError):
            kind = "connection"
        else:
            kind = "other"
        self.stats.errors[kind] += 1
        self.stats.up = False
        self._down_until = self._clock() + self.retry_interval_s
        self._warn(f"Redis {what} failed ({kind}: {exc}); serving without L2, next try in {self.retry_interval_s:g} s")

    def _garbage(self, detail: str) -> None:
        self.stats.errors["garbage"] += 1
        self._warn(f"unusable reply from Redis ({detail}); treated as a miss")

    def _succeeded(self) -> None:
        if not self.stats.up:
            self.stats.up = True
            log.warning("Redis at %s is back; L2 is used again", redact_url(self.url))

    def _warn(self, message: str) -> None:
        now = self._clock()
        if self._last_warning is not None and now - self._last_warning < self.warn_interval_s:
            self._unwarned += 1
            return
        extra = f" ({self._unwarned} more L2 problems since the last warning)" if self._unwarned else ""
        log.warning(
            "%s%s [L2 %s; this warning is logged at most every %g s]", message, extra, redact_url(self.url), self.warn_interval_s
        )
        self._last_warning = now
        self._unwarned = 0
