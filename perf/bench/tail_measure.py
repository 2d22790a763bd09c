"""perf.bench.tail's measurements: one window of a workload (wrk, the asyncio client of perf.lib.load,
or the streaming clients), the CPU it cost, and Triton's per-model statistics over it."""

from __future__ import annotations

import asyncio
import math
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from perf.bench.tail_workloads import STATS_MODELS, Workload
from perf.lib import load, processes, triton_stats, wrk

COLD_PASS_LIMIT_S = 120.0  # the longest a stream window waits for every prompt's first answer


@dataclass
class Window(load.Window):
    """A window (or a point: perf.lib.load.points) of perf.bench.tail, with the streams' TTFT and the CPU it cost."""

    ttft_p50_ms: float | None = None  # streams: time to the first piece of text
    ttft_p99_ms: float | None = None
    ttft_max_ms: float | None = None
    client_cores: float | None = None  # CPU seconds of the load generator per wall second
    gateway_cores: float | None = None  # the OpenAI gateway's process (gateway workloads)
    server_cores: float | None = None  # the same for tritonserver and its backend stubs
    server_wait_cores: float | None = None  # seconds its threads sat runnable, waiting for a CPU, per second
    machine_cores: float | None = None  # every process of the machine (neighbours included)


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
    """``concurrency`` closed-loop streams to ``target`` (the gateway's base URL, or tritonserver's gRPC
    host:port): ``(TTFT, total)`` seconds of each request started inside the measured part, errors,
    first error, measured seconds. That part starts once every client has had one answer, every
    prompt has been answered once (its cold prefill is left out; the prompts come back in turn,
    their prefixes cached) and ``warmup`` s have passed, and lasts ``duration`` s."""
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


def measure(
    window: Window,
    w: Workload,
    server,
    gateway,
    script: Path | None,
    duration: float,
    stream: tuple[str, Sequence[str], int, float] | None = None,
) -> None:
    """One window of ``w`` against ``server`` (a server.deployment.Deployment) or its ``gateway``: wrk with ``script``,
    else the asyncio client, or for a stream (``stream``: api key, prompts, new tokens, warm-up s)
    the streaming clients; the CPU each side used and Triton's statistics over it."""
    url = _url(server, gateway)
    meters = [CpuMeter(server.process.pid if server.process else None)]
    if gateway is not None and gateway.process:
        meters.append(CpuMeter(gateway.process.pid))
    stats0 = triton_stats.snapshot(server.triton_http_url)
    for m in meters:
        m.start()
    cpu0, wall0, children0 = time.process_time(), time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if stream is not None:
        target = gateway.url if gateway else server.triton_grpc_url
        api_key, prompts, max_tokens, warmup = stream
        samples, errors, first_error, seconds = asyncio.run(
            _stream_loop(w, target, api_key, prompts, max_tokens, window.concurrency, duration, warmup)
        )
        window.take(load.Tally(ok=[t for _, t in samples], errors=errors, first_error=first_error, seconds=seconds))
        ttft = load.latency_ms([f for f, _ in samples if not math.isnan(f)])
        window.ttft_p50_ms, window.ttft_p99_ms, window.ttft_max_ms = ttft["p50_ms"], ttft["p99_ms"], ttft["max_ms"]
    elif script is not None:
        window.take_wrk(wrk.run(url, script, window.concurrency, duration))
    else:
        window.take(asyncio.run(load.closed_loop(f"http://{url}{w.endpoint}", w.make, window.concurrency, duration)))
    wall = max(time.monotonic() - wall0, 1e-9)
    if script is not None:  # wrk: a child process
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        window.client_cores = (children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime) / wall
    else:
        window.client_cores = (time.process_time() - cpu0) / wall
    window.server_cores, window.server_wait_cores, window.machine_cores = meters[0].stop()
    if len(meters) > 1:
        window.gateway_cores = meters[1].stop()[0]
    window.stats = triton_stats.per_request(stats0, triton_stats.snapshot(server.triton_http_url), STATS_MODELS)


def _url(server, gateway) -> str:
    return gateway.url.removeprefix("http://") if gateway else server.triton_http_url


def warm_up(server, gateway, w: Workload, concurrency: int, seconds: float, script: Path | None) -> None:
    """Unmeasured: ``w.warm`` once (the hits' texts), then ``seconds`` of the same load."""
    endpoint = f"http://{_url(server, gateway)}{w.endpoint}"
    if w.warm:
        asyncio.run(load.closed_loop(endpoint, w.make, 1, 0.0, warm=w.warm))
    if seconds > 0:
        if script is not None:
            wrk.run(_url(server, gateway), script, concurrency, seconds)
        else:
            asyncio.run(load.closed_loop(endpoint, w.make, concurrency, seconds))


class CpuMeter:
    """CPU seconds of a process tree and of the whole machine, between start() and stop()."""

    def __init__(self, pid: int | None):
        self.pid = pid

    def _tree(self) -> tuple[float, float]:
        """(CPU seconds, run-queue wait seconds) of the tree's threads (/proc/<pid>/task/*/schedstat)."""
        cpu = wait = 0.0
        for pid in processes.tree(self.pid) if self.pid is not None else ():
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    fields = (task / "schedstat").read_text().split()
                    cpu, wait = cpu + int(fields[0]) / 1e9, wait + int(fields[1]) / 1e9
                except (OSError, ValueError, IndexError):
                    pass
        return cpu, wait

    @staticmethod
    def _machine() -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def start(self) -> None:
        self.t0, self.tree0, self.machine0 = time.monotonic(), self._tree(), self._machine()

    def stop(self) -> tuple[float, float, float]:
        """Cores used by the tree, cores its threads waited for, cores used by the machine."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        cpu, wait = self._tree()
        return (cpu - self.tree0[0]) / wall, (wait - self.tree0[1]) / wall, (self._machine() - self.machine0) / wall
