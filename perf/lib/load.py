"""The asyncio load loop the HTTP benchmarks share (the fallback where wrk is not installed), and the
latency figures of a window, with the one percentile of perf.lib.stats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from perf.lib.stats import percentile

Request = tuple[bytes, dict[str, str]]  # (body, headers)


async def closed_loop(
    endpoint: str,
    make: Callable[[int], Request],
    concurrency: int,
    duration: float,
    warmup: float = 0.0,
    warm: Sequence[Request] = (),
    start: int = 0,
) -> tuple[list[float], int, str, float]:
    """``concurrency`` clients POSTing to ``endpoint`` (a URL), each sending its next request
    (``make(n)``, n counting from ``start``) when its answer came: ``warm`` first (once, in turn,
    unmeasured), then ``warmup`` s unmeasured and ``duration`` s measured. Returns the latencies
    (seconds) of the measured 200 answers, the errors, the first error's text and the seconds measured."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    latencies: list[float] = []
    errors = 0
    first_error = ""
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        for body, headers in warm:
            async with session.post(endpoint, data=body, headers=headers) as r:
                await r.read()
        started = time.monotonic()
        measure_from, stop_at = started + warmup, started + warmup + duration
        n = iter(range(start, 10**12))

        async def client() -> None:
            nonlocal errors, first_error
            while True:
                now = time.monotonic()
                if now >= stop_at:
                    return
                body, headers = make(next(n))
                t0 = time.perf_counter()
                try:
                    async with session.post(endpoint, data=body, headers=headers) as r:
                        payload = await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, TimeoutError) as exc:
                    ok, payload = False, repr(exc).encode()
                elapsed = time.perf_counter() - t0
                if now < measure_from:
                    continue
                if ok:
                    latencies.append(elapsed)
                else:
                    errors += 1
                    first_error = first_error or payload[:200].decode(errors="replace")

        await asyncio.gather(*(client() for _ in range(concurrency)))
        measured = time.monotonic() - measure_from
    return latencies, errors, first_error, measured


def figures(latencies_s: Sequence[float], seconds: float) -> tuple[float | None, float, float, float]:
    """(requests/s, P50, P99, max in ms) of a window's latencies (seconds; at least one)."""
    ms = sorted(x * 1000.0 for x in latencies_s)
    return (len(ms) / seconds if seconds > 0 else None), percentile(ms, 50), percentile(ms, 99), ms[-1]


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
