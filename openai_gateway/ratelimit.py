"""A token bucket per API key: ``rate`` requests per second, bursts of up to ``burst``.

A refused request gets 429 with ``Retry-After``: the whole seconds until a token is back
(the ``openai`` SDK waits that long before it retries). ``RateLimiter`` keeps the buckets in
the gateway's process; ``SharedRateLimiter`` keeps them in Redis, so that several gateways
behind one front door apply one limit per key, not one each.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class TokenBucket:
    """One key's bucket: ``burst`` tokens, refilled at ``rate`` per second."""

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
        """Whether requests are limited at all (``rate > 0``)."""
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


# One atomic token bucket per key in Redis, shared by every gateway: the refill uses Redis's
# own clock (TIME), so gateways on machines whose clocks differ agree. KEYS[1] the bucket (a
# hash of tokens and stamp in microseconds); ARGV rate per second, burst, cost. Returns 0 when a
# token was taken, else the microseconds until one is back. The key expires once a full bucket
# would have refilled (idle keys cost nothing).
TOKEN_BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = tonumber(state[1])
local stamp = tonumber(state[2])
if tokens == nil or stamp == nil then
  tokens = burst
  stamp = now
end
tokens = math.min(burst, tokens + (now - stamp) * rate / 1000000)
local wait = 0
if tokens >= cost then
  tokens = tokens - cost
else
  wait = math.ceil((cost - tokens) * 1000000 / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'stamp', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
return wait
"""

FAIL_OPEN = "open"
FAIL_CLOSED = "closed"


class RateLimiterUnavailable(RuntimeError):
    """The shared limiter's Redis cannot be reached and the limiter fails closed."""


class SharedRateLimiter:
    """The per-key token bucket kept in Redis, one for every gateway (``RateLimiter``'s rate and
    burst, cluster-wide). When Redis does not answer within ``timeout_s``: ``fail="open"`` falls
    back to this gateway's own in-process bucket (a limit per gateway, as without Redis) and
    ``fail="closed"`` raises ``RateLimiterUnavailable`` (the gateway answers 503). Either way
    ``redis_errors`` counts it; Redis is asked again at the next request."""

    def __init__(
        self,
        url: str,
        rate: float,
        burst: int,
        *,
        fail: str = FAIL_OPEN,
        timeout_s: float = 0.25,
        prefix: str = "gateway:ratelimit:",
        clock: Callable[[], float] = time.monotonic,
    ):
        if fail not in (FAIL_OPEN, FAIL_CLOSED):
            raise ValueError(f"rate limit fail mode must be {FAIL_OPEN!r} or {FAIL_CLOSED!r}, got {fail!r}")
        import redis.asyncio as aioredis

        self.local = RateLimiter(rate, burst, clock)
        self.rate, self.burst, self.fail, self.prefix = rate, self.local.burst, fail, prefix
        self.redis_errors = 0
        self._client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._script = self._client.register_script(TOKEN_BUCKET_LUA)

    @property
    def enabled(self) -> bool:
        """Whether requests are limited at all (``rate > 0``)."""
        return self.rate > 0

    async def check(self, key: str) -> int:
        """0 when the request may go; else the Retry-After in whole seconds (>= 1)."""
        if self.rate <= 0:
            return 0
        try:
            wait_us = int(await self._script(keys=[self.prefix + key], args=[self.rate, self.burst, 1]))
        except Exception as exc:  # noqa: BLE001 - any Redis failure: the documented fail mode
            self.redis_errors += 1
            if self.fail == FAIL_CLOSED:
                raise RateLimiterUnavailable(f"the shared rate limiter (Redis) is unavailable: {exc}") from exc
            return self.local.check(key)
        return 0 if wait_us == 0 else max(1, math.ceil(wait_us / 1_000_000))

    async def close(self) -> None:
        """Close the Redis connection."""
        await self._client.aclose()
