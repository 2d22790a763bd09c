"""Retries, circuit breakers and failover for the project's clients (sync and asyncio).

One policy for every client (``clients.embeddings``, ``clients.generation``, sync and asyncio):

- **RetryPolicy**: a failed attempt that the server did not refuse on its merits (gRPC
  UNAVAILABLE, HTTP 502/503/504, a refused, reset or dropped connection, a timed-out attempt,
  the server's own "unavailable" / queue-full rejection) is tried again after a backoff with
  full jitter, ``uniform(0, min(cap, base * 2**(n-1)))`` before retry ``n``, at most
  ``max_attempts`` attempts in all, and never past the call's deadline, which bounds the sum
  of attempts and sleeps. INVALID_ARG, other 4xx and everything else are raised at once.
- **CircuitBreaker**, one per endpoint: closed; open after ``failure_threshold`` consecutive
  failures (an open endpoint is skipped); after ``cooldown_s`` half-open, where one request
  probes it: success closes the breaker, failure opens it again.
- **EndpointPool**: several URLs of equivalent servers, taken round-robin (or the first
  healthy one, for a primary and its standbys), skipping open breakers; a retry goes to
  another endpoint than the one that just failed when there is one.

``Retrier.call(fn)`` / ``await Retrier.acall(fn)`` run ``fn(url, attempt_timeout_s)`` under
the policy. Clock, sleep and random source are injectable, so the tests are deterministic.
"""

from __future__ import annotations

import asyncio
import logging
import random as _random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from contract.errors import CODES, OVERLOADED, UNAVAILABLE, error_data
from contract.prose import says_retry

log = logging.getLogger(__name__)

T = TypeVar("T")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STRATEGIES = ("round_robin", "first_healthy")
# HTTP statuses that say "this server cannot take it now", not "the request is wrong".
RETRY_HTTP_STATUSES = frozenset({"502", "503", "504"})
RETRY_GRPC_STATUSES = frozenset({"StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a call is tried. ``deadline_s`` None: bounded by attempts only."""

    max_attempts: int = 4
    base_s: float = 0.05
    cap_s: float = 1.0
    deadline_s: float | None = None

    def __post_init__(self):
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, not {self.max_attempts!r}")
        if not self.base_s >= 0 or not self.cap_s >= self.base_s:
            raise ValueError(f"backoff needs 0 <= base_s <= cap_s, got base_s={self.base_s}, cap_s={self.cap_s}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds, not {self.deadline_s}")

    def backoff_s(self, retry: int, rand: float) -> float:
        """The sleep before retry number ``retry`` (1 = the first retry): full jitter, ``rand``
        in [0, 1) scales the exponential ceiling."""
        ceiling = min(self.cap_s, self.base_s * 2 ** (retry - 1))
        return rand * ceiling

    @classmethod
    def create(cls, retries: int | None = None, deadline_s: float | None = None) -> RetryPolicy:
        """The default policy with ``retries`` retries (attempts = retries + 1) and a deadline."""
        if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
            raise ValueError(f"retries must be an int >= 0, not {retries!r}")
        return cls(max_attempts=cls.max_attempts if retries is None else retries + 1, deadline_s=deadline_s)


@dataclass(frozen=True)
class BreakerPolicy:
    failure_threshold: int = 5
    cooldown_s: float = 2.0

    def __post_init__(self):
        if isinstance(self.failure_threshold, bool) or not isinstance(self.failure_threshold, int) or self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an int >= 1, not {self.failure_threshold!r}")
        if not self.cooldown_s > 0:
            raise ValueError(f"cooldown_s must be > 0 seconds, not {self.cooldown_s}")


class CircuitBreaker:
    """closed -> open after N consecutive failures -> half-open after the cool-down (one probe)
    -> closed on the probe's success, open again on its failure. Thread-safe."""

    def __init__(self, policy: BreakerPolicy = BreakerPolicy(), clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self.transitions: list[tuple[float, str, str]] = []  # (time, from, to)

    def _move(self, to: str) -> None:
        if to != self._state:
            self.transitions.append((self._clock(), self._state, to))
            self._state = to

    @property
    def state(self) -> str:
        """closed, open, or half_open (the cool-down is over: the next request probes)."""
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.policy.cooldown_s:
                return HALF_OPEN
            return self._state

    def ready_in(self) -> float:
        """Seconds until a request may be sent (0 when it may now)."""
        with self._lock:
            if self._state == CLOSED:
                return 0.0
            if self._state == HALF_OPEN:
                return float("inf") if self._probing else 0.0
            return max(0.0, self._opened_at + self.policy.cooldown_s - self._clock())

    def allow(self) -> bool:
        """May a request go now? In half-open state this takes the one probe slot."""
        if self._state == CLOSED:
            return True  # the common case, without the lock (a stale read lets one more through)
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.policy.cooldown_s:
                self._move(HALF_OPEN)
            if self._state == CLOSED:
                return True
            if self._state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def record_success(self) -> None:
        if self._state == CLOSED and not self._failures:
            return  # nothing to reset: the happy path takes no lock
        with self._lock:
            self._failures = 0
            self._probing = False
            self._move(CLOSED)

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            was_probe, self._probing = self._probing, False
            if was_probe or (self._state == CLOSED and self._failures >= self.policy.failure_threshold):
                self._opened_at = self._clock()
                self._move(OPEN)

    def release(self) -> None:
        """The request ended without telling anything about the server (cancelled, a client-side
        bug): give back a probe slot, count nothing."""
        with self._lock:
            self._probing = False

    def count(self, to: str) -> int:
        """How many times the breaker moved to ``to``."""
        return sum(1 for _, _, t in self.transitions if t == to)


@dataclass
class Endpoint:
    url: str
    breaker: CircuitBreaker
    attempts: int = 0
    successes: int = 0
    failures: int = 0  # retryable failures (the breaker counts these)


class EndpointPool:
    """Equivalent servers; ``acquire`` picks one whose breaker lets a request through."""

    def __init__(
        self,
        urls: Sequence[str],
        strategy: str = "round_robin",
        breaker: BreakerPolicy = BreakerPolicy(),
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(urls, str):
            urls = [urls]
        urls = list(dict.fromkeys(urls))  # the same URL twice is one endpoint
        if not urls:
            raise ValueError("no endpoint URLs")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
        self.strategy = strategy
        self.endpoints = [Endpoint(url, CircuitBreaker(breaker, clock)) for url in urls]
        self._next = 0
        self._lock = threading.Lock()

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    def _order(self) -> list[Endpoint]:
        if self.strategy == "first_healthy":
            return list(self.endpoints)
        with self._lock:
            start = self._next
            self._next = (self._next + 1) % len(self.endpoints)
        return self.endpoints[start:] + self.endpoints[:start]

    def acquire(self, avoid: Endpoint | None = None) -> Endpoint | None:
        """An endpoint to send to now (``avoid``, the one that just failed, only as the last
        choice), or None when every breaker is open."""
        if avoid is None and len(self.endpoints) == 1:
            endpoint = self.endpoints[0]  # one server: no order to work out
            if endpoint.breaker.allow():
                endpoint.attempts += 1
                return endpoint
            return None
        order = self._order()
        if avoid is not None and len(order) > 1:
            order = [e for e in order if e is not avoid] + [avoid]
        for endpoint in order:
            if endpoint.breaker.allow():
                endpoint.attempts += 1
                return endpoint
        return None

    def ready_in(self) -> float:
        """Seconds until some endpoint takes a request again."""
        return min(e.breaker.ready_in() for e in self.endpoints)

    def cooldown_s(self) -> float:
        return max(e.breaker.policy.cooldown_s for e in self.endpoints)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per endpoint: attempts, successes, failures, breaker state, times opened and closed."""
        return {
            e.url: {
                "attempts": e.attempts,
                "successes": e.successes,
                "failures": e.failures,
                "state": e.breaker.state,
                "opened": e.breaker.count(OPEN),
                "closed": e.breaker.count(CLOSED),
            }
            for e in self.endpoints
        }


def _status(exc: BaseException) -> str | None:
    status = getattr(exc, "status", None)
    if callable(status):  # tritonclient's InferenceServerException.status()
        try:
            status = status()
        except Exception:  # noqa: BLE001
            status = None
    return None if status is None else str(status)


def _message(exc: BaseException) -> str:
    message = getattr(exc, "server_message", None)
    if message is None and callable(getattr(exc, "message", None)):
        try:
            message = exc.message()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001
            message = None
    return str(message if message is not None else exc)


def _chain(exc: BaseException | None):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _is_refusal(status: str) -> bool:
    """A status that says the request itself is wrong: HTTP 4xx or a gRPC client-error code."""
    if status.isdigit():
        return 400 <= int(status) < 500
    return (
        status.startswith("StatusCode.")
        and status not in RETRY_GRPC_STATUSES
        and status not in ("StatusCode.INTERNAL", "StatusCode.UNKNOWN")
    )


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) means "try again, maybe elsewhere".

    Yes: gRPC UNAVAILABLE or DEADLINE_EXCEEDED, HTTP 502/503/504, refused/reset/dropped
    connections (OSError, aiohttp's connection errors), timeouts, and the server's own
    unavailable/queue-full rejections. No: a 4xx or any other gRPC code (INVALID_ARG first),
    cancellation, and anything the client itself got wrong.
    """
    if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit, RetryError)):
        return False
    for e in _chain(exc):
        data = error_data(e)  # wherever the protocol carried it (contract/errors.py)
        code = data.code if data is not None else getattr(e, "code", None)
        if isinstance(code, str) and code in CODES:  # the model's error as data: its code decides
            return code in (OVERLOADED, UNAVAILABLE)
        status = _status(e)
        if status is not None:
            if status in RETRY_HTTP_STATUSES or status in RETRY_GRPC_STATUSES:
                return True
            if _is_refusal(status):
                return False  # the server answered: the request is wrong, whatever the words
            # A 500 / INTERNAL that wraps a load-shedding rejection (e.g. through an ensemble).
            return says_retry(_message(e))
        if hasattr(e, "server_message") and says_retry(_message(e)):
            return True  # a rejection read from a stream, which carries no status
        if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        if type(e).__module__.startswith("aiohttp") and any(
            c.__name__ in ("ClientConnectionError", "ServerTimeoutError") for c in type(e).__mro__
        ):
            return True  # refused, reset, server disconnected: aiohttp's own classes
        if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, PermissionError)):
            return True  # socket errors other than ConnectionError (EHOSTUNREACH, ...)
        if type(e).__name__ in ("RemoteDisconnected", "IncompleteRead", "BadStatusLine"):
            return True  # http.client: the server went away mid-answer
    return False


class RetryError(RuntimeError):
    """A call ran out of attempts or deadline; ``last`` is the last attempt's error."""

    def __init__(self, last: BaseException | None, attempts: int, elapsed_s: float, deadline_s: float | None, reason: str):
        self.last = last
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.deadline_s = deadline_s
        self.reason = reason
        super().__init__(f"{describe(attempts, elapsed_s, deadline_s, reason)}: {last}")


def describe(attempts: int, elapsed_s: float, deadline_s: float | None, reason: str) -> str:
    """``gave up after 3 attempts in 1.02 s (deadline 1 s exhausted)`` and the like."""
    plural = "attempt" if attempts == 1 else "attempts"
    text = f"gave up after {attempts} {plural} in {elapsed_s:.2f} s"
    deadline = "no deadline" if deadline_s is None else f"deadline {deadline_s:g} s"
    if reason == "deadline":
        return f"{text} ({deadline} exhausted)"
    if reason == "open":
        return f"{text} (every endpoint's circuit breaker is open; {deadline})"
    return f"{text} ({plural} exhausted; {deadline})"


class _Call:
    """The bookkeeping of one call: attempts, deadline, backoff, breakers."""

    def __init__(self, retrier: Retrier, timeout_s: float | None):
        self.r = retrier
        self.start = retrier.clock()
        self.timeout_s = timeout_s
        self.attempts = 0  # requests sent
        self.waits = 0  # waits for an open breaker; they count against max_attempts too
        self.probe_wait_s = 0.0  # time spent looking while another call's probe was in flight
        self.last: BaseException | None = None
        self.endpoint: Endpoint | None = None

    def elapsed(self) -> float:
        return self.r.clock() - self.start

    def remaining(self) -> float | None:
        d = self.r.policy.deadline_s
        return None if d is None else d - self.elapsed()

    def give_up(self, reason: str) -> RetryError:
        return RetryError(self.last, self.attempts, self.elapsed(), self.r.policy.deadline_s, reason)

    def plan(self) -> tuple[Endpoint | None, float | None]:
        """(endpoint, attempt timeout) for the next attempt, or (None, seconds to wait) when
        every breaker is open; raises RetryError when the call is over."""
        remaining = self.remaining()
        if remaining is not None and remaining <= 0:
            raise self.give_up("deadline")
        endpoint = self.r.pool.acquire(avoid=self.endpoint)
        if endpoint is None:
            wait = self.r.pool.ready_in()
            if wait == float("inf"):
                # A probe is in flight: look again soon. These looks cost no attempt (calls that
                # queued behind one probe gave up after three looks, 150 ms, while the server
                # came back), but their time is bounded: the deadline, else the cool-downs the
                # attempts would have waited.
                wait = max(self.r.policy.base_s, 0.01)
                self.probe_wait_s += wait
                bound = self.r.pool.cooldown_s() * self.r.policy.max_attempts
                if (remaining is not None and wait >= remaining) or (remaining is None and self.probe_wait_s > bound):
                    raise self.give_up("open")
                return None, wait
            # Waiting out an open breaker's cool-down costs an attempt, so a call cannot wait forever.
            self.waits += 1
            if self.attempts + self.waits >= self.r.policy.max_attempts or (remaining is not None and wait >= remaining):
                raise self.give_up("open")
            return None, wait
        self.attempts += 1
        self.endpoint = endpoint
        timeouts = [t for t in (self.timeout_s, remaining) if t is not None]
        return endpoint, (min(timeouts) if timeouts else None)

    def succeeded(self, endpoint: Endpoint) -> None:
        endpoint.successes += 1
        endpoint.breaker.record_success()

    def failed(self, endpoint: Endpoint, exc: BaseException) -> float:
        """The backoff before the next attempt; re-raises ``exc`` when it is not retryable and
        raises RetryError when attempts or deadline are spent."""
        if not is_retryable(exc):
            if isinstance(exc, Exception) and _status(exc) is not None:
                endpoint.breaker.record_success()  # it answered: the server is up
            else:
                endpoint.breaker.release()
            raise exc
        endpoint.failures += 1
        endpoint.breaker.record_failure()
        self.last = exc
        log.debug("attempt %d at %s failed: %s", self.attempts, endpoint.url, exc)
        if self.attempts + self.waits >= self.r.policy.max_attempts:
            raise self.give_up("attempts")
        delay = self.r.policy.backoff_s(self.attempts, self.r.random())
        remaining = self.remaining()
        if remaining is not None and delay >= remaining:
            raise self.give_up("deadline")
        self.r.retries += 1
        return delay


@dataclass
class Retrier:
    """A RetryPolicy applied over an EndpointPool. ``retries`` counts the retries it made."""

    pool: EndpointPool
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    asleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    random: Callable[[], float] = _random.random
    retries: int = 0

    def call(self, fn: Callable[[str, float | None], T], timeout_s: float | None = None) -> T:
        """``fn(url, attempt_timeout_s)`` under the policy; its result, or the final error."""
        call = _Call(self, timeout_s)
        while True:
            endpoint, value = call.plan()
            if endpoint is None:
                self.sleep(value or 0.0)
                continue
            try:
                result = fn(endpoint.url, value)
            except BaseException as exc:  # noqa: BLE001 (failed() re-raises what is not retried)
                self.sleep(call.failed(endpoint, exc))
                continue
            call.succeeded(endpoint)
            return result

    async def acall(self, fn: Callable[[str, float | None], Awaitable[T]], timeout_s: float | None = None, cut: bool = True) -> T:
        """The asyncio twin of ``call``. With ``cut`` each attempt is also cancelled when the
        remaining deadline ends; without, ``fn`` bounds itself by the timeout it is given
        (gRPC's own deadline), which saves a timer per attempt."""
        call = _Call(self, timeout_s)
        while True:
            endpoint, value = call.plan()
            if endpoint is None:
                await self.asleep(value or 0.0)
                continue
            try:
                if value is None or not cut:
                    result = await fn(endpoint.url, value)
                else:
                    # asyncio.timeout, not wait_for: no extra task per attempt on the happy path.
                    async with asyncio.timeout(value):
                        result = await fn(endpoint.url, value)
            except BaseException as exc:  # noqa: BLE001 (failed() re-raises what is not retried)
                await self.asleep(call.failed(endpoint, exc))
                continue
            call.succeeded(endpoint)
            return result

    def stats(self) -> dict[str, Any]:
        return {"retries": self.retries, "endpoints": self.pool.stats()}


def make_retrier(
    urls: Sequence[str],
    timeout_s: float | None = None,
    retries: int | None = None,
    deadline_s: float | None = None,
    policy: RetryPolicy | None = None,
    pool: EndpointPool | None = None,
    strategy: str = "round_robin",
) -> Retrier:
    """A client's Retrier: ``pool`` (shared between clients) or a new one over ``urls``;
    ``policy`` or the default one with ``retries`` and a deadline of ``deadline_s``, else
    ``timeout_s`` (the call's timeout), else none (attempts bound the call)."""
    if policy is None:
        policy = RetryPolicy.create(retries, deadline_s if deadline_s is not None else timeout_s)
    return Retrier(pool if pool is not None else EndpointPool(urls, strategy), policy)


def split_urls(url: str | Sequence[str] | None) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2,c:3"]`` -> ``["a:1", "b:2", "c:3"]`` (empty parts dropped)."""
    if url is None:
        return []
    parts = [url] if isinstance(url, str) else list(url)
    return [u.strip() for p in parts for u in str(p).split(",") if u.strip()]
