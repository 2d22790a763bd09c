"""clients.resilience without a server: jitter bounds, deadline and attempt exhaustion, what is
retried (never INVALID_ARG or a 4xx), breaker transitions, endpoint choice and failover, and
the clients' use of it (embedding and generation, sync and asyncio, the CLIs' flags). Clock,
sleep and random are injected, so every figure is exact."""

from __future__ import annotations

import asyncio
import io
import time

import aiohttp
import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from clients import AsyncEmbeddingClient, EmbeddingClient, EmbeddingError
from clients.embeddings import ClientOptions, cli
from clients.generation import (
    AsyncGenerationClient,
    GenerationClient,
    GenerationError,
    Piece,
)
from clients.generation import cli as generation_cli
from clients.resilience import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    BreakerPolicy,
    CircuitBreaker,
    EndpointPool,
    Retrier,
    RetryError,
    RetryPolicy,
    is_retryable,
    split_urls,
)


class FakeClock:
    """Time that moves only when slept (or advanced) through it."""

    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


def unavailable(url: str = "a:1") -> InferenceServerException:
    return InferenceServerException(f"failed to connect to {url}", status="StatusCode.UNAVAILABLE")


def retrier(urls=("a:1",), clock=None, rand=0.5, breaker=None, strategy="round_robin", **policy) -> Retrier:
    clock = clock or FakeClock()
    pool = EndpointPool(list(urls), strategy, breaker or BreakerPolicy(), clock)
    return Retrier(pool, RetryPolicy(**policy), clock=clock, sleep=clock.sleep, asleep=clock.asleep, random=lambda: rand)


# --- the policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rand", [0.0, 0.25, 0.999999])
def test_full_jitter_stays_inside_the_exponential_ceiling(rand):
    policy = RetryPolicy(base_s=0.05, cap_s=1.0)
    for retry in range(1, 12):
        ceiling = min(1.0, 0.05 * 2 ** (retry - 1))
        backoff = policy.backoff_s(retry, rand)
        assert 0.0 <= backoff <= ceiling
        assert backoff == pytest.approx(rand * ceiling)
    assert policy.backoff_s(30, 0.999999) <= 1.0  # capped, not 2**29 * base


def test_backoff_sleeps_grow_and_the_call_succeeds_after_transient_failures():
    clock = FakeClock()
    r = retrier(clock=clock, rand=0.5, max_attempts=4)
    outcomes = [unavailable(), ConnectionRefusedError(111, "Connection refused"), InferenceServerException("busy", status="503")]

    def fn(url, timeout_s):
        if outcomes:
            raise outcomes.pop(0)
        return "ok"

    assert r.call(fn) == "ok"
    assert clock.sleeps == pytest.approx([0.025, 0.05, 0.1])  # 0.5 x (50, 100, 200 ms)
    assert r.retries == 3
    assert r.pool.stats()["a:1"] == {"attempts": 4, "successes": 1, "failures": 3, "state": CLOSED, "opened": 0, "closed": 0}


def test_deadline_bounds_attempts_and_sleeps_and_names_itself():
    clock = FakeClock()
    r = retrier(clock=clock, rand=0.999, max_attempts=50, base_s=0.1, cap_s=0.4, deadline_s=1.0)
    timeouts = []

    def fn(url, timeout_s):
        timeouts.append(timeout_s)
        clock.now += 0.15  # each attempt takes 150 ms, then fails
        raise unavailable()

    with pytest.raises(RetryError) as info:
        r.call(fn, timeout_s=0.5)
    err = info.value
    assert err.reason == "deadline" and err.deadline_s == 1.0
    assert err.elapsed_s <= 1.0 and clock.now - 100.0 <= 1.0  # never past the deadline
    # 0.15 + 0.0999 + 0.15 + 0.1998 + 0.15 = 0.7497 s; the next sleep (0.3996) would pass 1 s.
    assert err.attempts == len(timeouts) == 3 and clock.sleeps == pytest.approx([0.0999, 0.1998])
    # Each attempt gets the call's timeout or what is left of the deadline, whichever is less.
    assert timeouts[0] == 0.5 and all(t <= 0.5 for t in timeouts) and timeouts[-1] < timeouts[0]
    assert "gave up after 3 attempts" in str(err) and "deadline 1 s exhausted" in str(err)
    assert isinstance(err.last, InferenceServerException)


def test_attempts_run_out_before_the_deadline():
    r = retrier(max_attempts=3, deadline_s=60.0)
    calls = []
    with pytest.raises(RetryError) as info:
        r.call(lambda url, t: calls.append(url) or (_ for _ in ()).throw(unavailable()))
    assert (info.value.reason, info.value.attempts, len(calls)) == ("attempts", 3, 3)
    assert "gave up after 3 attempts" in str(info.value)


@pytest.mark.parametrize("status", ["StatusCode.INVALID_ARGUMENT", "400", "404", "429", "StatusCode.NOT_FOUND"])
def test_invalid_arg_and_4xx_are_never_retried(status):
    r = retrier(max_attempts=5)
    calls = []

    def fn(url, timeout_s):
        calls.append(url)
        # Even with the words of a rejection in it, a 4xx is the request's fault.
        raise InferenceServerException("TEXT[0]: text is empty (unavailable words do not matter)", status=status)

    with pytest.raises(InferenceServerException):
        r.call(fn)
    assert len(calls) == 1 and r.retries == 0
    assert r.pool.endpoints[0].breaker.state == CLOSED and r.pool.endpoints[0].failures == 0


def test_what_is_retried():
    refused = ConnectionRefusedError(111, "Connection refused")
    wrapped = EmbeddingError("cannot reach the http server at a:1: refused")
    wrapped.__cause__ = refused
    yes = [
        unavailable(),
        InferenceServerException("down", status="503"),
        InferenceServerException("bad gateway", status="502"),
        InferenceServerException("slow", status="StatusCode.DEADLINE_EXCEEDED"),
        InferenceServerException("Exceeds maximum queue size", status="500"),
        refused,
        ConnectionResetError(104, "reset"),
        TimeoutError(),
        wrapped,
        aiohttp.ServerDisconnectedError(),
        GenerationError("text_generation: overloaded: waiting queue full"),  # from a stream: no status
        EmbeddingError("m", status="StatusCode.UNAVAILABLE"),
    ]
    no = [
        InferenceServerException("TEXT[0]: text is empty", status="400"),
        InferenceServerException("bad", status="StatusCode.INVALID_ARGUMENT"),
        InferenceServerException("internal error: boom", status="500"),
        EmbeddingError("text is empty", status="400"),
        GenerationError("max_tokens must be >= 1, got 0", status="400"),
        ValueError("a bug"),
        asyncio.CancelledError(),
        KeyboardInterrupt(),
        FileNotFoundError("x"),
    ]
    assert [is_retryable(e) for e in yes] == [True] * len(yes)
    assert [is_retryable(e) for e in no] == [False] * len(no)


def test_policy_and_urls_are_checked():
    for bad in (dict(max_attempts=0), dict(base_s=-1), dict(base_s=2, cap_s=1), dict(deadline_s=0)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)
    assert RetryPolicy.create(retries=0).max_attempts == 1 and RetryPolicy.create().max_attempts == 4
    with pytest.raises(ValueError):
        RetryPolicy.create(retries=-1)
    assert split_urls(["a:1,b:2", " c:3 ", ""]) == ["a:1", "b:2", "c:3"] and split_urls(None) == []
    with pytest.raises(ValueError):
        EndpointPool([])
    with pytest.raises(ValueError):
        EndpointPool(["a:1"], strategy="random")


# --- the breaker and the pool -------------------------------------------------------------------


def test_breaker_closed_open_half_open_closed():
    clock = FakeClock()
    b = CircuitBreaker(BreakerPolicy(failure_threshold=3, cooldown_s=2.0), clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # a success resets the count: failures must be consecutive
    b.record_failure()
    b.record_failure()
    assert b.state == CLOSED and b.allow()
    b.record_failure()
    assert b.state == OPEN and not b.allow() and b.ready_in() == pytest.approx(2.0)
    clock.now += 1.999
    assert not b.allow()
    clock.now += 0.001
    assert b.state == HALF_OPEN
    assert b.allow() and not b.allow()  # one probe at a time
    assert b.ready_in() == float("inf")
    b.record_failure()  # the probe failed: open again, for a full cool-down
    assert b.state == OPEN and b.ready_in() == pytest.approx(2.0)
    clock.now += 2.0
    assert b.allow()
    b.release()  # a cancelled probe gives its slot back
    assert b.allow()
    b.record_success()
    assert b.state == CLOSED and b.allow()
    assert [t for _, _, t in b.transitions] == [OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]
    assert (b.count(OPEN), b.count(CLOSED)) == (2, 1)


def test_pool_round_robin_first_healthy_and_skipping_open_breakers():
    clock = FakeClock()
    pool = EndpointPool(["a:1", "b:2", "c:3", "a:1"], "round_robin", BreakerPolicy(1, 5.0), clock)
    assert pool.urls == ["a:1", "b:2", "c:3"]
    assert [pool.acquire().url for _ in range(6)] == ["a:1", "b:2", "c:3"] * 2
    b = pool.endpoints[1]
    b.breaker.record_failure()  # threshold 1: open
    assert [pool.acquire().url for _ in range(4)] == ["a:1", "c:3", "c:3", "a:1"]
    # The endpoint that just failed is the last choice.
    a = pool.endpoints[0]
    assert all(pool.acquire(avoid=a).url == "c:3" for _ in range(3))
    first = EndpointPool(["a:1", "b:2"], "first_healthy", BreakerPolicy(1, 5.0), clock)
    assert {first.acquire().url for _ in range(3)} == {"a:1"}
    first.endpoints[0].breaker.record_failure()
    assert first.acquire().url == "b:2"
    first.endpoints[1].breaker.record_failure()
    assert first.acquire() is None and first.ready_in() == pytest.approx(5.0)


def test_failover_moves_calls_to_the_survivor_and_the_breaker_closes_when_it_is_back():
    clock = FakeClock()
    r = retrier(urls=("a:1", "b:2"), clock=clock, breaker=BreakerPolicy(3, 2.0), max_attempts=3, deadline_s=5.0)
    down = {"b:2"}
    sent = []

    def fn(url, timeout_s):
        sent.append(url)
        clock.now += 0.01
        if url in down:
            raise unavailable(url)
        return url

    answered = [r.call(fn) for _ in range(20)]
    assert answered == ["a:1"] * 20  # zero failed calls
    b = r.pool.stats()["b:2"]
    assert b["state"] == OPEN and b["opened"] == 1 and b["failures"] == 3
    assert sent.count("b:2") == 3  # skipped once open
    down.clear()
    clock.now += 2.0  # the cool-down: the next call to b probes it
    answered = [r.call(fn) for _ in range(4)]
    assert "b:2" in answered and r.pool.stats()["b:2"]["state"] == CLOSED and r.pool.stats()["b:2"]["closed"] == 1


def test_every_breaker_open_waits_for_the_cool_down_within_the_deadline():
    clock = FakeClock()
    r = retrier(urls=("a:1",), clock=clock, breaker=BreakerPolicy(1, 0.5), max_attempts=4, deadline_s=2.0)
    r.pool.endpoints[0].breaker.record_failure()
    assert r.call(lambda url, t: "ok") == "ok"  # waited out the 0.5 s cool-down, then probed
    assert clock.sleeps == [pytest.approx(0.5)]
    short = retrier(urls=("a:1",), clock=clock, breaker=BreakerPolicy(1, 5.0), deadline_s=1.0)
    short.pool.endpoints[0].breaker.record_failure()
    before = clock.now
    with pytest.raises(RetryError) as info:
        short.call(lambda url, t: "never")
    assert info.value.reason == "open" and clock.now == before  # no pointless wait
    assert "circuit breaker is open" in str(info.value)


def test_calls_queued_behind_a_probe_wait_for_it_without_spending_attempts():
    """One endpoint (a front door), its breaker half-open with another call's probe in flight:
    a call looks again every base_s without spending its attempts, and is served once the
    probe closes the breaker (it gave up after three looks, 150 ms, before)."""
    clock = FakeClock()
    r = retrier(urls=("a:1",), clock=clock, breaker=BreakerPolicy(1, 0.5), max_attempts=4)
    breaker = r.pool.endpoints[0].breaker
    breaker.record_failure()
    clock.now += 0.5
    assert breaker.allow()  # the probe slot is taken by someone else's call
    looks = []

    def sleep(seconds):
        clock.sleep(seconds)
        looks.append(seconds)
        if len(looks) == 10:  # the probe succeeds after 10 looks (0.5 s)
            breaker.record_success()

    r.sleep = sleep
    assert r.call(lambda url, t: "ok") == "ok"
    assert len(looks) == 10 and r.pool.endpoints[0].successes == 1
    # without a deadline the looks are bounded by the cool-downs the attempts would have waited
    stuck = retrier(urls=("a:1",), clock=clock, breaker=BreakerPolicy(1, 0.5), max_attempts=4)
    stuck.pool.endpoints[0].breaker.record_failure()
    clock.now += 0.5
    assert stuck.pool.endpoints[0].breaker.allow()  # a probe that never returns
    before = clock.now
    with pytest.raises(RetryError) as info:
        stuck.call(lambda url, t: "never")
    assert info.value.reason == "open" and 1.9 <= clock.now - before <= 2.1
    # with a deadline, the deadline bounds them
    timed = retrier(urls=("a:1",), clock=clock, breaker=BreakerPolicy(1, 0.5), max_attempts=4, deadline_s=0.3)
    timed.pool.endpoints[0].breaker.record_failure()
    clock.now += 0.5
    assert timed.pool.endpoints[0].breaker.allow()
    before = clock.now
    with pytest.raises(RetryError):
        timed.call(lambda url, t: "never")
    assert clock.now - before <= 0.3


def test_async_retries_and_cuts_a_hung_attempt_at_the_deadline():
    async def go():
        clock = FakeClock()
        r = retrier(urls=("a:1", "b:2"), clock=clock, max_attempts=3)

        async def fn(url, timeout_s):
            if url == "a:1":
                raise unavailable(url)
            return url

        assert await r.acall(fn) == "b:2" and r.retries == 1
        # A real clock: an attempt that never answers is cut at the remaining deadline.
        real = Retrier(EndpointPool(["a:1"]), RetryPolicy(max_attempts=10, deadline_s=0.3))

        async def hang(url, timeout_s):
            await asyncio.sleep(30)

        start = time.monotonic()
        with pytest.raises(RetryError) as info:
            await real.acall(hang)
        return time.monotonic() - start, info.value

    elapsed, err = asyncio.run(go())
    assert err.reason == "deadline" and isinstance(err.last, TimeoutError)
    # cut at the 0.3 s deadline: not before it, and far before the 30 s the attempt would hang
    assert 0.25 <= elapsed < 10.0, elapsed


# --- the clients --------------------------------------------------------------------------------


class Result:
    def __init__(self, n):
        self.n = n

    def as_numpy(self, name):
        return np.ones((self.n, 4), dtype=np.float32) if name == "EMBEDDING" else None


class Transport:
    """A tritonclient stand-in that raises ``errors`` in turn, then answers."""

    def __init__(self, *errors):
        self.errors = list(errors)
        self.calls = 0

    def infer(self, model, inputs, outputs=None, **kwargs):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return Result(inputs[0].shape()[0])

    async def ainfer(self, *args, **kwargs):
        return self.infer(*args, **kwargs)

    def close(self):
        pass


def no_sleep(**policy) -> RetryPolicy:
    return RetryPolicy(base_s=0.0, cap_s=0.0, **policy)


def test_sync_embedding_client_fails_over_and_reports_attempts():
    with EmbeddingClient("a:1,b:2", policy=no_sleep(max_attempts=3)) as client:
        a, b = Transport(*[unavailable()] * 10), Transport()
        client._clients.update({"a:1": a, "b:2": b})
        out = client.embed(["x", "y"])
        assert out.shape == (2, 4) and (a.calls, b.calls) == (1, 1) and client.retrier.retries == 1
        assert repr(client).startswith("EmbeddingClient(http://a:1,b:2")
        b.errors = [unavailable()] * 10
        with pytest.raises(EmbeddingError) as info:
            client.embed(["x"])
    err = info.value
    assert err.attempts == 3 and err.status == "StatusCode.UNAVAILABLE"
    assert "gave up after 3 attempts" in str(err) and "cannot reach" in str(err)


def test_sync_embedding_client_does_not_retry_a_refused_text():
    with EmbeddingClient(["a:1", "b:2"], policy=no_sleep()) as client:
        a = Transport(InferenceServerException("TEXT[0]: text is empty", status="400"))
        client._clients.update({"a:1": a, "b:2": a})
        with pytest.raises(EmbeddingError) as info:
            client.embed([""])
    assert a.calls == 1 and info.value.attempts is None and info.value.status == "400"


def test_async_embedding_client_fails_over_under_concurrency():
    async def go():
        async with AsyncEmbeddingClient(["a:1", "b:2"], protocol="grpc", policy=no_sleep(max_attempts=2)) as client:
            a, b = Transport(*[unavailable()] * 1000), Transport()
            for url, t in (("a:1", a), ("b:2", b)):
                fake = type("F", (), {"infer": t.ainfer, "close": lambda self: asyncio.sleep(0)})()
                client._clients[url] = fake
            results = await client.embed_many([f"t{i}" for i in range(40)], concurrency=8, return_exceptions=True)
            return results, client.retrier.stats()

    results, stats = asyncio.run(go())
    assert all(isinstance(r, np.ndarray) for r in results)
    assert stats["endpoints"]["a:1"]["state"] == OPEN and stats["endpoints"]["b:2"]["successes"] == 40


def test_client_options_take_several_urls_retries_and_deadline():
    o = ClientOptions.create(["http://a:1/", "b:2,a:1"], retries=2, deadline_s=3.0)
    assert (o.url, o.urls, o.retries, o.deadline_s) == ("a:1", ("a:1", "b:2"), 2, 3.0)
    for bad in (dict(retries=-1), dict(deadline_s=0), dict(url="a:1,https://b:2")):
        with pytest.raises(ValueError):
            ClientOptions.create(**bad)
    client = EmbeddingClient("a:1", timeout_s=2.0)
    assert client.retrier.policy.deadline_s == 2.0 and client.retrier.policy.max_attempts == 4  # deadline = timeout
    client.close()


class FakeGenStreams:
    """Replaces a GenerationClient's per-attempt stream: each attempt pops a script of pieces
    and exceptions."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)
        self.urls = []

    def sync(self, request, stream, url=None, timeout_s=None):
        self.urls.append(url)
        script = self.scripts.pop(0)

        def pieces():
            for item in script:
                if isinstance(item, BaseException):
                    raise item
                yield item

        return pieces(), lambda: None

    def aio(self, client, request, stream, url=None, timeout_s=None):
        self.urls.append(url)
        script = self.scripts.pop(0)

        async def pieces():
            for item in script:
                if isinstance(item, BaseException):
                    raise item
                yield item

        async def cancel():
            pass

        return pieces(), cancel


def gone(url="a:1"):
    return GenerationError(f"cannot reach the grpc server at {url}", status="StatusCode.UNAVAILABLE")


def test_generation_stream_is_retried_only_before_its_first_piece():
    fake = FakeGenStreams([gone()], [Piece("Hel"), Piece("lo", "stop")])
    client = GenerationClient("a:1,b:2", policy=no_sleep())
    client._grpc_stream = fake.sync
    assert "".join(client.stream("hi")) == "Hello" and fake.urls == ["a:1", "b:2"]
    fake = FakeGenStreams([Piece("Hel"), gone("b:2")], [Piece("never")])
    client._grpc_stream = fake.sync
    with pytest.raises(GenerationError, match="cannot reach"):
        list(client.stream("hi"))
    assert len(fake.urls) == 1  # after the first token the error is the caller's
    fake = FakeGenStreams([GenerationError("max_tokens must be >= 1, got 0", status="StatusCode.INVALID_ARGUMENT")])
    client._grpc_stream = fake.sync
    with pytest.raises(GenerationError, match="max_tokens"):
        client.generate("hi", max_tokens=0)
    assert len(fake.urls) == 1
    client.close()


def test_async_generation_stream_is_retried_only_before_its_first_piece():
    async def go():
        client = AsyncGenerationClient(["a:1", "b:2"], policy=no_sleep(max_attempts=2))
        client._clients = {"a:1": object(), "b:2": object()}
        fake = FakeGenStreams([gone()], [Piece("Hi", "stop")])
        client._grpc_stream = fake.aio
        answer = await client.generate("hi")
        fake2 = FakeGenStreams([Piece("Hi"), gone()], [Piece("never")])
        client._grpc_stream = fake2.aio
        with pytest.raises(GenerationError):
            async for _ in client.stream("hi"):
                pass
        fake3 = FakeGenStreams([gone()], [gone("b:2")])
        client._grpc_stream = fake3.aio
        with pytest.raises(GenerationError) as info:
            await client.generate("hi")
        client._clients = {}
        return answer, fake.urls, fake2.urls, info.value

    answer, urls, urls2, err = asyncio.run(go())
    assert answer.text == "Hi" and urls == ["a:1", "b:2"] and len(urls2) == 1
    assert err.attempts == 2 and "gave up after 2 attempts" in str(err)


def test_cli_flags_several_urls_retries_deadline(monkeypatch, capsys):
    made = []

    class Fake:
        def __init__(self, **kwargs):
            ClientOptions.create(**kwargs)
            made.append(kwargs)

        def embed(self, texts):
            return np.ones((len(texts), 4), dtype=np.float32)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(cli, "EmbeddingClient", Fake)
    assert cli.main(["--url", "a:1", "--url", "b:2,c:3", "--retries", "1", "--deadline", "2.5", "x"]) == 0
    assert ClientOptions.create(made[0]["url"]).urls == ("a:1", "b:2", "c:3")
    assert (made[0]["retries"], made[0]["deadline_s"]) == (1, 2.5)
    for bad in (["--retries", "-1", "x"], ["--deadline", "0", "x"]):
        assert cli.main(bad) == 2
    err = io.StringIO()
    assert generation_cli.main(["generate", "hi", "--retries", "-1"], stdout=io.StringIO(), stderr=err) == 2
    assert "--retries" in err.getvalue()
    args = generation_cli.build_parser().parse_args(["chat", "hi", "--url", "a:1", "--url", "b:2", "--deadline", "3"])
    assert args.url == ["a:1", "b:2"] and args.deadline == 3.0
    capsys.readouterr()
