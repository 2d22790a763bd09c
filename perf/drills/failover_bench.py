"""`python -m perf.drills.failover_bench` (`make failover-bench`): a replica SIGKILLed under load in serve-cluster.

Starts `python -m server.cluster` (its own ports and work folder; --replicas, default 2, with
only text_embedding's models unless --model), then drives the front door with the project's
asyncio client (clients.AsyncEmbeddingClient, which retries UNAVAILABLE, 502/503/504 and
dropped connections) at --concurrency (default 16: half HTTP, half gRPC) closed-loop workers
sending one unique text per request for --duration seconds (default 30). At --kill-at seconds
(default 10) replica --victim's tritonserver and its python backend stubs get SIGKILL. The
cluster's supervisor restarts it and puts it back in the front door once it is ready.

Prints and writes per second: requests/s, P50/P99/max latency and failed requests (after the
client's retries), the kill, the restart and the moment the replica was back in the front
door; the client's attempts beside its calls (retries the front door did not absorb); the
restarted replica's own inference count (Triton's /v2/models/<m>/stats) when it came back and
at the end. Writes per_second.csv, summary.json, failover.png (requests/s and P99 per second,
the events marked) and the cluster's logs under perf/results/failover-<UTC time>/ (--out DIR).
Exits 1 when a check fails: a failed request, throughput of the last 5 s under --recovery
(0.5) x that of the seconds before the kill, or the restarted replica not serving again.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from perf.lib.paths import RESULTS, ROOT
from perf.lib.stats import percentile_of
from server.process import free_port

MODELS = ("text_embedding",)


@dataclass
class ClusterRun:
    """A `python -m server.cluster` child process on free ports."""

    proc: subprocess.Popen
    workdir: Path
    ports: dict[str, int]
    screen: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def state(self) -> dict:
        return json.loads((self.workdir / "cluster.json").read_text(encoding="utf-8"))

    def stop(self, timeout: float = 60.0) -> int:
        """SIGINT (Ctrl-C), as a user stops it; SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return self.proc.returncode


def launch(
    workdir: Path,
    replicas: int = 2,
    models=MODELS,
    gateway: bool = True,
    prometheus: bool = True,
    scrape_interval: float = 2.0,
    timeout: float = 300.0,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    rollout_state: Path | None = None,
) -> ClusterRun:
    """Start the cluster and return once its first screen is printed (all replicas ready).
    ``rollout_state``: the replicas' rollout state file (default: none, a fresh path)."""
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    taken: set[int] = set()

    def port() -> int:
        while True:
            p = free_port()
            if p not in taken:
                taken.add(p)
                return p

    ports = {"http": port(), "grpc": port(), "metrics": port(), "gateway": port(), "prometheus": port()}
    cmd = [
        sys.executable,
        "-m",
        "server.cluster",
        "--no-export",
        "--replicas",
        str(replicas),
        "--workdir",
        str(workdir / "cluster"),
        "--http-port",
        str(ports["http"]),
        "--grpc-port",
        str(ports["grpc"]),
        "--metrics-port",
        str(ports["metrics"]),
        "--gateway-port",
        str(ports["gateway"]),
        "--prometheus-port",
        str(ports["prometheus"]),
        "--scrape-interval",
        str(scrape_interval),
        "--repository-token-file",
        str(workdir / "repository-token"),
        "--gateway-api-key-file",
        str(workdir / "gateway-api-key"),
        "--rollout-state",
        str(rollout_state or workdir / "no-rollout-state.json"),
        "--drain-timeout",
        "5",
        *[a for m in models for a in ("--model", m)],
        *(extra or []),
    ]
    if not gateway:
        cmd.append("--no-gateway")
    if not prometheus:
        cmd.append("--no-prometheus")
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run = ClusterRun(proc, workdir / "cluster", ports)
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            run.screen.append(line.rstrip("\n"))
            if "Ctrl-C to stop" in line:
                ready.set()
        ready.set()

    run._reader = threading.Thread(target=read, daemon=True)
    run._reader.start()
    if not ready.wait(timeout) or proc.poll() is not None:
        run.stop(timeout=10)
        raise RuntimeError("serve-cluster did not become ready:\n" + "\n".join(run.screen[-60:]))
    return run


def stats_count(http_url: str, model: str = "text_embedding") -> int:
    """Successful inferences of ``model`` on one tritonserver (its own /v2/models/<m>/stats)."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=5) as r:
        body = json.load(r)
    return sum(int(s["inference_stats"]["success"]["count"]) for s in body.get("model_stats", []))


@dataclass
class Sample:
    end_s: float  # since the start of the load
    latency_s: float
    ok: bool
    protocol: str
    error: str = ""


async def drive(
    http_url: str,
    grpc_url: str,
    concurrency: int,
    duration_s: float,
    actions: dict[float, Callable[[], object]],
    model: str = "text_embedding",
) -> tuple[list[Sample], dict]:
    """``concurrency`` closed-loop workers (half HTTP, half gRPC), one unique text per request;
    ``actions``: {seconds since start: function} run in a timer thread at that time."""
    from clients import AsyncEmbeddingClient
    from clients.resilience import BreakerPolicy, EndpointPool
    from clients.transport import Protocol

    protocols: list[Protocol] = ["http" if i % 2 == 0 else "grpc" for i in range(concurrency)]
    urls: dict[Protocol, str] = {"http": http_url, "grpc": grpc_url}
    # One endpoint, the front door, for many calls in flight: when a replica dies, every call in
    # flight on it may fail at once (gRPC ones reach the client: nginx cannot re-send a gRPC
    # body it already sent). That is not the front door being down, so the breaker opens only
    # after more consecutive failures than a client has calls in flight; with the default (5)
    # the calls waiting on the open breaker gave up.
    breaker = BreakerPolicy(failure_threshold=max(protocols.count("http"), protocols.count("grpc")) + 1)
    clients = {
        p: AsyncEmbeddingClient(url, p, model=model, timeout_s=30, deadline_s=30, pool=EndpointPool([url], breaker=breaker))
        for p, url in urls.items()
    }
    samples: list[Sample] = []
    start = time.monotonic()
    stop_at = start + duration_s
    counter = iter(range(10**9))

    async def worker(protocol: Protocol) -> None:
        client = clients[protocol]
        while time.monotonic() < stop_at:
            i = next(counter)
            text = f"Request {i} ({protocol}): the ferry to the island leaves at {i % 24}:{i % 60:02d} every day."
            t0 = time.monotonic()
            try:
                await client.embed_many([text], concurrency=1, per_request=1)
                samples.append(Sample(time.monotonic() - start, time.monotonic() - t0, True, protocol))
            except Exception as exc:  # noqa: BLE001 - every failure is counted, whatever it is
                samples.append(
                    Sample(time.monotonic() - start, time.monotonic() - t0, False, protocol, f"{type(exc).__name__}: {exc}"[:300])
                )

    # Timers, not the event loop: a busy loop would run them late.
    timers = [threading.Timer(at, action) for at, action in sorted(actions.items())]
    for timer in timers:
        timer.start()
    try:
        await asyncio.gather(*(worker(p) for p in protocols))
    finally:
        for timer in timers:
            timer.cancel()
        stats = {p: c.retrier.stats() for p, c in clients.items()}
        for c in clients.values():
            await c.close()
    return samples, stats


def per_second(samples: list[Sample], duration_s: float) -> list[dict]:
    rows = []
    for second in range(int(duration_s)):  # whole seconds only: the last partial one would show a false drop
        inside = [s for s in samples if second <= s.end_s < second + 1]
        lat = [s.latency_s * 1000 for s in inside if s.ok]
        rows.append(
            {
                "second": second,
                "requests": len(inside),
                "ok": len(lat),
                "failed": sum(not s.ok for s in inside),
                "p50_ms": round(percentile_of(lat, 50), 1),
                "p99_ms": round(percentile_of(lat, 99), 1),
                "max_ms": round(max(lat), 1) if lat else float("nan"),
            }
        )
    return rows


class Watcher:
    """Polls cluster.json and the victim's own port: when it was restarted and back in the front door."""

    def __init__(self, run: ClusterRun, victim: int, start: float):
        self.run, self.victim, self.start = run, victim, start
        self.killed_pid: int | None = None
        self.killed_at: float | None = None
        self.restarted_at: float | None = None
        self.back_at: float | None = None
        self.count_back: int | None = None
        self.serving_at: float | None = None  # its own inference count first grew
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def kill(self) -> None:
        replica = self.run.state()["replicas"][self.victim]
        self.killed_pid = replica["pid"]
        os.killpg(self.killed_pid, signal.SIGKILL)  # tritonserver and its stubs (its own process group)
        self.killed_at = time.monotonic() - self.start
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                replica = self.run.state()["replicas"][self.victim]
            except (OSError, ValueError, KeyError, IndexError):
                replica = None
            if replica:
                now = time.monotonic() - self.start
                if self.restarted_at is None and replica["pid"] not in (None, self.killed_pid):
                    self.restarted_at = now
                if self.back_at is None and replica["state"] == "ready" and replica["pid"] != self.killed_pid:
                    self.back_at = now
                    try:
                        self.count_back = stats_count(f"127.0.0.1:{replica['http']}")
                    except OSError:
                        self.count_back = None
                if self.back_at is not None and self.count_back is not None:
                    try:
                        if stats_count(f"127.0.0.1:{replica['http']}") > self.count_back:
                            self.serving_at = time.monotonic() - self.start
                            return
                    except OSError:
                        pass
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()


def plot(path: Path, rows: list[dict], events: dict[str, float | None], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["second"] + 0.5 for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    a.plot(xs, [r["ok"] for r in rows], marker="o", ms=3, label="answered requests/s")
    a.bar(xs, [r["failed"] for r in rows], color="red", label="failed requests/s")
    a.set_ylabel("requests/s")
    a.set_ylim(bottom=0)
    b.plot(xs, [r["p99_ms"] for r in rows], marker="o", ms=3, color="tab:orange", label="P99")
    b.plot(xs, [r["p50_ms"] for r in rows], marker=".", ms=3, color="tab:green", label="P50")
    b.set_ylabel("latency (ms)")
    b.set_xlabel("seconds since the load started")
    b.set_ylim(bottom=0)
    colours = {"SIGKILL": "red", "restarted": "tab:purple", "back in the front door": "tab:blue", "serving again": "tab:cyan"}
    for ax in (a, b):
        for name, at in events.items():
            if at is not None:
                ax.axvline(at, color=colours.get(name, "grey"), ls="--", lw=1, label=name if ax is a else None)
    a.legend(loc="lower left", fontsize=8)
    b.legend(loc="upper left", fontsize=8)
    a.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


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
    samples, client_stats = asyncio.run(drive(run.http_url, run.grpc_url, concurrency, duration_s, {kill_at_s: watcher.kill}))
    deadline = time.monotonic() + linger_s
    while watcher.back_at is None and time.monotonic() < deadline:
        time.sleep(0.2)
    replica = run.state()["replicas"][victim]
    victim_url = f"127.0.0.1:{replica['http']}"
    bursts = 0
    while watcher.back_at is not None and watcher.serving_at is None and bursts < 3:
        # Back at the very end of the load or after it: short bursts through the front door so
        # requests can reach it (counted with the rest, after the load's seconds).
        offset = time.monotonic() - start
        extra, _ = asyncio.run(drive(run.http_url, run.grpc_url, 4, 2.0, {}))
        samples += [Sample(s.end_s + offset, s.latency_s, s.ok, s.protocol, s.error) for s in extra]
        bursts += 1
        time.sleep(0.3)
    watcher.stop()
    count_end = stats_count(victim_url) if watcher.back_at is not None else None
    rows = per_second(samples, max(duration_s, max((s.end_s for s in samples), default=0)))
    before = [r["ok"] for r in rows if r["second"] < kill_at_s]
    last = [r["ok"] for r in rows[int(duration_s) - 5 : int(duration_s)]]
    lat = [s.latency_s * 1000 for s in samples if s.ok]
    failures = [s for s in samples if not s.ok]
    retries = {p: st["retries"] for p, st in client_stats.items()}
    return {
        "requests": len(samples),
        "failed": len(failures),
        "errors": sorted({f.error for f in failures})[:10],
        "rps_before_kill": round(statistics.mean(before), 1) if before else 0.0,
        "rps_last_5s": round(statistics.mean(last), 1) if last else 0.0,
        "p50_ms": round(percentile_of(lat, 50), 1),
        "p99_ms": round(percentile_of(lat, 99), 1),
        "max_ms": round(max(lat), 1) if lat else None,
        "killed_at_s": watcher.killed_at,
        "restarted_at_s": watcher.restarted_at,
        "back_at_s": watcher.back_at,
        "serving_at_s": watcher.serving_at,
        "victim_count_back": watcher.count_back,
        "victim_count_end": count_end,
        "victim_restarts": replica["restarts"],
        "front_door_reloads": run.state()["front_door"]["reloads"],
        "client_retries": retries,
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
    if result["back_at_s"] is None:
        problems.append("the killed replica was not back in the front door")
    elif (
        result["victim_count_end"] is None
        or result["victim_count_back"] is None
        or result["victim_count_end"] <= result["victim_count_back"]
    ):
        problems.append(
            f"the restarted replica served no request after it came back "
            f"({result['victim_count_back']} -> {result['victim_count_end']})"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m perf.drills.failover_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", action="append", dest="models", help="models to load (default text_embedding)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--kill-at", type=float, default=10.0)
    p.add_argument("--victim", type=int, default=0)
    p.add_argument("--recovery", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or RESULTS / f"failover-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%SZ')}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"failover-bench: starting serve-cluster ({args.replicas} replicas) in {out}", flush=True)
    run = launch(out / "work", replicas=args.replicas, models=tuple(args.models or MODELS))
    try:
        result = scenario(run, args.concurrency, args.duration, args.kill_at, args.victim)
    finally:
        code = run.stop()
        (out / "cluster-output.txt").write_text("\n".join(run.screen) + "\n", encoding="utf-8")
    rows = result.pop("rows")
    with open(out / "per_second.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    problems = check({**result, "rows": rows}, args.recovery)
    result["problems"] = problems
    result["launcher_exit_code"] = code
    (out / "summary.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    events = {
        "SIGKILL": result["killed_at_s"],
        "restarted": result["restarted_at_s"],
        "back in the front door": result["back_at_s"],
        "serving again": result["serving_at_s"],
    }
    plot(
        out / "failover.png",
        rows,
        events,
        f"serve-cluster, {args.replicas} replicas, {args.concurrency} clients (HTTP+gRPC): replica {args.victim} "
        f"SIGKILLed at {args.kill_at:.0f} s; {result['failed']} failed of {result['requests']}",
    )
    print(f"{'s':>3} {'req/s':>6} {'failed':>6} {'P50 ms':>7} {'P99 ms':>7} {'max ms':>7}")
    for r in rows:
        print(f"{r['second']:>3} {r['ok']:>6} {r['failed']:>6} {r['p50_ms']:>7} {r['p99_ms']:>7} {r['max_ms']:>7}")
    print(
        f"requests {result['requests']}, failed {result['failed']}; P50 {result['p50_ms']} ms, P99 "
        f"{result['p99_ms']} ms, max {result['max_ms']} ms; req/s before the kill {result['rps_before_kill']}, "
        f"last 5 s {result['rps_last_5s']}"
    )

    def at(key: str) -> str:
        return "never" if result[key] is None else f"{result[key]:.1f} s"

    print(
        f"kill at {at('killed_at_s')}, restarted at {at('restarted_at_s')}, back in the front door at "
        f"{at('back_at_s')}, serving again at {at('serving_at_s')}; its inferences {result['victim_count_back']} -> "
        f"{result['victim_count_end']}; client retries {result['client_retries']}; front door reloads "
        f"{result['front_door_reloads']}"
    )
    print(f"failover-bench: {'PASS' if not problems else 'FAIL: ' + '; '.join(problems)}; wrote {out}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
