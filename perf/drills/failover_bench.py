"""`python -m perf.drills.failover_bench` (`make failover-bench`): a replica SIGKILLed under load in serve-cluster.

Starts `python -m server.cluster` (--replicas, text_embedding unless --model) and drives its front
door with clients.AsyncEmbeddingClient (it retries) from --concurrency closed-loop workers, half over
HTTP, half over gRPC; at --kill-at replica --victim gets SIGKILL. Per second: answers, failures and
P50/P99/max; when the replica was restarted, back in the front door and serving again. Writes
per_second.csv, summary.md, results.json, failover.png and the cluster's output under
perf/results/failover-<UTC time>/. Exits 1 on a failed request, the last 5 s under --recovery x the
throughput before the kill, or the replica not serving again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from perf.drills.report import Result, latency_ms, per_second, timed, timeline
from perf.lib import triton_stats
from perf.lib.cluster import ClusterRun, launch
from perf.lib.load import call_loop
from perf.lib.options import parser
from perf.lib.report import results_dir, table, write

MODELS = ("text_embedding",)
# The victim's events, and the keys of their times in the scenario's result (<key>_at_s).
EVENTS = {"killed": "SIGKILL", "restarted": "restarted", "back": "back in the front door", "serving": "serving again"}


def stats_count(http_url: str, model: str = "text_embedding") -> int:
    """Successful inferences of ``model`` on one tritonserver (its own statistics)."""
    stats = triton_stats.snapshot(http_url, timeout=5)
    return sum(int(s["inference_stats"]["success"]["count"]) for key, s in stats.items() if key.startswith(f"{model}@"))


async def drive(
    http_url: str, grpc_url: str, concurrency: int, duration_s: float, offset_s: float = 0.0
) -> tuple[list[Result], dict]:
    """``concurrency`` closed-loop workers sending one unique text per request, every other one over
    gRPC; the results (workload: the protocol; times from ``offset_s``) and the clients' retry stats."""
    from clients import AsyncEmbeddingClient
    from clients.resilience import BreakerPolicy, EndpointPool
    from clients.transport import Protocol

    # One endpoint, the front door, for many calls in flight: when a replica dies, every call in
    # flight on it may fail at once (gRPC ones reach the client: nginx cannot re-send a gRPC body
    # it already sent). That is not the front door being down, so the breaker opens only after
    # more consecutive failures than calls in flight; with the default (5) the calls waiting on
    # the open breaker gave up.
    breaker = BreakerPolicy(failure_threshold=concurrency + 1)
    urls: dict[Protocol, str] = {"http": http_url, "grpc": grpc_url}
    pools = {p: EndpointPool([url], breaker=breaker) for p, url in urls.items()}
    clients: dict[str, AsyncEmbeddingClient] = {
        p: AsyncEmbeddingClient(url, p, timeout_s=30, deadline_s=30, pool=pools[p]) for p, url in urls.items()
    }
    results: list[Result] = []
    start = time.monotonic() - offset_s

    async def call(i: int) -> None:
        async def send(protocol: str) -> None:
            text = f"Request {i} ({protocol}): the ferry to the island leaves at {i % 24}:{i % 60:02d} every day."
            await clients[protocol].embed_many([text], concurrency=1, per_request=1)

        await timed(send, list(urls)[i % 2], results, start, 60)

    try:
        await call_loop(call, concurrency, duration_s)
    finally:
        stats = {p: c.retrier.stats() for p, c in clients.items()}
        for c in clients.values():
            await c.close()
    return results, stats


class Watcher:
    """Polls cluster.json and the victim's own port: when it was restarted, back in the front door
    and serving again (its own inference count grew)."""

    def __init__(self, run: ClusterRun, victim: int, start: float):
        self.run, self.victim, self.start = run, victim, start
        self.killed_pid: int | None = None
        self.at: dict[str, float | None] = dict.fromkeys(EVENTS.values())
        self.count_back: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def kill(self) -> None:
        self.killed_pid = self.run.state()["replicas"][self.victim]["pid"]
        os.killpg(self.killed_pid, signal.SIGKILL)  # tritonserver and its stubs (its own process group)
        self.at["SIGKILL"] = time.monotonic() - self.start
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            try:
                replica = self.run.state()["replicas"][self.victim]
                now = time.monotonic() - self.start
                if replica["pid"] in (None, self.killed_pid):
                    continue
                self.at["restarted"] = self.at["restarted"] or now
                if self.at["back in the front door"] is None and replica["state"] == "ready":
                    self.at["back in the front door"] = now
                    self.count_back = stats_count(f"127.0.0.1:{replica['http']}")
                elif self.count_back is not None and stats_count(f"127.0.0.1:{replica['http']}") > self.count_back:
                    self.at["serving again"] = time.monotonic() - self.start
                    return
            except (OSError, ValueError, KeyError, IndexError):
                continue

    def stop(self) -> None:
        self._stop.set()


def scenario(
    run: ClusterRun,
    concurrency: int = 16,
    duration_s: float = 30.0,
    kill_at_s: float = 10.0,
    victim: int = 0,
    linger_s: float = 60.0,
) -> dict:
    """Drive the cluster, kill ``victim`` at ``kill_at_s``; the figures and checks' inputs.
    When the victim is not back by the end of the load, waits up to ``linger_s`` more; when no
    request reached it yet, sends a few short bursts, to see it serve again."""
    start = time.monotonic()
    watcher = Watcher(run, victim, start)
    timer = threading.Timer(kill_at_s, watcher.kill)  # a timer thread: a busy event loop would run it late
    timer.start()
    try:
        results, client_stats = asyncio.run(drive(run.http_url, run.grpc_url, concurrency, duration_s))
    finally:
        timer.cancel()
    deadline = time.monotonic() + linger_s
    while watcher.at["back in the front door"] is None and time.monotonic() < deadline:
        time.sleep(0.2)
    for _ in range(3):
        if watcher.at["back in the front door"] is None or watcher.at["serving again"] is not None:
            break
        # Back at the very end of the load or after it: short bursts through the front door so
        # requests can reach it (counted with the rest, after the load's seconds).
        results += asyncio.run(drive(run.http_url, run.grpc_url, 4, 2.0, time.monotonic() - start))[0]
        time.sleep(0.3)
    watcher.stop()
    replica = run.state()["replicas"][victim]
    count_end = stats_count(f"127.0.0.1:{replica['http']}") if watcher.at["back in the front door"] is not None else None
    rows = per_second(results, max(duration_s, max((r.end_s for r in results), default=0)))
    before = [r["ok"] for r in rows if r["second"] < kill_at_s]
    last = [r["ok"] for r in rows[int(duration_s) - 5 : int(duration_s)]]
    failures = [r for r in results if r.error]
    at = {f"{key}_at_s": watcher.at[name] for key, name in EVENTS.items()}
    return {
        "requests": len(results),
        "failed": len(failures),
        "errors": sorted({f.error for f in failures})[:10],
        "rps_before_kill": round(statistics.mean(before), 1) if before else 0.0,
        "rps_last_5s": round(statistics.mean(last), 1) if last else 0.0,
        **latency_ms(results),
        **at,
        "victim_count_back": watcher.count_back,
        "victim_count_end": count_end,
        "victim_restarts": replica["restarts"],
        "front_door_reloads": run.state()["front_door"]["reloads"],
        "client_retries": {p: st["retries"] for p, st in client_stats.items()},
        "rows": rows,
    }


def check(result: dict, recovery: float = 0.5) -> list[str]:
    """The scenario's failed checks (empty: passed)."""
    problems = []
    if result["failed"]:
        problems.append(f"{result['failed']} failed requests: {result['errors']}")
    if result["rps_last_5s"] < recovery * result["rps_before_kill"]:
        problems.append(
            f"throughput did not recover: last 5 s {result['rps_last_5s']} req/s < {recovery} x "
            f"{result['rps_before_kill']} before the kill"
        )
    back, end = result["victim_count_back"], result["victim_count_end"]
    if result["back_at_s"] is None:
        problems.append("the killed replica was not back in the front door")
    elif back is None or end is None or end <= back:
        problems.append(f"the restarted replica served no request after it came back ({back} -> {end})")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = parser("perf.drills.failover_bench", __doc__)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", action="append", dest="models", help="models to load (default text_embedding)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--kill-at", type=float, default=10.0)
    p.add_argument("--victim", type=int, default=0)
    p.add_argument("--recovery", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = results_dir(args.out, "failover")
    print(f"failover-bench: starting serve-cluster ({args.replicas} replicas) in {out}", flush=True)
    run = launch(out / "work", replicas=args.replicas, models=tuple(args.models or MODELS))
    try:
        result = scenario(run, args.concurrency, args.duration, args.kill_at, args.victim)
    finally:
        code = run.stop()
        (out / "cluster-output.txt").write_text("\n".join(run.screen) + "\n", encoding="utf-8")
    rows = result.pop("rows")
    problems = result["problems"] = check(result, args.recovery)
    result["launcher_exit_code"] = code
    events: dict[str, tuple[float | None, float | None]] = {name: (result[f"{key}_at_s"], None) for key, name in EVENTS.items()}
    title = (
        f"serve-cluster, {args.replicas} replicas, {args.concurrency} clients (HTTP+gRPC): replica {args.victim} "
        f"SIGKILLed at {args.kill_at:.0f} s; {result['failed']} failed of {result['requests']}"
    )
    timeline(out / "failover.png", rows, events, title)
    keys = ("second", "ok", "failed", "p50_ms", "p99_ms", "max_ms")

    def at(key: str) -> str:
        return "never" if result[key] is None else f"{result[key]:.1f} s"

    text = "\n".join(
        [
            f"# failover-bench: {title}",
            "",
            table(["s", "req/s", "failed", "P50 ms", "P99 ms", "max ms"], ([r[k] for k in keys] for r in rows), left=0),
            "",
            f"requests {result['requests']}, failed {result['failed']}; P50 {result['p50_ms']} ms, P99 {result['p99_ms']} ms, "
            f"max {result['max_ms']} ms; req/s before the kill {result['rps_before_kill']}, last 5 s {result['rps_last_5s']}",
            f"kill at {at('killed_at_s')}, restarted at {at('restarted_at_s')}, back in the front door at {at('back_at_s')}, "
            f"serving again at {at('serving_at_s')}; its inferences {result['victim_count_back']} -> {result['victim_count_end']}; "
            f"client retries {result['client_retries']}; front door reloads {result['front_door_reloads']}",
            "",
            f"Checks: {'all passed' if not problems else 'FAILED: ' + '; '.join(problems)}",
        ]
    )
    write(out, text + "\n", result, csvs={"per_second.csv": rows}, say=print)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
