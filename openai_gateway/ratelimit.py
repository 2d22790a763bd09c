"""A token bucket per API key: ``rate`` requests per second, bursts of up to ``burst``.

A refused request gets 429 with ``Retry-After``: the whole seconds until a token is back
(the ``openai`` SDK waits that long before it retries).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class TokenBucket:
    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: int, now: float):
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float, cost: float = 1.0) -> float:
        """0.0 when a token was taken; else the seconds until one is available."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate


class RateLimiter:
    """Buckets by key id; ``rate <= 0`` turns limiting off."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000):
        if rate > 0 and burst < 1:
            raise ValueError(f"rate limit burst must be >= 1, got {burst}")
        self.rate = rate
        self.burst = max(1, burst)
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: dict[str, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def check(self, key: str) -> int:
        """0 when the request may go; else the Retry-After in whole seconds (>= 1)."""
        if self.rate <= 0:
            return 0
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:  # keys are configured, so this bounds a leak only
                self._buckets.clear()
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
        wait = bucket.take(now)
        return 0 if wait == 0.0 else max(1, math.ceil(wait))
