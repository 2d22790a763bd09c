"""The one load driver of the request benchmarks, and the record of what it measured.

Drivers return a ``Tally`` (latencies of the 200s and of the 503s, other errors, seconds measured):
``closed_loop`` (clients POSTing to a URL), ``open_loop`` (a fixed rate), ``call_loop`` (the closed
loop around any coroutine: tritonclient, clients.AsyncEmbeddingClient) and ``poisson_loop`` (any
coroutine at Poisson arrivals); wrk (perf.lib.wrk) is the C driver for the same HTTP loads.
``Window`` is one measured point, ``points`` the median over its rounds; ``kserve_texts`` is the
KServe request function, ``alternate`` runs loads side by side in alternating rounds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

from perf.lib.report import fmt as _f
from perf.lib.stats import median, percentile

Request = tuple[bytes, dict[str, str]]  # (body, headers)


@dataclass
class Tally:
    """What a load loop saw. ``errors`` counts every answer but a 200 (refusals included)."""

    ok: list[float] = field(default_factory=list)  # seconds, answers 200
    ok_index: list[int] = field(default_factory=list)  # the request number of each of them
    refused: list[float] = field(default_factory=list)  # seconds, answers 503 (UNAVAILABLE)
    errors: int = 0
    first_error: str = ""  # the first error that was not a refusal
    seconds: float = 0.0

    def add(self, ok: bool, elapsed: float, error: str = "", refused: bool = False, index: int = -1) -> None:
        if ok:
            self.ok.append(elapsed)
            self.ok_index.append(index)
            return
        self.errors += 1
        if refused:
            self.refused.append(elapsed)
        else:
            self.first_error = self.first_error or error[:200]

    def merge(self, other: Tally) -> None:
        """``other``'s answers, errors and seconds added to these."""
        self.ok += other.ok
        self.ok_index += other.ok_index
        self.refused += other.refused
        self.errors += other.errors
        self.first_error = self.first_error or other.first_error
        self.seconds += other.seconds

    def figures(self) -> dict:
        """requests (200s), requests/s, errors and P50/P99/max ms of the 200s."""
        rps = len(self.ok) / self.seconds if self.seconds > 0 else None
        return {"requests": len(self.ok), "rps": rps, "errors": self.errors, **latency_ms(self.ok)}


def latency_ms(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """P50, P99 and max of latencies in seconds, in ms (None when there are none)."""
    ms = sorted(x * 1000.0 for x in latencies_s)
    if not ms:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": ms[-1]}


async def _post(session, endpoint: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    import aiohttp

    try:
        async with session.post(endpoint, data=body, headers=headers) as r:
            return r.status, await r.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, repr(exc).encode()


async def _timed_post(session, endpoint: str, request: Request, tally: Tally | None) -> None:
    """One POST, its answer counted into ``tally`` (None: not measured; 503 is a refusal)."""
    t0 = time.perf_counter()
    status, payload = await _post(session, endpoint, *request)
    if tally is not None:
        tally.add(status == 200, time.perf_counter() - t0, f"{status} {payload.decode(errors='replace')}", refused=status == 503)


def _session(connections: int, timeout: float):
    import aiohttp

    connector = aiohttp.TCPConnector(limit=connections)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout))


async def closed_loop(
    endpoint: str,
    make: Callable[[int], Request],
    concurrency: int,
    duration: float,
    warmup: float = 0.0,
    warm: Sequence[Request] = (),
    start: int = 0,
) -> Tally:
    """``concurrency`` clients POSTing to ``endpoint`` (a URL), each sending its next request
    (``make(n)``, n counting from ``start``) when its answer came: ``warm`` first (once, in turn,
    unmeasured), then ``warmup`` s unmeasured and ``duration`` s measured."""
    tally = Tally()
    async with _session(concurrency, 60) as session:
        for body, headers in warm:
            await _post(session, endpoint, body, headers)
        started = time.monotonic()
        measure_from, stop_at = started + warmup, started + warmup + duration
        numbers = itertools.count(start)

        async def client() -> None:
            while (now := time.monotonic()) < stop_at:
                await _timed_post(session, endpoint, make(next(numbers)), tally if now >= measure_from else None)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        tally.seconds = time.monotonic() - measure_from
    return tally


async def open_loop(endpoint: str, make: Callable[[int], Request], rate: float, duration: float, timeout: float = 30) -> Tally:
    """POSTs to ``endpoint`` started at ``rate`` per second for ``duration`` s, each waited for."""
    tally = Tally()
    async with _session(0, timeout) as session:
        started, tasks = time.monotonic(), []
        for n in range(int(rate * duration)):
            await asyncio.sleep(max(0.0, started + n / rate - time.monotonic()))
            tasks.append(asyncio.create_task(_timed_post(session, endpoint, make(n), tally)))
        await asyncio.gather(*tasks)
        tally.seconds = duration
    return tally


async def _counted(tally: Tally, call: Callable[[int], Awaitable[object]], n: int) -> None:
    """``call(n)`` timed into ``tally``: an answer is a success, an exception an error."""
    t0 = time.perf_counter()
    try:
        await call(n)
        tally.add(True, time.perf_counter() - t0, index=n)
    except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
        tally.add(False, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")


async def call_loop(
    call: Callable[[int], Awaitable[object]], concurrency: int, seconds: float | None = None, count: int | None = None
) -> Tally:
    """``concurrency`` workers awaiting ``call(n)`` (n: 0, 1, ... across them) for ``seconds``, or
    until ``count`` calls were made; an exception is an error."""
    tally, numbers = Tally(), itertools.count()
    started = time.perf_counter()
    deadline = started + seconds if seconds is not None else float("inf")

    async def worker() -> None:
        for n in numbers:
            if time.perf_counter() >= deadline or (count is not None and n >= count):
                return
            await _counted(tally, call, n)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    tally.seconds = time.perf_counter() - started
    return tally


async def poisson_loop(
    call: Callable[[int], Awaitable[object]],
    rate: float,
    seconds: float,
    seed: int = 0,
    max_in_flight: int = 0,
    start: float | None = None,
) -> Tally:
    """``call(n)`` started at Poisson arrivals (``rate`` per second on average) for ``seconds`` from
    ``start`` (time.monotonic(); default now), whatever the answers, and the last ones waited for; an
    exception is an error. With ``max_in_flight``, an arrival beyond that many calls in flight is shed: an error."""
    tally, rng = Tally(), random.Random(seed)
    tasks: set[asyncio.Future] = set()
    origin = time.monotonic() if start is None else start
    at = origin

    for n in itertools.count():
        at += rng.expovariate(rate)
        if at >= origin + seconds:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if max_in_flight and len(tasks) >= max_in_flight:
            tally.add(False, 0.0, f"shed: more than {max_in_flight} calls in flight")
            continue
        task = asyncio.ensure_future(_counted(tally, call, n))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)
    tally.seconds = time.monotonic() - origin
    return tally


async def kserve_texts(
    protocol: str,
    url: str,
    model: str,
    text: Callable[[int], str],
    concurrency: int,
    seconds: float | None = None,
    count: int | None = None,
    output: str | None = None,
) -> Tally:
    """``call_loop`` of tritonclient's asyncio KServe client (``protocol`` http or grpc) sending
    ``model`` one text per request, ``text(n)``; ``output`` requested and read when named."""
    import numpy as np

    if protocol == "grpc":
        import tritonclient.grpc.aio as module
    else:
        import tritonclient.http.aio as module
    client = module.InferenceServerClient(url)
    outputs = [module.InferRequestedOutput(output)] if output else None

    async def call(n: int) -> None:
        tensor = module.InferInput("TEXT", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[text(n).encode()]], dtype=object))
        result = await client.infer(model, [tensor], outputs=outputs)
        if output:
            result.as_numpy(output)

    try:
        return await call_loop(call, concurrency, seconds, count)
    finally:
        await client.close()


K = TypeVar("K")


def alternate(
    runs: Mapping[K, Callable[[float], Coroutine[Any, Any, Tally]]], rounds: int, seconds: float
) -> dict[K, tuple[Tally, float]]:
    """Each run (a load of ``seconds`` s) once for a second unmeasured (connections, first batches),
    then ``rounds`` times in turn, the order reversed every other round (A B, B A) so that a
    neighbour's burst hits them all; per run, the rounds' Tally merged and this process's CPU seconds."""
    for run in runs.values():
        asyncio.run(run(1.0))
    out = {key: (Tally(), 0.0) for key in runs}
    for r in range(rounds):
        for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            cpu = time.process_time()
            tally = asyncio.run(runs[key](seconds))
            out[key][0].merge(tally)
            out[key] = out[key][0], out[key][1] + time.process_time() - cpu
    return out


class TailRatios:
    """P99 and max over P50 of a dataclass with ``p50_ms``, ``p99_ms`` and ``max_ms`` (a window, a point)."""

    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @property
    def p99_over_p50(self) -> float | None:
        return self.p99_ms / self.p50_ms if self.p99_ms and self.p50_ms else None

    @property
    def max_over_p50(self) -> float | None:
        return self.max_ms / self.p50_ms if self.max_ms and self.p50_ms else None


@dataclass
class Window(TailRatios):
    """One measured window of one phase, workload, concurrency and round; from ``points``, the
    median of a point's rounds (``round``: how many, ``p99_range``: their lowest and highest P99)."""

    phase: str
    workload: str
    concurrency: int
    round: int = 1
    client: str = ""
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    first_error: str = ""
    stats: dict = field(default_factory=dict)  # model -> perf.lib.triton_stats.per_request figures
    p99_range: tuple[float, float] | None = None

    def take(self, tally: Tally) -> None:
        """The figures of a Tally."""
        self.seconds, self.first_error = tally.seconds, tally.first_error
        for key, value in tally.figures().items():
            setattr(self, key, value)

    def take_wrk(self, result: dict) -> None:
        """The figures wrk's script printed (perf.lib.wrk.run)."""
        self.seconds = result["duration_us"] / 1e6
        self.requests, self.errors = result["requests"] - result["errors"], result["errors"]
        if self.errors:
            self.first_error = "wrk counted non-2xx responses or socket errors"
        if result["requests"]:
            self.rps = result["requests"] / self.seconds
            self.p50_ms, self.p99_ms, self.max_ms = (result[k] / 1000.0 for k in ("p50_us", "p99_us", "max_us"))

    def record(self) -> dict:
        """A CSV row: every field (stats as JSON) and the tail ratios."""
        out = asdict(self) | {"p99_over_p50": self.p99_over_p50, "max_over_p50": self.max_over_p50}
        return out | {"stats": json.dumps(self.stats, sort_keys=True)}

    def line(self) -> str:
        """The progress line of a window."""
        return (
            f"{self.phase:6} {self.workload:28} c{self.concurrency:<3} r{self.round} {_f(self.rps, 0):>6} req/s  "
            f"P50 {_f(self.p50_ms):>7}  P99 {_f(self.p99_ms):>7}  max {_f(self.max_ms):>7} ms  errors {self.errors}"
            + (f" ({self.first_error})" if self.first_error else "")
        )


W = TypeVar("W", bound=Window)


def points(windows: Sequence[W]) -> list[W]:
    """One per (phase, workload, concurrency), in the order first seen: requests and errors summed,
    ``*max_ms`` the largest, every other figure (and each model's stats) the median over the rounds."""
    groups: dict[tuple[str, str, int], list[W]] = {}
    for w in windows:
        groups.setdefault((w.phase, w.workload, w.concurrency), []).append(w)
    out = []
    for ws in groups.values():
        values: dict[str, Any] = {"round": len(ws), "first_error": next((w.first_error for w in ws if w.first_error), "")}
        for f in fields(ws[0]):
            got = [getattr(w, f.name) for w in ws]
            if f.name in ("requests", "errors"):
                values[f.name] = sum(got)
            elif f.name.endswith("max_ms"):
                values[f.name] = max((v for v in got if v is not None), default=None)
            elif f.name not in values and all(v is None or isinstance(v, float) for v in got):
                values[f.name] = median(got)
        p99s = [w.p99_ms for w in ws if w.p99_ms is not None]
        values["p99_range"] = (min(p99s), max(p99s)) if p99s else None
        models = {m for w in ws for m in w.stats}
        values["stats"] = {
            m: {k: median([w.stats[m][k] for w in ws if m in w.stats]) for k in next(w.stats[m] for w in ws if m in w.stats)}
            for m in models
        }
        out.append(replace(ws[0], **values))
    return out
