"""openai_gateway.ratelimit.SharedRateLimiter against a real redis-server: two limiters sharing
one Redis (two gateways) apply one bucket per key between them; Redis down fails open to each
gateway's own bucket, or closed with RateLimiterUnavailable."""

from __future__ import annotations

import asyncio
import time

import pytest

from openai_gateway.ratelimit import FAIL_CLOSED, RateLimiter, RateLimiterUnavailable, SharedRateLimiter


async def _take(limiters, key: str, n: int) -> list[int]:
    return [await limiters[i % len(limiters)].check(key) for i in range(n)]


def test_two_gateways_share_one_bucket_per_key(redis_server):
    async def run():
        # A generous timeout: on a loaded machine the default 0.25 s ran out, and the fallback
        # (each gateway's own bucket) decided instead of the shared one.
        a = SharedRateLimiter(redis_server.url, rate=2.0, burst=10, timeout_s=10.0)
        b = SharedRateLimiter(redis_server.url, rate=2.0, burst=10, timeout_s=10.0)
        try:
            started = time.monotonic()
            answers = await _take([a, b], "key-1", 19)
            last_asked = time.monotonic()  # before the last check of the drain: an upper bound of the time since
            answers.append(await b.check("key-1"))
            refilled = int((time.monotonic() - started) * 2.0) + 1  # tokens back while asking (a busy machine)
            # One bucket between them: the burst of 10 in all (each alone would allow 10: 20).
            assert 10 <= sum(1 for r in answers if r == 0) <= 10 + refilled, answers
            assert answers[:10] == [0] * 10 and all(r >= 1 for r in answers[-5:])  # Retry-After in whole seconds
            # Another key has its own bucket.
            assert await a.check("key-2") == 0
            await asyncio.sleep(1.1)  # 2 tokens per second come back, to whichever gateway asks
            again = await _take([b, a], "key-1", 4)
            # The drain ended refused (under 1 token left); 1.1 s later at least 2.2 more are there,
            # and at most 2 per second since that last refusal (3 when nothing stalled).
            back = int((time.monotonic() - last_asked) * 2.0) + 1
            assert 2 <= sum(1 for r in again if r == 0) <= min(4, back), (again, back)
            assert again[:2] == [0, 0], again
            assert a.redis_errors == b.redis_errors == 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


def test_concurrent_checks_from_two_gateways_never_overdraw(redis_server):
    async def run():
        # A generous timeout: 80 calls at once on a loaded machine took longer than the default
        # 0.25 s, and each timeout fell back (fail open) to that gateway's own bucket of 25.
        a = SharedRateLimiter(redis_server.url, rate=0.01, burst=25, timeout_s=10.0)
        b = SharedRateLimiter(redis_server.url, rate=0.01, burst=25, timeout_s=10.0)
        try:
            answers = await asyncio.gather(*(lim.check("burst") for _ in range(40) for lim in (a, b)))
            assert a.redis_errors == b.redis_errors == 0, "Redis did not answer: the fallback decided, not the script"
            assert sum(1 for r in answers if r == 0) == 25  # the script is atomic: no race
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


def test_redis_down_fails_open_to_the_gateways_own_bucket_or_closed(redis_server):
    async def run():
        open_ = SharedRateLimiter(redis_server.url, rate=0.01, burst=3, timeout_s=0.2)
        closed = SharedRateLimiter(redis_server.url, rate=1.0, burst=3, timeout_s=0.2, fail=FAIL_CLOSED)
        try:
            assert await open_.check("k") == 0
            redis_server.kill()
            answers = await _take([open_], "k", 5)
            assert answers[:3] == [0, 0, 0] and all(r >= 1 for r in answers[3:])  # the local burst of 3
            assert open_.redis_errors == 5
            with pytest.raises(RateLimiterUnavailable, match="unavailable"):
                await closed.check("k")
            assert closed.redis_errors == 1
        finally:
            await open_.close()
            await closed.close()

    asyncio.run(run())


def test_off_and_bad_settings():
    with pytest.raises(ValueError, match="fail mode"):
        SharedRateLimiter("redis://127.0.0.1:1/0", rate=1.0, burst=1, fail="sometimes")
    off = SharedRateLimiter("redis://127.0.0.1:1/0", rate=0.0, burst=1)
    assert not off.enabled and asyncio.run(off.check("k")) == 0
    assert RateLimiter(0, 1).check("k") == 0
