"""`python -m perf.drills.chaos` (`make chaos`): serve-cluster under a steady mixed load while a schedule
kills its parts, then a burst of hostile requests; what failed, how long each part took to come
back, and the memory before and after.

Starts `python -m server.cluster` (--replicas, default 2, with text_embedding,
text_embedding_cached, image_classification and text_generation; the gateways, Redis; its own
ports and work folder), measures the mix's peak with closed-loop clients for --peak-seconds,
then sends the mix open-loop (Poisson arrivals) at --load (0.7) of that peak for --duration
seconds, through the front door, with the clients people use:

  embed        text_embedding, the project's asyncio client over HTTP (retries)
  embed_grpc   text_embedding, the project's asyncio client over gRPC (retries)
  cached       text_embedding_cached, the project's asyncio client over HTTP (retries)
  gateway      POST /v1/embeddings through the official `openai` SDK (its retries)
  image        image_classification, plain aiohttp POSTs (no retries)
  generation   text_generation streams, the project's asyncio client over gRPC (retried before the
               first piece only; a stream whose replica dies later is continued by the gRPC door on
               the other replica, after the token ids already sent)

The faults, at fractions of --duration: 0.15 SIGKILL of one text_encoder stub of replica 0;
0.35 SIGKILL of replica 1's tritonserver and stubs; 0.50 SIGKILL of gateway 0; 0.65 SIGKILL of
redis-server; 0.80 a burst of --hostile hostile requests (tests.fuzz's mutations, HTTP and gRPC,
wrapping shapes among them) to every model. Recovery per fault: stub, the replica's stubs of
text_encoder back to their number with the model ready; replica, gateway and Redis, back
ready in cluster.json with a new pid; burst (counted from its end), every request answered
4xx / INVALID_ARGUMENT, every stub of every replica the same process and every model ready.

Checks (exit 1 when one fails): 0 failed requests of the retried idempotent workloads (embed,
embed_grpc, cached, gateway) and of the generation streams; the image requests only clean failures (UNAVAILABLE, 502/503 with the
front door's JSON); every fault recovered within --recovery-timeout (60 s); no server error in
the burst. Writes per_second.csv, summary.md and chaos.png (answers/s, failed/s and P99 per
second, the faults marked) under perf/results/chaos-<UTC time>/ (--out DIR).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import io
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

from perf.drills import failover_bench
from perf.drills.chaos_report import (
    MIX,
    Fault,
    Result,
    Run,
    checks,
    cpu_model,
    per_second,
    plot,
    streams_continued,
    summarize,
    write_summary,
)
from perf.drills.chaos_report import RETRIED as RETRIED  # the smoke test reads chaos.RETRIED
from perf.lib import processes
from perf.lib.paths import RESULTS
from perf.lib.workload import image_request, photos, prompts, sentences

MODELS = ("text_embedding", "text_embedding_cached", "image_classification", "text_generation")
SCHEDULE = (("stub", 0.15), ("replica", 0.35), ("gateway", 0.50), ("redis", 0.65), ("hostile burst", 0.80))
KEY = "sk-chaos-0123456789abcdef"
GEN_TOKENS = 16
MIB = 1 << 20


# --------------------------------------------------------------------------- the mix


class Mix:
    def __init__(self, cluster: failover_bench.ClusterRun, nonce: str):
        import aiohttp
        import openai

        from clients import AsyncEmbeddingClient
        from clients.generation import AsyncGenerationClient
        from clients.resilience import BreakerPolicy, EndpointPool

        http_url, grpc_url = cluster.http_url, cluster.grpc_url

        # One endpoint (the front door) for many calls in flight: the breaker opens only after
        # more consecutive failures than calls in flight (perf/drills/failover_bench.py says why).
        def pool(url):
            return EndpointPool([url], breaker=BreakerPolicy(failure_threshold=64))

        self.embed = AsyncEmbeddingClient(http_url, "http", timeout_s=30, deadline_s=60, pool=pool(http_url))
        self.embed_grpc = AsyncEmbeddingClient(grpc_url, "grpc", timeout_s=30, deadline_s=60, pool=pool(grpc_url))
        self.cached = AsyncEmbeddingClient(
            http_url, "http", model="text_embedding_cached", timeout_s=30, deadline_s=60, pool=pool(http_url)
        )
        self.gen = AsyncGenerationClient(grpc_url, protocol="grpc", timeout_s=60, deadline_s=60, pool=pool(grpc_url))
        self.openai = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{cluster.ports['gateway']}/v1", api_key=KEY, max_retries=4, timeout=60
        )
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self.image_url = f"http://{http_url}/v2/models/image_classification/infer"
        self.texts = sentences()
        self.prompts = prompts()
        self.rng = random.Random(nonce)
        self.nonce = nonce
        self.n = 0
        self.images = []
        for im in photos(4):
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=90)
            self.images.append(image_request(buf.getvalue()))
        self.zipf = [f"{self.texts[k % len(self.texts)]} (set {k})" for k in range(500)]
        self.zipf_weights = [1 / (k + 1) ** 1.1 for k in range(500)]

    def unique(self) -> str:
        self.n += 1
        return f"{self.texts[self.n % len(self.texts)]} ({self.nonce}-{self.n})"

    async def send(self, name: str) -> None:
        if name == "embed":
            await self.embed.embed_many([self.unique()], concurrency=1, per_request=1)
        elif name == "embed_grpc":
            await self.embed_grpc.embed_many([self.unique()], concurrency=1, per_request=1)
        elif name == "cached":
            text = self.rng.choices(self.zipf, weights=self.zipf_weights)[0]
            await self.cached.embed_many([text], concurrency=1, per_request=1)
        elif name == "gateway":
            answer = await self.openai.embeddings.create(model="text_embedding", input=self.unique())
            if len(answer.data[0].embedding) != 384:
                raise RuntimeError("not a 384-value embedding")
        elif name == "image":
            body, headers = self.rng.choice(self.images)
            async with self.session.post(self.image_url, data=body, headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {raw[:160]!r}")
        elif name == "generation":
            stream = self.gen.chat_stream(
                [{"role": "user", "content": self.rng.choice(self.prompts)}],
                max_tokens=GEN_TOKENS,
                temperature=0,
                ignore_eos=True,
            )
            async with stream:
                async for _ in stream:
                    pass
            if stream.result is None or stream.result.num_output_tokens != GEN_TOKENS:
                got = None if stream.result is None else stream.result.num_output_tokens
                raise RuntimeError(f"generation: {got} tokens, not {GEN_TOKENS}")
        else:
            raise ValueError(name)

    async def close(self) -> None:
        for client in (self.embed, self.embed_grpc, self.cached, self.gen):
            await client.close()
        await self.openai.close()
        await self.session.close()


async def timed(mix: Mix, run: Run, name: str) -> None:
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(mix.send(name), 90)
        error = ""
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, the run goes on
        error = f"{type(exc).__name__}: {exc}"[:300]
    now = time.monotonic()
    run.results.append(Result(name, now - run.start, now - t0, error))


async def peak(mix: Mix, seconds: float, concurrency: int) -> float:
    """Answers per second of the mix with ``concurrency`` closed-loop clients."""
    names, weights = list(MIX), list(MIX.values())
    scratch = Run(start=time.monotonic())
    stop_at = scratch.start + seconds
    rng = random.Random(7)

    async def client():
        while time.monotonic() < stop_at:
            await timed(mix, scratch, rng.choices(names, weights)[0])

    await asyncio.gather(*(client() for _ in range(concurrency)))
    ok = sum(1 for r in scratch.results if not r.error)
    return ok / (time.monotonic() - scratch.start)


async def open_loop(mix: Mix, run: Run, rate: float, duration_s: float) -> None:
    """Poisson arrivals at ``rate`` per second for ``duration_s``, each a draw from the mix."""
    names, weights = list(MIX), list(MIX.values())
    rng = random.Random(11)
    tasks: set[asyncio.Task] = set()
    at = run.start
    end = run.start + duration_s
    while True:
        at += rng.expovariate(rate)
        if at >= end:
            break
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.ensure_future(timed(mix, run, rng.choices(names, weights)[0]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


# --------------------------------------------------------------------------- the faults


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = processes.children(p)
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def rss_mib(pid: int) -> float:
    """RSS of ``pid`` and everything under it (the launcher: replicas, stubs, nginx, gateways, Redis)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        s = processes.sample(p)
        total += s.rss_bytes if s else 0
    return total / MIB


def encoder_stubs(triton_pid: int) -> dict[int, str]:
    out = {}
    for p in processes.children(triton_pid):
        try:
            ident = processes.stub_identity(processes.cmdline(p))
        except OSError:
            continue
        if ident and ident[0] == "text_encoder":
            out[p] = ident[1]
    return out


def stub_pids(triton_pid: int) -> list[int]:
    out = []
    for p in processes.children(triton_pid):
        try:
            if processes.stub_identity(processes.cmdline(p)):
                out.append(p)
        except OSError:
            continue
    return out


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Faults:
    """Runs the schedule in its own thread (the event loop is busy with the load)."""

    def __init__(
        self, cluster: failover_bench.ClusterRun, run: Run, duration_s: float, hostile: int, recovery_timeout_s: float, say
    ):
        self.cluster, self.run, self.duration_s = cluster, run, duration_s
        self.hostile, self.timeout, self.say = hostile, recovery_timeout_s, say
        self.burst: dict = {}
        self.thread = threading.Thread(target=self._schedule, name="chaos-faults", daemon=True)

    def _now(self) -> float:
        return time.monotonic() - self.run.start

    def _wait_for(self, fault: Fault, done, since_s: float | None = None) -> None:
        """Poll ``done`` until it holds; ``fault.recovered_s`` counts from ``since_s`` (default the fault)."""
        since_s = fault.at_s if since_s is None else since_s
        assert since_s is not None  # a fault is waited on once it has happened (at_s set)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                if done():
                    fault.recovered_s = round(self._now() - since_s, 2)
                    return
            except (OSError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.1)
        fault.detail += f" not recovered within {self.timeout:.0f} s"

    def _schedule(self) -> None:
        for name, share in SCHEDULE:
            delay = self.run.start + share * self.duration_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            fault = self.run.faults[name] = Fault(name)
            try:
                getattr(self, "_" + name.replace(" ", "_"))(fault)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported
                fault.detail += f" injection failed: {type(exc).__name__}: {exc}"
            self.say(f"chaos: {name} at {fault.at_s} s: recovered after {fault.recovered_s} s {fault.detail}".rstrip())

    def _stub(self, fault: Fault) -> None:
        replica = self.cluster.state()["replicas"][0]
        stubs = encoder_stubs(replica["pid"])
        victim = sorted(stubs)[0]
        os.kill(victim, signal.SIGKILL)
        fault.at_s = round(self._now(), 2)
        fault.detail = f"stub {stubs[victim]} (pid {victim}) of replica 0"
        url = f"http://127.0.0.1:{replica['http']}/v2/models/text_encoder/ready"

        def back() -> bool:
            now = encoder_stubs(replica["pid"])
            return victim not in now and len(now) >= len(stubs) and ready(url)

        self._wait_for(fault, back)

    def _replica(self, fault: Fault) -> None:
        replica = self.cluster.state()["replicas"][1]
        os.killpg(replica["pid"], signal.SIGKILL)
        fault.at_s = round(self._now(), 2)
        fault.detail = f"replica 1 (pid {replica['pid']})"

        def back() -> bool:
            now = self.cluster.state()["replicas"][1]
            return now["pid"] != replica["pid"] and now["state"] == "ready"

        self._wait_for(fault, back)

    def _gateway(self, fault: Fault) -> None:
        gateway = self.cluster.state()["gateways"][0]
        os.kill(gateway["pid"], signal.SIGKILL)
        fault.at_s = round(self._now(), 2)
        fault.detail = f"gateway 0 (pid {gateway['pid']})"

        def back() -> bool:
            now = self.cluster.state()["gateways"][0]
            return now["pid"] not in (None, gateway["pid"]) and now["state"] == "ready"

        self._wait_for(fault, back)

    def _redis(self, fault: Fault) -> None:
        pid = self.cluster.state()["redis_pid"]
        os.kill(pid, signal.SIGKILL)
        fault.at_s = round(self._now(), 2)
        fault.detail = f"redis-server (pid {pid})"
        self._wait_for(fault, lambda: self.cluster.state()["redis_pid"] not in (None, pid))

    def _hostile_burst(self, fault: Fault) -> None:
        from tests.fuzz import endpoints as fuzz

        replicas = self.cluster.state()["replicas"]
        stubs_before = {r["index"]: set(stub_pids(r["pid"])) for r in replicas}
        fault.at_s = round(self._now(), 2)
        tally = fuzz.Tally()
        models = fuzz.served_models(self.cluster.http_url, MODELS)
        fuzz.run_endpoint_fuzz(
            self.cluster.http_url, self.cluster.grpc_url, models, self.hostile, seed=23, say=lambda _m: None, tally=tally
        )
        took = self._now() - fault.at_s
        bad = tally.bad()
        self.burst = {
            "cases": tally.total(),
            "server errors": sum(bad.values()),
            "kinds": dict(bad),
            "findings": tally.findings[:10],
            "seconds": round(took, 1),
        }
        fault.detail = f"{tally.total()} hostile requests in {took:.1f} s, {sum(bad.values())} server errors"
        # afterwards: every stub of every replica the same process, every model ready on every replica
        lost = {i: sorted(before - set(stub_pids(replicas[i]["pid"]))) for i, before in stubs_before.items()}
        lost = {i: pids for i, pids in lost.items() if pids}
        if lost:
            fault.detail += f"; stubs gone: {lost}"
        self.burst["stubs_gone"] = lost
        # recovered: counted from the burst's end
        self._wait_for(
            fault,
            lambda: (
                not lost and all(ready(f"http://127.0.0.1:{r['http']}/v2/models/{m}/ready") for r in replicas for m in MODELS)
            ),
            since_s=fault.at_s + took,
        )


async def drive(cluster, args, say) -> tuple[Run, float, float, tuple[float, float], dict]:
    mix = Mix(cluster, f"chaos{int(time.time())}")
    try:
        say(f"chaos: measuring the mix's peak for {args.peak_seconds:.0f} s ({args.peak_concurrency} clients)")
        peak_rps = await peak(mix, args.peak_seconds, args.peak_concurrency)
        rate = args.rate or args.load * peak_rps
        rss_before = rss_mib(cluster.proc.pid)
        say(f"chaos: peak {peak_rps:.1f} answers/s; soaking at {rate:.1f} requests/s for {args.duration:.0f} s")
        run = Run(start=time.monotonic())
        faults = Faults(cluster, run, args.duration, args.hostile, args.recovery_timeout, say)
        faults.thread.start()
        await open_loop(mix, run, rate, args.duration)
        faults.thread.join(timeout=args.recovery_timeout + 60)
        rss_after = rss_mib(cluster.proc.pid)
        return run, peak_rps, rate, (rss_before, rss_after), faults.burst
    finally:
        await mix.close()


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.drills.chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--load", type=float, default=0.7, help="share of the measured peak (default 0.7)")
    p.add_argument("--rate", type=float, default=None, help="requests/s instead of --load x peak")
    p.add_argument("--peak-seconds", type=float, default=20.0)
    p.add_argument("--peak-concurrency", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--hostile", type=int, default=200, help="requests in the hostile burst (default 200)")
    p.add_argument("--recovery-timeout", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out or RESULTS / f"chaos-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}"
    out.mkdir(parents=True, exist_ok=True)

    def say(message: str) -> None:
        print(message, flush=True)

    say(f"chaos: starting serve-cluster ({args.replicas} replicas: {', '.join(MODELS)}) in {out}")
    cluster = failover_bench.launch(
        out / "work",
        replicas=args.replicas,
        models=MODELS,
        prometheus=False,
        env={"GATEWAY_API_KEYS": KEY, "GATEWAY_RATE_LIMIT_RPS": "0"},
    )
    try:
        run, peak_rps, rate, rss, burst = asyncio.run(drive(cluster, args, say))
        state = cluster.state()
        burst["streams_continued"] = streams_continued(state)
    finally:
        cluster.stop(timeout=60)
    rows = per_second(run, args.duration)
    with (out / "per_second.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = summarize(run)
    problems = checks(table, run.faults, burst)
    cpu = cpu_model()
    text = write_summary(out / "summary.md", args, rate, peak_rps, table, run.faults, rss, burst, problems, cpu)
    (out / "summary.json").write_text(
        json.dumps(
            {
                "table": table,
                "faults": {k: vars(v) for k, v in run.faults.items()},
                "rss_mib": rss,
                "burst": burst,
                "peak_rps": peak_rps,
                "rate": rate,
                "cluster": state,
                "problems": problems,
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    sent = sum(r["sent"] for r in table.values())
    failed = sum(r["failed"] for r in table.values())
    plot(
        out / "chaos.png",
        rows,
        run.faults,
        f"serve-cluster, {args.replicas} replicas, {rate:.0f} req/s ({args.load:.0%} of peak): {sent:,} requests, "
        f"{failed} failed; {cpu}",
    )
    say(text)
    say(f"chaos: wrote {out}/summary.md, chaos.png, per_second.csv")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
