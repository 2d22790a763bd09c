"""perf.bench.tail's measurements: one window of a workload (wrk, the asyncio client of perf.lib.load,
or the streaming clients), the CPU it cost, and Triton's per-model statistics over it."""

from __future__ import annotations

import asyncio
import json
import math
import resource
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from perf.bench.tail_workloads import STATS_MODELS, Workload
from perf.lib import load, wrk
from perf.lib.stats import percentile

COLD_PASS_LIMIT_S = 120.0  # the longest a stream window waits for every prompt's first answer


# --------------------------------------------------------------------------- measurement


@dataclass
class Window(load.TailRatios):
    """One measured window: one phase, one workload, one concurrency, one round."""

    phase: str
    workload: str
    concurrency: int
    round: int
    client: str
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    ttft_p50_ms: float | None = None  # streams: time to the first piece of text
    ttft_p99_ms: float | None = None
    ttft_max_ms: float | None = None
    client_cores: float | None = None  # CPU seconds of the load generator per wall second
    gateway_cores: float | None = None  # the OpenAI gateway's process (gateway workloads)
    server_cores: float | None = None  # the same for tritonserver and its backend stubs
    server_wait_cores: float | None = None  # seconds its threads sat runnable, waiting for a CPU, per second
    machine_cores: float | None = None  # every process of the machine (neighbours included)
    first_error: str = ""
    stats: dict = field(default_factory=dict)  # model -> mean batch, queue and compute ms per request

    def record(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "stats"}
        out["p99_over_p50"] = self.p99_over_p50
        out["max_over_p50"] = self.max_over_p50
        out["stats"] = json.dumps(self.stats, sort_keys=True)
        return out


async def _closed_loop(
    url: str, w: Workload, concurrency: int, duration: float, warmup: float
) -> tuple[list[float], int, str, float]:
    return await load.closed_loop(f"http://{url}{w.endpoint}", w.make, concurrency, duration, warmup, w.warm)


def measure_python(url: str, w: Workload, window: Window, duration: float) -> None:
    """The asyncio client in this process (its CPU: this process's over the window)."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    latencies, errors, first_error, seconds = asyncio.run(
        _closed_loop(url, replace(w, warm=()), window.concurrency, duration, 0.0)
    )
    window.client_cores = (time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9)
    window.requests, window.errors, window.first_error, window.seconds = len(latencies), errors, first_error, seconds
    if latencies:
        window.rps, window.p50_ms, window.p99_ms, window.max_ms = load.figures(latencies, seconds)


async def _stream_loop(
    w: Workload,
    target: str,
    api_key: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrency: int,
    duration: float,
    warmup: float,
) -> tuple[list[tuple[float, float]], int, str, float]:
    """``concurrency`` closed-loop streams: ``(TTFT, total)`` seconds of each request started inside
    the measured part (waited for to their end), errors, first error, the measured seconds. The
    measured part starts once every client has had one answer, every prompt has been answered
    once, and ``warmup`` s have passed, and lasts ``duration`` s. The prompts come back in turn,
    so inside the window their prefixes are in the engine's prefix cache; a prompt's first pass
    is a cold prefill of its whole length, and left inside the window those passes came as a
    backlog at its start (32 clients cover 32 of the prompts before the first condition holds). ``target``: the gateway's base URL, or tritonserver's gRPC host:port."""
    import aiohttp

    from clients.generation import AsyncGenerationClient
    from perf.lib.chat_streams import ChatSystem, DirectChat, GatewayChat

    session = None
    direct = None
    system: ChatSystem
    if w.via_gateway:
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=300), connector=aiohttp.TCPConnector(limit=0)
        )
        system = GatewayChat(session, target, api_key)
    else:
        direct = AsyncGenerationClient(target, protocol="grpc", timeout_s=300)
        system = DirectChat(direct)
    samples: list[tuple[float, float]] = []
    errors = 0
    first_error = ""
    try:
        await system.stream(prompts[0], 2)  # the connection opened, outside the window
        started = time.monotonic()
        measure_from: float | None = None
        answered = 0
        turn = iter(range(10**12))
        cold = set(range(len(prompts)))  # prompts not yet answered once

        async def client(k: int) -> None:
            nonlocal errors, first_error, measure_from, answered
            first = True
            while measure_from is None or time.monotonic() < measure_from + duration:
                now = time.monotonic()
                counted = measure_from is not None and now >= measure_from
                index = next(turn) % len(prompts)
                t0 = time.perf_counter()
                try:
                    ttft, _ = await system.stream(prompts[index], max_tokens)
                    if counted:
                        samples.append((ttft if ttft is not None else float("nan"), time.perf_counter() - t0))
                    cold.discard(index)
                except Exception as exc:  # noqa: BLE001 - counted, the window goes on
                    if counted:
                        errors += 1
                        first_error = first_error or f"{type(exc).__name__}: {exc}"[:200]
                    await asyncio.sleep(0.05)
                if first:
                    first, answered = False, answered + 1
                # (A prompt that keeps failing must not hold the window off for ever: its errors count.)
                if (
                    measure_from is None
                    and answered == concurrency
                    and (not cold or time.monotonic() > started + warmup + COLD_PASS_LIMIT_S)
                ):
                    measure_from = max(time.monotonic(), started + warmup)

        await asyncio.gather(*(client(k) for k in range(concurrency)))
        measured = time.monotonic() - (measure_from or started)
    finally:
        if session is not None:
            await session.close()
        if direct is not None:
            await direct.close()
    return samples, errors, first_error, measured


def measure_stream(
    w: Workload,
    target: str,
    api_key: str,
    prompts: Sequence[str],
    max_tokens: int,
    window: Window,
    duration: float,
    warmup: float,
) -> None:
    """The asyncio streaming client in this process: latency = the whole answer, TTFT beside it."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    samples, errors, first_error, seconds = asyncio.run(
        _stream_loop(w, target, api_key, prompts, max_tokens, window.concurrency, duration, warmup)
    )
    window.client_cores = (time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9)
    window.requests, window.errors, window.first_error, window.seconds = len(samples), errors, first_error, seconds
    if samples:
        total = sorted(1000.0 * t for _, t in samples)
        ttft = sorted(1000.0 * f for f, _ in samples if not math.isnan(f))
        window.rps = len(total) / seconds if seconds > 0 else None
        window.p50_ms, window.p99_ms, window.max_ms = percentile(total, 50), percentile(total, 99), total[-1]
        if ttft:
            window.ttft_p50_ms, window.ttft_p99_ms, window.ttft_max_ms = (percentile(ttft, 50), percentile(ttft, 99), ttft[-1])


def measure_wrk(url: str, w: Workload, window: Window, script: Path, duration: float) -> None:
    """wrk, one thread, in a child process (its CPU: the children's rusage over the window)."""
    before, wall0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    result = wrk.run(url, script, window.concurrency, duration)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - wall0
    window.client_cores = ((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)) / max(wall, 1e-9)
    window.seconds = result["duration_us"] / 1e6
    window.requests, window.errors = result["requests"] - result["errors"], result["errors"]
    if window.errors:
        window.first_error = "wrk counted non-2xx responses or socket errors"
    if result["requests"]:
        window.rps = result["requests"] / window.seconds
        window.p50_ms, window.p99_ms, window.max_ms = (result[k] / 1000.0 for k in ("p50_us", "p99_us", "max_us"))


def warm_up(url: str, w: Workload, concurrency: int, seconds: float, script: Path | None) -> None:
    """Unmeasured: ``w.warm`` once (the hits' texts), then ``seconds`` of the same load."""
    if w.warm:
        asyncio.run(_closed_loop(url, w, 1, 0.0, 0.0))
    if seconds > 0:
        if script is not None:
            wrk.run(url, script, concurrency, seconds)
        else:
            asyncio.run(_closed_loop(url, replace(w, warm=()), concurrency, seconds, 0.0))


class CpuMeter:
    """CPU seconds of a process tree and of the whole machine, between start() and stop()."""

    def __init__(self, pid: int | None):
        self.pid = pid

    def _tree(self) -> tuple[float, float]:
        """(CPU seconds, run-queue wait seconds) of the tree's threads (/proc/<pid>/task/*/schedstat)."""
        import psutil

        if self.pid is None:
            return 0.0, 0.0
        cpu = wait = 0.0
        try:
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    for task in Path(f"/proc/{p.pid}/task").iterdir():
                        fields = (task / "schedstat").read_text().split()
                        cpu += int(fields[0]) / 1e9
                        wait += int(fields[1]) / 1e9
                except (OSError, psutil.Error, ValueError, IndexError):
                    pass
        except psutil.Error:
            pass
        return cpu, wait

    @staticmethod
    def _machine() -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def start(self) -> None:
        self.t0, self.tree0, self.machine0 = time.monotonic(), self._tree(), self._machine()

    def stop(self, window: Window) -> None:
        wall = max(time.monotonic() - self.t0, 1e-9)
        cpu, wait = self._tree()
        window.server_cores = (cpu - self.tree0[0]) / wall
        window.server_wait_cores = (wait - self.tree0[1]) / wall
        window.machine_cores = (self._machine() - self.machine0) / wall


def model_stats(url: str) -> dict[str, dict[str, float]]:
    """Counters of /v2/models/stats summed over versions: requests, executions, batched
    inferences and the nanoseconds of queue and compute (input + infer + output)."""
    with urllib.request.urlopen(f"http://{url}/v2/models/stats", timeout=10) as r:
        payload = json.loads(r.read())
    out: dict[str, dict[str, float]] = {}
    for m in payload.get("model_stats", []):
        if m["name"] not in STATS_MODELS:
            continue
        s = m.get("inference_stats", {})
        agg = out.setdefault(m["name"], {"requests": 0, "executions": 0, "inferences": 0, "queue_ns": 0, "compute_ns": 0})
        agg["requests"] += int(s.get("success", {}).get("count", 0))
        agg["executions"] += int(m.get("execution_count", 0))
        agg["inferences"] += int(m.get("inference_count", 0))
        agg["queue_ns"] += int(s.get("queue", {}).get("ns", 0))
        agg["compute_ns"] += sum(int(s.get(k, {}).get("ns", 0)) for k in ("compute_input", "compute_infer", "compute_output"))
    return out


def stats_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per model over a window: mean batch, queue ms and compute ms per request."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        d = {k: a[k] - b.get(k, 0) for k in a}
        if d["requests"] <= 0:
            continue
        out[name] = {
            "requests": d["requests"],
            "batch": round(d["inferences"] / d["executions"], 2) if d["executions"] else None,
            "queue_ms": round(d["queue_ns"] / d["requests"] / 1e6, 3),
            "compute_ms": round(d["compute_ns"] / d["requests"] / 1e6, 3),
        }
    return out
