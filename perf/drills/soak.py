"""`python -m perf.drills.soak` (`make soak`): a bounded soak of the whole deployment at about 70 % of peak.

Starts its own deployment with the launcher's code (server.deployment.Deployment: tritonserver behind the
nginx front door, Triton's response cache at the launcher's default size, Redis as
text_embedding_cached's L2 when redis-server is installed, and the OpenAI gateway as
perf.bench.gateway_bench starts it), measures the mix's peak throughput with --peak-concurrency
closed-loop clients for --peak-seconds (or takes --rate; before either, one burst of twice the
largest batch of image_classifier and of text_encoder, so ONNX Runtime's arenas have grown to
their largest batch before the warm-up ends), then sends the mix open-loop
(Poisson arrivals) at --load (default 0.7) of that peak for --duration seconds (default 600):

  embed           text_embedding over HTTP, unique texts (every one computed)
  cached          text_embedding_cached over HTTP, a Zipf-distributed set of --zipf-texts texts
  image           image_classification over HTTP, a few of the bundled sample photos (JPEG)
  gateway_embed   POST /v1/embeddings on the gateway, unique texts
  generation      text_generation over gRPC streams, --max-tokens tokens (ignore_eos); every
                  --cancel-every-th stream is cancelled after 3 pieces (a cancellation is not an error)
  gateway_chat    POST /v1/chat/completions stream on the gateway, the same tokens and cancellations
                  (the client closes the connection mid-stream)

Every --interval seconds (default 60; 10 for runs under 5 minutes) it samples the RSS and CPU
of every process (tritonserver, each python backend stub by model instance, the front door's
nginx processes, the gateway, Redis, the load generator itself) and each workload's latency
P50/P99/max over the interval (streams: the whole stream, and time to first token as
``<name>_ttft``).

Checks, after a warm-up (--warmup, default 60 s; a third of the run for runs under 5 minutes):
  - zero errors: every request answered (HTTP 200, the stream's tokens), no request shed for
    lack of capacity (more than --max-in-flight in flight), no process exited or restarted;
  - RSS: per process, the least-squares slope over the post-warm-up samples times their span
    must not exceed max(--rss-growth-pct (5) % of its RSS at the end of the warm-up,
    --rss-growth-mib (20) MiB);
  - P99 trend: per workload, the rise of the per-interval P99 over the same span, fitted robustly
    (Theil-Sen: the median of the pairwise slopes; intervals with at least 5 answers), must not
    exceed max(--p99-growth (1.0) x its median interval P99, 50 ms).
During the peak measurement the admission control may refuse requests (HTTP 503): those are
reported, not counted as errors; during the soak every refusal is an error.
Writes samples.csv, latency.csv, summary.md, soak.png (RSS per process, its change since the
warm-up, P99 per workload, over time) and the servers' logs under perf/results/soak-<UTC time>/
(--out DIR); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import io
import itertools
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from perf.drills.soak_report import MIN_P99_RISE_MS, p99_checks, plot, rss_checks, summary
from perf.lib import processes
from perf.lib.deployment import start_deployment
from perf.lib.harness import write_csv
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.report import load_average, progress
from perf.lib.stats import percentile
from perf.lib.workload import gateway_request, image_request, photos, prompts, sentences, text_request

MODELS = ("text_embedding", "text_embedding_cached", "image_classification", "text_generation")
# Share of arrivals per workload (percent). Generation streams cost tens of times an embedding
# (docs/performance.md, CPU accounting), so they are a small share of the requests.
DEFAULT_MIX = {"embed": 30, "cached": 35, "image": 10, "gateway_embed": 18, "generation": 4, "gateway_chat": 3}
REFUSED = "HTTP 503"
MIB = 1 << 20


# --------------------------------------------------------------------------- workloads


class Cancelled(Exception):
    """A stream the load generator cancelled on purpose."""


@dataclass
class Outcome:
    latency_s: float
    ttft_s: float | None = None
    cancelled: bool = False


class Mix:
    """Sends one request of a named workload and checks its answer; raises on any failure."""

    def __init__(self, session, triton, gateway_url: str, key: str, gen_client, args, nonce: str):
        self.session, self.gen, self.args = session, gen_client, args
        self.base = f"http://{triton.http_url}/v2/models"
        self.gateway_url, self.key = gateway_url, key
        self.texts = sentences()
        self.nonce = nonce
        self.counter = itertools.count()
        self.rng = random.Random(nonce)
        # Zipf-ish: text k of the set drawn with weight 1 / (k + 1) ** 1.1.
        self.zipf = [f"{self.texts[k % len(self.texts)]} (set {k})" for k in range(args.zipf_texts)]
        self.zipf_cum = list(itertools.accumulate(1 / (k + 1) ** 1.1 for k in range(args.zipf_texts)))
        self.images = []
        for im in photos(args.images):
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=90)
            self.images.append(image_request(buf.getvalue()))
        self.prompts = prompts()
        self.streams = itertools.count(1)

    def unique_text(self) -> str:
        n = next(self.counter)
        return f"{self.texts[n % len(self.texts)]} ({self.nonce}-{n})"

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> bytes:
        async with self.session.post(url, data=body, headers=headers) as r:
            raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {raw[:200]!r}")
            return raw

    async def send(self, name: str) -> Outcome:
        t0 = time.perf_counter()
        if name == "embed":
            await self._post(f"{self.base}/text_embedding/infer", *text_request(self.unique_text()))
        elif name == "cached":
            text = self.rng.choices(self.zipf, cum_weights=self.zipf_cum)[0]
            await self._post(f"{self.base}/text_embedding_cached/infer", *text_request(text))
        elif name == "image":
            await self._post(f"{self.base}/image_classification/infer", *self.rng.choice(self.images))
        elif name == "gateway_embed":
            raw = await self._post(f"{self.gateway_url}/v1/embeddings", *gateway_request(self.unique_text(), self.key))
            if len(json.loads(raw)["data"][0]["embedding"]) != 384:
                raise RuntimeError("not a 384-value embedding")
        elif name == "generation":
            return await self._generation(t0)
        elif name == "gateway_chat":
            return await self._chat(t0)
        else:
            raise ValueError(name)
        return Outcome(time.perf_counter() - t0)

    def _cancel_this(self) -> bool:
        return self.args.cancel_every > 0 and next(self.streams) % self.args.cancel_every == 0

    async def _generation(self, t0: float) -> Outcome:
        cancel = self._cancel_this()
        stream = self.gen.chat_stream(
            [{"role": "user", "content": self.rng.choice(self.prompts)}],
            max_tokens=self.args.max_tokens,
            temperature=0,
            ignore_eos=True,
        )
        ttft = None
        pieces = 0
        async with stream:
            async for text in stream:
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                pieces += 1
                if cancel and pieces >= 3:
                    await stream.aclose()  # cancels the request on the server
                    return Outcome(time.perf_counter() - t0, ttft, cancelled=True)
        if stream.result is None or stream.result.num_output_tokens != self.args.max_tokens:
            got = None if stream.result is None else stream.result.num_output_tokens
            raise RuntimeError(f"generation: {got} tokens, not {self.args.max_tokens}")
        return Outcome(time.perf_counter() - t0, ttft)

    async def _chat(self, t0: float) -> Outcome:
        import orjson

        cancel = self._cancel_this()
        body = orjson.dumps(
            {
                "model": "text_generation",
                "messages": [{"role": "user", "content": self.rng.choice(self.prompts)}],
                "max_tokens": self.args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        ttft = None
        tokens = None
        chunks = 0
        async with self.session.post(f"{self.gateway_url}/v1/chat/completions", data=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = orjson.loads(data)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if any(c.get("delta", {}).get("content") for c in event.get("choices", ())):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    if cancel and chunks >= 3:
                        resp.close()  # the connection drops: the gateway cancels the Triton stream
                        return Outcome(time.perf_counter() - t0, ttft, cancelled=True)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        if tokens != self.args.max_tokens:
            raise RuntimeError(f"gateway chat: {tokens} completion tokens, not {self.args.max_tokens}")
        return Outcome(time.perf_counter() - t0, ttft)


# --------------------------------------------------------------------------- recording


@dataclass
class Recorder:
    """Latencies per workload for the current interval, and the run's counts."""

    current: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    interval_errors: dict[str, int] = field(default_factory=dict)
    interval_cancelled: dict[str, int] = field(default_factory=dict)
    ok: dict[str, int] = field(default_factory=dict)
    cancelled: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    shed: int = 0
    all_errors: list[str] = field(default_factory=list)  # every failure's message (the peak phase's are sorted)
    peak_refused: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # the failures that were 503s (admission control)

    def add(self, name: str, outcome: Outcome) -> None:
        if outcome.cancelled:
            self.cancelled[name] = self.cancelled.get(name, 0) + 1
            self.interval_cancelled[name] = self.interval_cancelled.get(name, 0) + 1
        else:
            self.ok[name] = self.ok.get(name, 0) + 1
            self.current.setdefault(name, []).append(outcome.latency_s)
        if outcome.ttft_s is not None:
            self.current.setdefault(f"{name}_ttft", []).append(outcome.ttft_s)

    def fail(self, name: str, message: str) -> None:
        self.failed[name] = self.failed.get(name, 0) + 1
        self.interval_errors[name] = self.interval_errors.get(name, 0) + 1
        if len(self.errors) < 50:
            self.errors.append(f"{name}: {message}"[:400])
        self.all_errors.append(f"{name}: {message}"[:400])
        if REFUSED in message:
            self.refused[name] = self.refused.get(name, 0) + 1

    def take(self) -> tuple[dict[str, list[float]], dict[str, int], dict[str, int]]:
        out = (self.current, self.interval_errors, self.interval_cancelled)
        self.current, self.interval_errors, self.interval_cancelled = {}, {}, {}
        return out


def max_batch_size(repository: Path, model: str) -> int:
    """``max_batch_size`` of a model's config.pbtxt (the one source of truth); 1 without batching."""
    import re

    m = re.search(r"^max_batch_size:\s*(\d+)", (Path(repository) / model / "config.pbtxt").read_text(), re.MULTILINE)
    return max(1, int(m.group(1))) if m else 1


async def one(mix: Mix, rec: Recorder, name: str) -> None:
    try:
        rec.add(name, await asyncio.wait_for(mix.send(name), mix.args.request_timeout))
    except Exception as exc:  # noqa: BLE001 - every failure is recorded; the run goes on
        rec.fail(name, f"{type(exc).__name__}: {exc}")


async def closed_loop(
    mix: Mix, rec: Recorder, names: Sequence[str], weights: Sequence[float], concurrency: int, seconds: float
) -> float:
    """The mix's throughput with ``concurrency`` clients: answers per second, cancelled streams
    included, failures (refusals are quick) not."""
    stop_at = time.perf_counter() + seconds
    rng = random.Random(1)

    async def client():
        while time.perf_counter() < stop_at:
            await one(mix, rec, rng.choices(names, weights)[0])

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return (sum(rec.ok.values()) + sum(rec.cancelled.values())) / (time.perf_counter() - t0)


@dataclass
class Soak:
    procs: list[processes.Proc]
    samples: list[dict] = field(default_factory=list)
    latency: list[dict] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


def sample_processes(soak: Soak, t: float, last_cpu: dict[str, float], last_t: float | None) -> None:
    snap = processes.snapshot(soak.procs)
    for p in soak.procs:
        s = snap.get(p.name)
        if s is None:
            if p.name not in soak.lost:
                soak.lost.append(p.name)
            continue
        cores = None
        if last_t is not None and p.name in last_cpu and t > last_t:
            cores = round((s.cpu_s - last_cpu[p.name]) / (t - last_t), 4)
        last_cpu[p.name] = s.cpu_s
        soak.samples.append(
            {
                "time_s": round(t, 1),
                "process": p.name,
                "group": p.group,
                "pid": p.pid,
                "rss_mib": round(s.rss_bytes / MIB, 2),
                "anon_mib": round(s.anon_bytes / MIB, 2),
                "cpu_cores": cores,
            }
        )


def record_latency(soak: Soak, rec: Recorder, t: float) -> None:
    lat, errs, canc = rec.take()
    for name in sorted(set(lat) | set(errs) | set(canc)):
        values = sorted(lat.get(name, ()))
        soak.latency.append(
            {
                "time_s": round(t, 1),
                "workload": name,
                "count": len(values),
                "errors": errs.get(name, 0),
                "cancelled": canc.get(name, 0),
                "p50_ms": round(1000 * percentile(values, 50), 2) if values else None,
                "p99_ms": round(1000 * percentile(values, 99), 2) if values else None,
                "max_ms": round(1000 * values[-1], 2) if values else None,
            }
        )


async def run_soak(args, triton, gateway, redis, key: str, say) -> tuple[Soak, Recorder, float, float]:
    """Peak (unless --rate), then the open-loop soak with its samples. Returns (soak, recorder, peak, rate)."""
    import aiohttp

    from clients.generation import AsyncGenerationClient

    names = [n for n, w in args.mix.items() if w > 0]
    weights = [args.mix[n] for n in names]
    rec = Recorder()
    nonce = secrets.token_hex(4)
    gen = AsyncGenerationClient(triton.grpc_url, protocol="grpc", timeout_s=args.request_timeout)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            mix = Mix(session, triton, gateway.url, key, gen, args, nonce)
            for name in names:  # every workload answers once before anything is measured
                await one(mix, rec, name)
            if rec.errors:
                raise RuntimeError(f"a workload fails before the soak: {rec.errors[0]}")
            # Bursts of twice the models' largest batch: ONNX Runtime's arena grows to the largest batch
            # it has run, once; without these, the first large batch the soak happens to form (a
            # neighbour's spike queues requests up) shows as a step in the stub's RSS after the warm-up.
            warm = Recorder()
            for name, model in (("image", "image_classifier"), ("embed", "text_encoder")):
                n = 2 * max_batch_size(triton.options.model_repository, model)
                await asyncio.gather(*(one(mix, warm, name) for _ in range(n)))
            say(f"bursts of 2 x the largest batch sent (image_classifier, text_encoder), {len(warm.all_errors)} failed")
            for e in warm.all_errors:
                if REFUSED not in e:
                    rec.fail("burst", e)
            peak = 0.0
            if args.rate:
                rate = args.rate
            else:
                # At the peak the admission control may refuse requests (HTTP 503, UNAVAILABLE): that is its
                # job there, so the peak's refusals are reported, not counted; any other failure is an error.
                peak_rec = Recorder()
                peak = await closed_loop(mix, peak_rec, names, weights, args.peak_concurrency, args.peak_seconds)
                rate = args.load * peak
                rec.peak_refused = sum(1 for e in peak_rec.all_errors if REFUSED in e)
                for e in peak_rec.all_errors:
                    if REFUSED not in e:
                        rec.fail("peak", e)
                say(
                    f"peak of the mix at {args.peak_concurrency} closed-loop clients: {peak:.1f} requests/s "
                    f"({rec.peak_refused} refused with 503); soak at {rate:.1f}/s"
                )
            soak = Soak(processes.deployment(triton, {"gateway": gateway}, redis))
            say(f"{len(soak.procs)} processes sampled: {', '.join(p.name for p in soak.procs)}")
            await _open_loop(args, mix, rec, soak, names, weights, rate, say)
        finally:
            await gen.close()
    return soak, rec, peak, rate


async def _open_loop(args, mix: Mix, rec: Recorder, soak: Soak, names, weights, rate: float, say) -> None:
    rng = random.Random(2)
    tasks: set[asyncio.Task] = set()
    start = time.perf_counter()
    end = start + args.duration
    last_cpu: dict[str, float] = {}
    sample_processes(soak, 0.0, last_cpu, None)
    next_sample = args.interval
    last_t = 0.0
    next_arrival = start
    while True:
        now = time.perf_counter()
        if now - start >= next_sample - 1e-6:
            t = now - start
            sample_processes(soak, t, last_cpu, last_t)
            record_latency(soak, rec, t)
            last_t = t
            rows = [r for r in soak.latency if r["time_s"] == round(t, 1) and r["p99_ms"] is not None]
            say(
                f"t={t:5.0f} s: in flight {len(tasks)}, errors {sum(rec.failed.values())}, P99 ms "
                + ", ".join(f"{r['workload']} {r['p99_ms']:.0f}" for r in rows)
            )
            next_sample += args.interval
        if now >= end:
            break
        if now >= next_arrival:
            if len(tasks) >= args.max_in_flight:
                rec.shed += 1
                rec.fail("shed", f"more than {args.max_in_flight} requests in flight")
            else:
                task = asyncio.create_task(one(mix, rec, rng.choices(names, weights)[0]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            next_arrival += rng.expovariate(rate)
            continue
        await asyncio.sleep(max(0.0, min(next_arrival, start + next_sample, end) - time.perf_counter()))
    if tasks:  # the last arrivals are answered; they count, but fall in no interval
        await asyncio.wait(tasks, timeout=args.request_timeout + 5)


# --------------------------------------------------------------------------- main


def _mix(s: str) -> dict[str, float]:
    out = dict.fromkeys(DEFAULT_MIX, 0.0)
    for part in s.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in DEFAULT_MIX:
            raise argparse.ArgumentTypeError(f"unknown workload {name!r}; choose from {','.join(DEFAULT_MIX)}")
        out[name.strip()] = float(value)
    if sum(out.values()) <= 0 or min(out.values()) < 0:
        raise argparse.ArgumentTypeError("weights must be >= 0 and not all 0")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.drills.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=600.0, help="seconds of soak (default 600)")
    p.add_argument("--interval", type=float, help="seconds between samples (default 60; 10 for runs under 300 s)")
    p.add_argument("--warmup", type=float, help="seconds before the checks start (default 60; a third of runs under 300 s)")
    p.add_argument("--rate", type=float, help="arrivals per second; default: --load x the measured peak")
    p.add_argument("--load", type=float, default=0.7, help="share of the peak to run at (default 0.7)")
    p.add_argument("--peak-seconds", type=float, default=20.0, help="length of the peak measurement (default 20)")
    p.add_argument("--peak-concurrency", type=int, default=16, help="closed-loop clients measuring the peak (default 16)")
    p.add_argument(
        "--mix",
        type=_mix,
        default=dict(DEFAULT_MIX),
        help="share of arrivals per workload, e.g. embed=30,cached=35,image=10,gateway_embed=18,"
        "generation=4,gateway_chat=3 (the default; workloads not named get 0)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per generation stream (default 16)")
    p.add_argument("--cancel-every", type=int, default=5, help="cancel every n-th stream mid-way (default 5; 0: never)")
    p.add_argument("--zipf-texts", type=int, default=500, help="texts in the cached workload's set (default 500)")
    p.add_argument("--images", type=int, default=6, help="sample photos in the image workload (default 6)")
    p.add_argument("--max-in-flight", type=int, default=256, help="arrivals beyond this many in flight are shed (errors)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds a request may take (default 60)")
    p.add_argument("--rss-growth-pct", type=float, default=5.0, help="RSS growth limit, %% of the post-warm-up RSS")
    p.add_argument("--rss-growth-mib", type=float, default=20.0, help="RSS growth limit floor in MiB (default 20)")
    p.add_argument("--p99-growth", type=float, default=1.0, help="P99 rise limit, x the median interval P99")
    p.add_argument("--no-redis", action="store_true", help="no Redis L2 for text_embedding_cached")
    p.add_argument("--out", type=Path, help="results folder (default perf/results/soak-<UTC time>)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    short = args.duration < 300
    args.interval = args.interval or (10.0 if short else 60.0)
    args.warmup = args.warmup if args.warmup is not None else (args.duration / 3 if short else 60.0)
    if (
        args.duration <= 0
        or args.interval <= 0
        or args.interval > args.duration
        or args.max_tokens < 4
        or not 0 < args.load <= 1
        or args.peak_seconds <= 0
        or args.peak_concurrency < 1
    ):
        p.error("--duration, --interval (<= duration), --peak-* must be positive, --load in (0, 1], --max-tokens >= 4")
    return args


def run(args: argparse.Namespace) -> int:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or DEFAULT_RESULTS / f"soak-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    say = progress()

    load = load_average()
    say(
        f"perf.drills.soak: {args.duration:g} s, sampling every {args.interval:g} s, warm-up {args.warmup:g} s; "
        f"load average {load}"
    )
    key = "sk-soak-" + secrets.token_hex(16)
    workdir = Path(tempfile.mkdtemp(prefix="perf-soak-"))
    deployment = None
    failure = ""
    soak, rec, peak, rate = Soak([]), Recorder(), 0.0, 0.0
    try:
        deployment = start_deployment(MODELS, workdir, key, not args.no_redis, say)
        soak, rec, peak, rate = asyncio.run(run_soak(args, deployment, deployment.gateway, deployment.redis, key, say))
    except Exception as exc:  # noqa: BLE001 - reported with what was measured
        failure = f"{type(exc).__name__}: {exc}"
        say(f"perf.drills.soak stopped: {failure}")
    finally:
        if deployment is not None:
            deployment.stop(logs_to=out)
        shutil.rmtree(workdir, ignore_errors=True)

    rss = rss_checks(soak.samples, args.warmup, args.rss_growth_pct, args.rss_growth_mib)
    p99 = p99_checks(soak.latency, args.warmup, args.p99_growth)
    failures = []
    if failure:
        failures.append(f"stopped early: {failure}")
    n_errors = sum(rec.failed.values())
    if n_errors:
        failures.append(f"{n_errors} errors ({sum(rec.refused.values())} refused with 503, {rec.shed} shed)")
    if soak.lost:
        failures.append(f"processes exited: {', '.join(soak.lost)}")
    failures += [
        f"RSS of {r['process']} grew {r.get('fitted_growth_mib')} MiB (limit {r.get('limit_mib')})"
        if "note" not in r
        else f"RSS of {r['process']}: {r['note']}"
        for r in rss
        if not r["ok"]
    ]
    failures += [f"P99 of {r['workload']} rose {r['fitted_rise_ms']} ms (limit {r['limit_ms']})" for r in p99 if not r["ok"]]
    if not soak.samples:
        failures.append("no samples")
    mix = ", ".join(f"{n} {w:g}" for n, w in args.mix.items() if w)
    header = [
        "# Soak",
        "",
        f"- {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before {load}",
        f"- command: `{' '.join(['python -m perf.drills.soak', *args.argv])}`",
        (
            f"- {args.duration:g} s open loop (Poisson) at {rate:.1f} requests/s"
            + (
                f" = {args.load:g} x the peak {peak:.1f}/s ({args.peak_concurrency} closed-loop clients, {args.peak_seconds:g} s)"
                if peak
                else " (--rate)"
            )
        ),
        f"- mix (share of arrivals): {mix}; streams {args.max_tokens} tokens, every {args.cancel_every}th cancelled",
        (
            f"- sampled every {args.interval:g} s; checks after a {args.warmup:g} s warm-up: RSS fitted growth <= "
            f"max({args.rss_growth_pct:g} %, {args.rss_growth_mib:g} MiB), P99 fitted rise (Theil-Sen) <= "
            f"max({args.p99_growth:g} x median, {MIN_P99_RISE_MS:g} ms), zero errors"
        ),
        f"- Redis L2 {'on' if deployment is not None and deployment.redis else 'off'}; requests refused (503) while measuring the peak: {rec.peak_refused}",
    ]
    text = summary(header, soak, rec, rss, p99, failures)
    (out / "summary.md").write_text(text)
    write_csv(out / "samples.csv", soak.samples or [{"time_s": None}])
    write_csv(out / "latency.csv", soak.latency or [{"time_s": None}])
    if soak.samples:
        plot(out / "soak.png", soak, args.warmup)
    print("\n" + text, flush=True)
    say(f"perf.drills.soak: {'FAILED' if failures else 'passed'}; results in {out}")
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
