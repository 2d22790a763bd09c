"""L2 against a real redis-server (started per test on a free port): pipelined MGET/SET with
TTL, binary float32 values, garbage replies, Redis killed, stopped (slow) and restarted."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import redis

from python_backends.cache.keys import KeyMaker, ModelIdentity
from python_backends.cache.lru import LRUCache
from python_backends.cache.redis_l2 import RedisL2
from python_backends.cache.tiered import EmbeddingCache

DIM = 384
KEYS = KeyMaker(ModelIdentity("text_embedding", "text_encoder", "1", "int8", "abcd"))


# Tests of what L2 stores and answers, not of its timeout: the 50 ms default made one fail on
# a machine at load average 7 (a stall read as a miss). The timeout tests set their own.
CORRECTNESS_TIMEOUT_S = 2.0


def vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def raw_client(server) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def commands(client: redis.Redis) -> dict[str, int]:
    return {k: v["calls"] for k, v in client.info("commandstats").items()}


class Clock:
    """The L2's clock for its retry and warning intervals, moved by the test (Redis's own
    timeouts stay real): "inside the retry interval" no longer depends on how busy the machine is."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def until(check, timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def retried(clock: Clock, l2: RedisL2, attempt):
    """``attempt()``'s result from the first try that found Redis answering, the clock moved
    past the retry interval before each: a real 50 ms timeout may expire on a busy machine."""
    deadline = time.monotonic() + 30
    while True:
        clock.advance(l2.retry_interval_s + 0.01)
        result = attempt()
        if l2.stats.up:
            return result
        assert time.monotonic() < deadline, f"Redis did not answer within 50 ms once in 30 s: {l2.stats}"
        time.sleep(0.05)


def test_round_trip_is_bit_exact_with_one_mget_and_one_pipeline(redis_server):
    l2 = RedisL2(redis_server.url, DIM, ttl_s=60, timeout_s=CORRECTNESS_TIMEOUT_S)
    client = raw_client(redis_server)
    keys = [KEYS(f"text {i}") for i in range(10)]
    l2.set_many([(k, vec(i)) for i, k in enumerate(keys)])
    got = l2.get_many(keys + [KEYS("never stored")])
    assert all(np.array_equal(got[i], vec(i)) for i in range(10)) and got[10] is None
    assert got[0].dtype == np.float32
    stats = commands(client)
    assert stats["cmdstat_mget"] == 1 and stats["cmdstat_set"] == 10  # SETs sent in one pipeline
    assert client.get(keys[0]) == vec(0).astype("<f4").tobytes()  # binary float32, 1536 bytes
    assert 55 <= client.ttl(keys[0]) <= 60
    assert (l2.stats.hits, l2.stats.misses) == (10, 1)


def test_ttl_expiry(redis_server):
    l2 = RedisL2(redis_server.url, DIM, ttl_s=2, timeout_s=CORRECTNESS_TIMEOUT_S)
    l2.set_many([(KEYS("a"), vec(1))])
    assert 0 < raw_client(redis_server).pttl(KEYS("a")) <= 2000  # written with the TTL
    assert l2.get_many([KEYS("a")])[0] is not None
    assert until(lambda: l2.get_many([KEYS("a")])[0] is None, timeout=30), "still there 30 s after a 2 s TTL"


@pytest.mark.parametrize(
    "value, detail",
    [
        (b"not a vector", "is 12 bytes, expected 1536"),
        (np.full(DIM, np.nan, dtype="<f4").tobytes(), "NaN or infinity"),
        (vec(1).astype("<f8").tobytes(), "is 3072 bytes"),
    ],
)
def test_garbage_values_are_misses_counted_and_warned(redis_server, caplog, value, detail):
    raw_client(redis_server).set(KEYS("a"), value)
    l2 = RedisL2(redis_server.url, DIM, ttl_s=60, timeout_s=CORRECTNESS_TIMEOUT_S)
    with caplog.at_level(logging.WARNING, logger="python_backends.cache.redis_l2"):
        assert l2.get_many([KEYS("a")]) == [None]
    assert l2.stats.errors["garbage"] == 1 and l2.stats.misses == 1
    assert detail in caplog.text


def test_wrong_type_reply_is_not_fatal(redis_server):
    client = raw_client(redis_server)
    client.set(KEYS("a"), vec(1).astype("<f4").tobytes())
    client.rpush(KEYS("list"), "x")  # MGET answers nil for a key of another type
    l2 = RedisL2(redis_server.url, DIM, ttl_s=60, timeout_s=CORRECTNESS_TIMEOUT_S)
    got = l2.get_many([KEYS("a"), KEYS("list")])
    assert np.array_equal(got[0], vec(1)) and got[1] is None


def test_killed_then_restarted_redis_is_used_again_without_a_restart(redis_server, caplog):
    # A refused connection fails at once whatever the timeout: the correctness timeout keeps a
    # stall on a busy machine from reading as a failure where the test needs Redis to answer.
    clock = Clock()
    l2 = RedisL2(
        redis_server.url, DIM, ttl_s=60, timeout_s=CORRECTNESS_TIMEOUT_S, retry_interval_s=0.3, warn_interval_s=60, clock=clock
    )
    cache = EmbeddingCache(DIM, LRUCache(0, 0), l2)  # L1 off: every lookup reaches L2
    l2.set_many([(KEYS("a"), vec(1))])
    assert cache.plan(["a"], [KEYS("a")]).counts.l2_hits == 1

    caplog.set_level(logging.WARNING, logger="python_backends.cache.redis_l2")
    redis_server.kill()
    t = time.perf_counter()
    plan = cache.plan(["a", "b"], [KEYS("a"), KEYS("b")])
    assert time.perf_counter() - t < CORRECTNESS_TIMEOUT_S  # refused at once, not waited for
    assert plan.miss_texts == ["a", "b"]  # the request goes on to the model
    assert l2.stats.errors["connection"] == 1 and not l2.stats.up  # one attempt: no retries
    cache.fill(plan, np.stack([vec(1), vec(2)]))  # writes while down: skipped, no error
    for _ in range(5):  # inside the retry interval: Redis is not even tried
        clock.advance(0.05)
        cache.plan(["a"], [KEYS("a")])
    assert l2.stats.errors["connection"] == 1 and l2.stats.skipped >= 5
    clock.advance(0.3)  # past the retry interval
    cache.plan(["a"], [KEYS("a")])  # tried again, still down
    assert l2.stats.errors["connection"] == 2
    warnings = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1  # once per warn interval, not once per failure
    assert "serving without L2" in warnings[0].getMessage()

    redis_server.restart()  # same port, empty (nothing was persisted)
    cache.plan(["a"], [KEYS("a")])
    assert l2.stats.errors["connection"] == 2 and l2.stats.skipped >= 6  # still inside the interval
    clock.advance(0.3)
    plan = cache.plan(["a"], [KEYS("a")])
    assert plan.miss_texts == ["a"] and l2.stats.up
    cache.fill(plan, vec(1)[None])
    assert cache.plan(["a"], [KEYS("a")]).counts.l2_hits == 1  # L2 serves again
    assert any("is back" in r.getMessage() for r in caplog.records)


def test_stopped_redis_times_out_within_the_bound(redis_server):
    clock = Clock()
    l2 = RedisL2(redis_server.url, DIM, ttl_s=60, timeout_s=0.05, retry_interval_s=0.2, clock=clock)
    raw_client(redis_server).set(KEYS("a"), vec(1).astype("<f4").tobytes())
    assert retried(clock, l2, lambda: l2.get_many([KEYS("a")]))[0] is not None
    timeouts = l2.stats.errors["timeout"]
    redis_server.pause()  # accepts nothing, answers nothing: a hung or overloaded Redis
    try:
        clock.advance(1.0)
        t = time.perf_counter()
        assert l2.get_many([KEYS("a")]) == [None]
        took = time.perf_counter() - t
        # the 50 ms timeout, once: a client without one waits for as long as Redis is stopped
        assert 0.04 <= took < 3.0, took
        assert l2.stats.errors["timeout"] == timeouts + 1
        clock.advance(0.1)
        l2.set_many([(KEYS("b"), vec(2))])  # inside the retry interval: not even sent
        assert l2.stats.errors["timeout"] == timeouts + 1  # a SET sent to the stopped Redis would time out
    finally:
        redis_server.resume()
    assert raw_client(redis_server).get(KEYS("b")) is None  # nor queued for later
    assert retried(clock, l2, lambda: l2.get_many([KEYS("a")]))[0] is not None  # used again, no restart


def test_l2_hits_are_promoted_to_l1(redis_server):
    l2 = RedisL2(redis_server.url, DIM, ttl_s=60, timeout_s=CORRECTNESS_TIMEOUT_S)
    cache = EmbeddingCache(DIM, LRUCache(1 << 20, 0), l2)
    l2.set_many([(KEYS("a"), vec(1))])
    first = cache.plan(["a", "b"], [KEYS("a"), KEYS("b")])
    assert (first.counts.l1_hits, first.counts.l2_hits, first.counts.misses) == (0, 1, 1)
    second = cache.plan(["a"], [KEYS("a")])
    assert (second.counts.l1_hits, second.counts.l2_hits) == (1, 0)


def test_password_is_not_logged(caplog):
    from python_backends.redaction import redact_url

    assert redact_url("redis://user:secret@host:6379/0") == "redis://***@host:6379/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
    assert redact_url("redis://user:p@ss@host:6379/0") == "redis://***@host:6379/0"  # '@' in the password
