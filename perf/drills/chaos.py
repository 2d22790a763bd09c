"""`python -m perf.drills.chaos` (`make chaos`): serve-cluster under a steady mixed load while a schedule
kills its parts, then a burst of hostile requests; the workloads, faults and checks: docs/chaos.md.

Starts `python -m server.cluster` (--replicas; embeddings, cached embeddings, images, generation;
the gateways, Redis), sends its mix as Poisson arrivals at --load of the measured peak (or --rate)
for --duration seconds with the clients people use, and at fractions of --duration SIGKILLs a
text_encoder stub, replica 1, gateway 0 and redis-server, then sends --hostile requests with the
fuzzer's mutations (tests/fuzz). Exits 1 on a failed request through a retrying client or stream,
an image failure other than UNAVAILABLE or 502/503, a fault not recovered within --recovery-timeout,
or a server error or dead stub in the burst. Writes per_second.csv (P50/P99/max over the 5 s ending
with each second), summary.md, results.json and chaos.png under perf/results/chaos-<UTC time>/.

``--scenario failover`` (`make failover-bench`): one fault alone. serve-cluster with text_embedding
(or --model) under --concurrency closed-loop embeddings clients (they retry), half over HTTP, half
over gRPC; at --kill-at replica --victim gets SIGKILL. Per second: answers, failures and
P50/P99/max; when the replica was restarted, back in the front door and serving again. Writes
per_second.csv, summary.md, results.json, failover.png and the cluster's output under
perf/results/failover-<UTC time>/. Exits 1 on a failed request, the last 5 s under --recovery x the
throughput before the kill, or the replica not serving again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from perf.drills.report import Result, latency_ms, per_second, timed, timeline
from perf.lib import processes, triton_stats
from perf.lib.chat_streams import DirectChat
from perf.lib.cluster import ClusterRun, launch
from perf.lib.load import call_loop, poisson_loop
from perf.lib.options import add_peak, finish, parser
from perf.lib.report import cpu_model, progress, results_dir, table, write
from perf.lib.workload import MixInputs
from server.supervisor import http_status

MODELS = ("text_embedding", "text_embedding_cached", "image_classification", "text_generation")
MIX = {"embed": 25, "embed_grpc": 15, "cached": 30, "gateway": 15, "image": 10, "generation": 5}
CLIENTS = {
    "embed": "clients.embeddings.aio HTTP (retries)",
    "embed_grpc": "clients.embeddings.aio gRPC (retries)",
    "cached": "clients.embeddings.aio HTTP (retries)",
    "gateway": "openai SDK (retries)",
    "image": "aiohttp (no retries)",
    "generation": "clients.generation gRPC stream (continued)",
}
# No failure allowed: idempotent requests through clients that retry, and generation streams (the
# gRPC door continues a stream whose replica died: server/stream_resume.py).
RETRIED = ("embed", "embed_grpc", "cached", "gateway", "generation")
SCHEDULE = (("stub", 0.15), ("replica", 0.35), ("gateway", 0.50), ("redis", 0.65), ("hostile burst", 0.80))
KEY = "sk-chaos-0123456789abcdef"
GEN_TOKENS = 16
WINDOW_S = 5  # a second holds ~20 answers: its P99 and max are over the 5 s ending with it
MIB = 1 << 20
FAILOVER_MODELS = ("text_embedding",)
# The failover victim's events, and the keys of their times in the scenario's result (<key>_at_s).
EVENTS = {"killed": "SIGKILL", "restarted": "restarted", "back": "back in the front door", "serving": "serving again"}


@dataclass
class Fault:
    name: str
    at_s: float | None = None
    recovered_s: float | None = None  # seconds after at_s
    detail: str = ""


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    faults: dict[str, Fault] = field(default_factory=dict)
    start: float = 0.0


def front_door_client(url: str, protocol, in_flight: int, deadline_s: float, model: str = "text_embedding"):
    """A retrying embeddings client (clients.AsyncEmbeddingClient) of the cluster's one endpoint, the
    front door, for ``in_flight`` calls at once. When a replica dies, every call in flight on it may
    fail at once (gRPC ones reach the client: nginx cannot re-send a gRPC body it already sent).
    That is not the front door being down, so the breaker opens only after more consecutive failures
    than calls in flight; with the default (5) the calls waiting on the open breaker gave up."""
    from clients import AsyncEmbeddingClient
    from clients.resilience import BreakerPolicy, EndpointPool

    pool = EndpointPool([url], breaker=BreakerPolicy(failure_threshold=in_flight + 1))
    return AsyncEmbeddingClient(url, protocol, model=model, timeout_s=30, deadline_s=deadline_s, pool=pool)


def clean_failure(error: str) -> bool:
    """A failure a client can act on: UNAVAILABLE, or 502/503 from the front door (retry later)."""
    return any(mark in error for mark in ("UNAVAILABLE", "HTTP 503", "HTTP 502", "unavailable"))


class Mix:
    def __init__(self, cluster: ClusterRun):
        import aiohttp
        import openai

        from clients.generation import AsyncGenerationClient
        from clients.resilience import BreakerPolicy, EndpointPool

        http_url, grpc_url = cluster.http_url, cluster.grpc_url
        self.embed, self.embed_grpc = front_door_client(http_url, "http", 63, 60), front_door_client(grpc_url, "grpc", 63, 60)
        self.cached = front_door_client(http_url, "http", 63, 60, "text_embedding_cached")
        pool = EndpointPool([grpc_url], breaker=BreakerPolicy(failure_threshold=64))
        self.gen = AsyncGenerationClient(grpc_url, protocol="grpc", timeout_s=60, deadline_s=60, pool=pool)
        gateway = f"http://127.0.0.1:{cluster.ports['gateway']}/v1"
        self.openai = openai.AsyncOpenAI(base_url=gateway, api_key=KEY, max_retries=4, timeout=60)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self.image_url = f"http://{http_url}/v2/models/image_classification/infer"
        self.inputs = MixInputs(f"chaos{int(time.time())}", images=4)

    async def send(self, name: str) -> None:
        if name in ("embed", "embed_grpc", "cached"):
            text = self.inputs.zipf_text() if name == "cached" else self.inputs.unique_text()
            await getattr(self, name).embed_many([text], concurrency=1, per_request=1)
        elif name == "gateway":
            answer = await self.openai.embeddings.create(model="text_embedding", input=self.inputs.unique_text())
            if len(answer.data[0].embedding) != 384:
                raise RuntimeError("not a 384-value embedding")
        elif name == "image":
            body, headers = self.inputs.image()
            async with self.session.post(self.image_url, data=body, headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {raw[:160]!r}")
        elif name == "generation":
            _, tokens = await DirectChat(self.gen).stream(self.inputs.prompt(), GEN_TOKENS)
            if tokens != GEN_TOKENS:
                raise RuntimeError(f"generation: {tokens} tokens, not {GEN_TOKENS}")
        else:
            raise ValueError(name)

    async def close(self) -> None:
        for client in (self.embed, self.embed_grpc, self.cached, self.gen):
            await client.close()
        await self.openai.close()
        await self.session.close()


# --------------------------------------------------------------------------- the faults


def encoders(triton_pid: int) -> dict[int, str]:
    """{pid: instance} of tritonserver's text_encoder stubs."""
    return {pid: instance for pid, (model, instance) in processes.stubs(triton_pid).items() if model == "text_encoder"}


class Faults:
    """Runs the schedule in its own thread (the event loop is busy with the load)."""

    def __init__(self, cluster: ClusterRun, run: Run, args, say):
        self.cluster, self.run, self.args, self.say = cluster, run, args, say
        self.burst: dict = {}
        self.thread = threading.Thread(target=self._schedule, name="chaos-faults", daemon=True)

    def _now(self) -> float:
        return time.monotonic() - self.run.start

    def _wait_for(self, fault: Fault, done: Callable[[], bool], since_s: float | None = None) -> None:
        """Poll ``done`` until it holds; ``fault.recovered_s`` counts from ``since_s`` (default the fault)."""
        since_s = fault.at_s if since_s is None else since_s
        assert since_s is not None  # a fault is waited on once it has happened (at_s set)
        deadline = time.monotonic() + self.args.recovery_timeout
        while time.monotonic() < deadline:
            try:
                if done():
                    fault.recovered_s = round(self._now() - since_s, 2)
                    return
            except (OSError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.1)
        fault.detail += f" not recovered within {self.args.recovery_timeout:.0f} s"

    def _schedule(self) -> None:
        for name, share in SCHEDULE:
            time.sleep(max(0.0, self.run.start + share * self.args.duration - time.monotonic()))
            fault = self.run.faults[name] = Fault(name)
            try:
                if name == "stub":
                    self._stub(fault)
                elif name == "replica":
                    self._restarted(fault, "replica 1", lambda s: s["replicas"][1], group=True)
                elif name == "gateway":
                    self._restarted(fault, "gateway 0", lambda s: s["gateways"][0])
                elif name == "redis":
                    self._restarted(fault, "redis-server", lambda s: {"pid": s["redis_pid"]})
                else:
                    self._hostile_burst(fault)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported
                fault.detail += f" injection failed: {type(exc).__name__}: {exc}"
            self.say(f"chaos: {name} at {fault.at_s} s: recovered after {fault.recovered_s} s {fault.detail}".rstrip())

    def _stub(self, fault: Fault) -> None:
        replica = self.cluster.state()["replicas"][0]
        before = encoders(replica["pid"])
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        fault.at_s, fault.detail = round(self._now(), 2), f"stub {before[victim]} (pid {victim}) of replica 0"
        url = f"http://127.0.0.1:{replica['http']}/v2/models/text_encoder/ready"

        def back() -> bool:
            now = encoders(replica["pid"])
            return victim not in now and len(now) >= len(before) and http_status(url) == 200

        self._wait_for(fault, back)

    def _restarted(self, fault: Fault, label: str, entry: Callable[[dict], dict], group: bool = False) -> None:
        """SIGKILL the process of ``entry(cluster.json)`` (its process group with ``group``); recovered
        when cluster.json shows it ready with a new pid."""
        pid = entry(self.cluster.state())["pid"]
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
        fault.at_s, fault.detail = round(self._now(), 2), f"{label} (pid {pid})"

        def back() -> bool:
            now = entry(self.cluster.state())
            return now["pid"] not in (None, pid) and now.get("state", "ready") == "ready"

        self._wait_for(fault, back)

    def _hostile_burst(self, fault: Fault) -> None:
        from tests.fuzz import endpoints as fuzz

        replicas = self.cluster.state()["replicas"]
        before = {r["index"]: set(processes.stubs(r["pid"])) for r in replicas}
        fault.at_s = round(self._now(), 2)
        tally = fuzz.Tally()
        models = fuzz.served_models(self.cluster.http_url, MODELS)
        fuzz.run_endpoint_fuzz(
            self.cluster.http_url, self.cluster.grpc_url, models, self.args.hostile, 23, lambda _m: None, tally
        )
        took, bad = self._now() - fault.at_s, tally.bad()
        fault.detail = f"{tally.total()} hostile requests in {took:.1f} s, {sum(bad.values())} server errors"
        # afterwards: every stub of every replica the same process, every model ready on every replica
        lost = {i: sorted(pids - set(processes.stubs(replicas[i]["pid"]))) for i, pids in before.items()}
        lost = {i: pids for i, pids in lost.items() if pids}
        fault.detail += f"; stubs gone: {lost}" if lost else ""
        self.burst = {"cases": tally.total(), "server errors": sum(bad.values()), "kinds": dict(bad)}
        self.burst |= {"findings": tally.findings[:10], "seconds": round(took, 1), "stubs_gone": lost}
        urls = [f"http://127.0.0.1:{r['http']}/v2/models/{m}/ready" for r in replicas for m in MODELS]
        self._wait_for(fault, lambda: not lost and all(http_status(u) == 200 for u in urls), since_s=fault.at_s + took)


async def drive(cluster, args, say) -> tuple[Run, float, float, tuple[float, float], dict]:
    mix, rng = Mix(cluster), random.Random(11)

    def draw() -> str:
        return rng.choices(list(MIX), list(MIX.values()))[0]

    try:
        say(f"chaos: measuring the mix's peak for {args.peak_seconds:.0f} s ({args.peak_concurrency} clients)")
        tally = await call_loop(lambda _n: asyncio.wait_for(mix.send(draw()), 90), args.peak_concurrency, args.peak_seconds)
        peak_rps = len(tally.ok) / tally.seconds
        rate, rss_before = args.rate or args.load * peak_rps, processes.tree_rss(cluster.proc.pid) / MIB
        say(f"chaos: peak {peak_rps:.1f} answers/s; soaking at {rate:.1f} requests/s for {args.duration:.0f} s")
        run = Run(start=time.monotonic())
        faults = Faults(cluster, run, args, say)
        faults.thread.start()
        await poisson_loop(
            lambda _n: timed(mix.send, draw(), run.results, run.start, 90), rate, args.duration, seed=7, start=run.start
        )
        faults.thread.join(timeout=args.recovery_timeout + 60)
        return run, peak_rps, rate, (rss_before, processes.tree_rss(cluster.proc.pid) / MIB), faults.burst
    finally:
        await mix.close()


# --------------------------------------------------------------------------- the report


def summarize(run: Run) -> dict:
    out = {}
    for name in MIX:
        mine = [r for r in run.results if r.workload == name]
        failed = [r for r in mine if r.error]
        unclean = sum(not clean_failure(r.error) for r in failed)
        errors = sorted({r.error[:160] for r in failed})[:5]
        out[name] = {"sent": len(mine), "failed": len(failed), "unclean": unclean, **latency_ms(mine), "errors": errors}
    return out


def checks(workloads: dict, faults: dict[str, Fault], burst: dict) -> list[str]:
    problems = []
    for name, row in workloads.items():
        if name in RETRIED and row["failed"]:
            problems.append(f"{name}: {row['failed']} failed requests through a retrying or continuing path ({row['errors']})")
        elif row["unclean"]:
            problems.append(f"{name}: {row['unclean']} failures that are not a clean UNAVAILABLE/502/503 ({row['errors']})")
    problems += [f"fault {f.name}: not recovered ({f.detail.strip()})" for f in faults.values() if f.recovered_s is None]
    if burst.get("server errors"):
        findings = [(f["endpoint"], f["outcome"], f["detail"][:150]) for f in burst["findings"][:5]]
        problems.append(f"hostile burst: {burst['server errors']} server errors {burst['kinds']}: {findings}")
    if burst.get("stubs_gone"):
        problems.append(f"hostile burst: stubs gone afterwards {burst['stubs_gone']}")
    return problems


def summary(args, rate: float, peak_rps: float, workloads: dict, faults, rss, burst: dict, problems, cpu: str) -> str:
    rows = [
        [n, CLIENTS[n], f"{r['sent']:,}", r["failed"], r["unclean"], r["p50_ms"], r["p99_ms"], r["max_ms"]]
        for n, r in workloads.items()
    ]
    lines = [
        f"# chaos soak: {args.duration:.0f} s at {args.load:.0%} of the peak ({peak_rps:.1f} answers/s -> "
        f"{rate:.1f} requests/s), {args.replicas} replicas",
        "",
        f"CPU: {cpu}. Command: `{' '.join(['python -m perf.drills.chaos', *args.argv])}`",
        "",
        table(["workload", "client", "sent", "failed", "not clean", "P50 ms", "P99 ms", "max ms"], rows, left=2),
        "",
        table(
            ["fault", "at s", "recovered after s", "detail"],
            [[f.name, f.at_s, f.recovered_s, f.detail.strip()] for f in faults.values()],
        ),
        "",
        f"RSS of the whole cluster (launcher and every process under it): {rss[0]:,.0f} MiB before the "
        f"load, {rss[1]:,.0f} MiB after ({rss[1] - rss[0]:+,.0f} MiB).",
        f"Hostile burst: {burst.get('cases', 0)} requests, {burst.get('server errors', 0)} server errors.",
        f"New calls the gRPC door opened to continue generation streams that lost their replica (a stream "
        f"that meets no ready replica takes several): {burst.get('streams_continued', 0)}.",
        "",
    ]
    if errors := sorted({e for row in workloads.values() for e in row["errors"]}):
        lines += ["Failures seen:", "", *[f"- `{e}`" for e in errors], ""]
    lines += ["Checks: " + ("all passed" if not problems else "FAILED"), *[f"- {p}" for p in problems]]
    return "\n".join(lines) + "\n"


def streams_continued(state: dict) -> int:
    """New calls the gRPC door opened to continue streams (its log, beside the front door's)."""
    try:
        log = (Path(state["front_door"]["log"]).parent / "grpc-door.log").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return 0
    return log.count("continued on a new call")


# --------------------------------------------------------------------------- the failover scenario


def stats_count(http_url: str, model: str = "text_embedding") -> int:
    """Successful inferences of ``model`` on one tritonserver (its own statistics)."""
    stats = triton_stats.snapshot(http_url, timeout=5)
    return sum(int(s["inference_stats"]["success"]["count"]) for key, s in stats.items() if key.startswith(f"{model}@"))


async def failover_load(
    http_url: str, grpc_url: str, concurrency: int, duration_s: float, offset_s: float = 0.0
) -> tuple[list[Result], dict]:
    """``concurrency`` closed-loop workers sending one unique text per request, every other one over
    gRPC; the results (workload: the protocol; times from ``offset_s``) and the clients' retry stats."""
    urls = {"http": http_url, "grpc": grpc_url}
    clients = {p: front_door_client(url, p, concurrency, 30) for p, url in urls.items()}
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


def failover_scenario(
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
        results, client_stats = asyncio.run(failover_load(run.http_url, run.grpc_url, concurrency, duration_s))
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
        results += asyncio.run(failover_load(run.http_url, run.grpc_url, 4, 2.0, time.monotonic() - start))[0]
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


def check_failover(result: dict, recovery: float = 0.5) -> list[str]:
    """The failover scenario's failed checks (empty: passed)."""
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


def run_failover(args: argparse.Namespace) -> int:
    out = results_dir(args.out, "failover")
    progress()(f"failover: starting serve-cluster ({args.replicas} replicas) in {out}")
    run = launch(out / "work", replicas=args.replicas, models=tuple(args.models or FAILOVER_MODELS))
    try:
        result = failover_scenario(run, args.concurrency, args.duration, args.kill_at, args.victim)
    finally:
        code = run.stop()
        (out / "cluster-output.txt").write_text("\n".join(run.screen) + "\n", encoding="utf-8")
    rows = result.pop("rows")
    problems = result["problems"] = check_failover(result, args.recovery)
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
            f"# failover: {title}",
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


def parse_args(argv) -> argparse.Namespace:
    p = parser("perf.drills.chaos", __doc__)
    p.add_argument("--scenario", choices=("chaos", "failover"), default="chaos", help="the schedule (default) or failover")
    p.add_argument("--duration", type=float, help="seconds of load (default 300; failover 30)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    add_peak(p)
    p.add_argument("--hostile", type=int, default=200, help="requests in the hostile burst (default 200)")
    p.add_argument("--recovery-timeout", type=float, default=60.0)
    failover = p.add_argument_group("--scenario failover")
    failover.add_argument("--model", action="append", dest="models", help="models to load (default text_embedding)")
    failover.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (default 16)")
    failover.add_argument("--kill-at", type=float, default=10.0, help="seconds into the load (default 10)")
    failover.add_argument("--victim", type=int, default=0, help="the replica killed (default 0)")
    failover.add_argument("--recovery", type=float, default=0.5, help="last 5 s / before the kill, at least (default 0.5)")
    args = p.parse_args(argv)
    if args.duration is None:
        args.duration = 30.0 if args.scenario == "failover" else 300.0
    return finish(p, args, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.scenario == "failover":
        return run_failover(args)
    out, say = results_dir(args.out, "chaos"), progress()
    say(f"chaos: starting serve-cluster ({args.replicas} replicas: {', '.join(MODELS)}) in {out}")
    env = {"GATEWAY_API_KEYS": KEY, "GATEWAY_RATE_LIMIT_RPS": "0"}
    cluster = launch(out / "work", replicas=args.replicas, models=MODELS, prometheus=False, env=env)
    try:
        run, peak_rps, rate, rss, burst = asyncio.run(drive(cluster, args, say))
        state = cluster.state()
        burst["streams_continued"] = streams_continued(state)
    finally:
        cluster.stop(timeout=60)
    rows = per_second(run.results, args.duration, WINDOW_S, skip=("generation",))
    workloads = summarize(run)
    problems = checks(workloads, run.faults, burst)
    cpu = cpu_model()
    text = summary(args, rate, peak_rps, workloads, run.faults, rss, burst, problems, cpu)
    faults = {k: vars(v) for k, v in run.faults.items()}
    figures = {"peak_rps": peak_rps, "rate": rate, "cluster": state, "problems": problems}
    data = {"table": workloads, "faults": faults, "rss_mib": rss, "burst": burst, **figures}
    sent, failed = sum(r["sent"] for r in workloads.values()), sum(r["failed"] for r in workloads.values())
    events = {
        f.name: (f.at_s, None if f.at_s is None or f.recovered_s is None else f.at_s + f.recovered_s) for f in run.faults.values()
    }
    title = f"serve-cluster, {args.replicas} replicas, {rate:.0f} req/s ({args.load:.0%} of peak): {sent:,} requests, {failed} failed; {cpu}"
    timeline(out / "chaos.png", rows, events, title)
    write(out, text, data, csvs={"per_second.csv": rows}, say=say)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
