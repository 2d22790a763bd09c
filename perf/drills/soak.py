"""`python -m perf.drills.soak` (`make soak`): the whole deployment at about 70 % of its peak for
10 minutes; the workloads, checks and thresholds: docs/soak.md.

Starts its own deployment (perf.lib.deployment; Redis as L2 unless --no-redis, the gateway),
measures the --mix's peak (or takes --rate) and sends it as Poisson arrivals at --load of that peak
for --duration seconds, every --cancel-every-th stream cancelled. Every --interval it samples every
process's RSS and CPU and each workload's P50/P99/max; after --warmup it checks for errors, RSS
growth and a rising P99. Writes samples.csv, latency.csv, summary.md, soak.png and the servers' logs
under perf/results/soak-<UTC time>/ (--out DIR); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from perf.drills.report import MIN_P99_RISE_MS, Result, interval_latency, p99_checks, rss_checks, soak_plot, soak_tables, timed
from perf.lib import processes
from perf.lib.chat_streams import Cancelled, DirectChat, GatewayChat
from perf.lib.deployment import start_deployment
from perf.lib.load import call_loop, poisson_loop
from perf.lib.options import add_peak, finish, parser
from perf.lib.report import header, load_average, progress, results_dir, write
from perf.lib.served import served_config
from perf.lib.workload import MixInputs, gateway_request, text_request

MODELS = ("text_embedding", "text_embedding_cached", "image_classification", "text_generation")
# Share of arrivals per workload (percent). Generation streams cost tens of times an embedding
# (docs/performance.md, CPU accounting), so they are a small share of the requests.
DEFAULT_MIX = {"embed": 30, "cached": 35, "image": 10, "gateway_embed": 18, "generation": 4, "gateway_chat": 3}
REFUSED = "HTTP 503"
MIB = 1 << 20


class Mix:
    """Sends one request of a named workload and checks its answer; raises on any failure."""

    def __init__(self, session, http_url: str, gateway_url: str, key: str, gen_client, args):
        self.session, self.args, self.key = session, args, key
        self.base, self.gateway_url = f"http://{http_url}/v2/models", gateway_url
        self.inputs = MixInputs(secrets.token_hex(4), args.zipf_texts, args.images)
        self.chats: dict[str, DirectChat | GatewayChat] = {
            "generation": DirectChat(gen_client),
            "gateway_chat": GatewayChat(session, gateway_url, key),
        }
        self.streams = 0

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> bytes:
        async with self.session.post(url, data=body, headers=headers) as r:
            raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {raw[:200]!r}")
            return raw

    async def send(self, name: str) -> tuple[float | None, bool] | None:
        """One request of workload ``name``; a stream's (TTFT, cancelled)."""
        if name in self.chats:
            self.streams += 1
            cancel = self.args.cancel_every > 0 and self.streams % self.args.cancel_every == 0
            try:
                ttft, tokens = await self.chats[name].stream(self.inputs.prompt(), self.args.max_tokens, 3 if cancel else 0)
            except Cancelled as stopped:
                return stopped.ttft, True
            if tokens != self.args.max_tokens:
                raise RuntimeError(f"{name}: {tokens} tokens, not {self.args.max_tokens}")
            return ttft, False
        if name == "embed":
            await self._post(f"{self.base}/text_embedding/infer", *text_request(self.inputs.unique_text()))
        elif name == "cached":
            await self._post(f"{self.base}/text_embedding_cached/infer", *text_request(self.inputs.zipf_text()))
        elif name == "image":
            await self._post(f"{self.base}/image_classification/infer", *self.inputs.image())
        elif name == "gateway_embed":
            raw = await self._post(f"{self.gateway_url}/v1/embeddings", *gateway_request(self.inputs.unique_text(), self.key))
            if len(json.loads(raw)["data"][0]["embedding"]) != 384:
                raise RuntimeError("not a 384-value embedding")
        else:
            raise ValueError(name)
        return None


@dataclass
class Soak:
    """What the soak measured: every request (``results``, in the order their answers came), each
    process's RSS and CPU and each workload's latency per interval, the arrivals shed."""

    procs: list[processes.Proc]
    results: list[Result] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    latency: list[dict] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    last_t: float | None = None
    sampled: int = 0  # results before this one are in an interval already
    shed: int = 0
    peak_refused: int = 0  # requests refused (503) while the peak was measured: the admission control's job

    def sample(self, t: float, latency: bool = True) -> None:
        """Every process (CPU cores since the last sample) and, with ``latency``, the interval's latencies."""
        snap = processes.snapshot(self.procs)
        for p in self.procs:
            if (s := snap.get(p.name)) is None:
                if p.name not in self.lost:
                    self.lost.append(p.name)
                continue
            last, self.cpu_s[p.name] = self.cpu_s.get(p.name), s.cpu_s
            cores = None if last is None or self.last_t is None else round((s.cpu_s - last) / (t - self.last_t), 4)
            rss, anon = round(s.rss_bytes / MIB, 2), round(s.anon_bytes / MIB, 2)
            self.samples.append(
                {"time_s": round(t, 1), "process": p.name, "group": p.group, "pid": p.pid}
                | {"rss_mib": rss, "anon_mib": anon, "cpu_cores": cores}
            )
        self.last_t = t
        if latency:
            self.latency += interval_latency(t, self.results[self.sampled :])
            self.sampled = len(self.results)


async def run_soak(args, deployment, key: str, soak: Soak, say) -> tuple[float, float]:
    """Peak (unless --rate), then the open-loop soak with its samples into ``soak``: (peak, rate)."""
    import random

    import aiohttp

    from clients.generation import AsyncGenerationClient

    triton, rng, start = deployment, random.Random(2), time.monotonic()  # the front door's URLs

    def draw() -> str:
        return rng.choices(list(args.mix), list(args.mix.values()))[0]

    gen = AsyncGenerationClient(triton.grpc_url, protocol="grpc", timeout_s=args.request_timeout)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            mix = Mix(session, triton.http_url, deployment.gateway.url, key, gen, args)

            async def send(name: str, results: list[Result]) -> None:
                await timed(mix.send, name, results, start, args.request_timeout)

            for name in (n for n, w in args.mix.items() if w > 0):  # every workload answers once before anything is measured
                await send(name, soak.results)
            if failed := [r for r in soak.results if r.error]:
                raise RuntimeError(f"a workload fails before the soak: {failed[0].workload}: {failed[0].error}")
            # ONNX Runtime's arena grows to the largest batch it has run, once; without these bursts, the
            # first large batch the soak happens to form shows as a step in the stub's RSS after the warm-up.
            warm: list[Result] = []
            for name, model in (("image", "image_classifier"), ("embed", "text_encoder")):
                await asyncio.gather(
                    *(
                        send(name, warm)
                        for _ in range(2 * max(1, served_config(triton.options.model_repository, model).max_batch_size))
                    )
                )
            say(
                f"bursts of 2 x the largest batch sent (image_classifier, text_encoder), {sum(bool(r.error) for r in warm)} failed"
            )
            peak, rate, at_peak = 0.0, args.rate, list[Result]()
            if not rate:
                # At the peak the admission control may refuse requests (HTTP 503): that is its job there.
                tally = await call_loop(lambda _n: send(draw(), at_peak), args.peak_concurrency, args.peak_seconds)
                peak, soak.peak_refused = (
                    sum(not r.error for r in at_peak) / tally.seconds,
                    sum(REFUSED in r.error for r in at_peak),
                )
                rate = args.load * peak
                say(
                    f"peak of the mix at {args.peak_concurrency} closed-loop clients: {peak:.1f} requests/s ({soak.peak_refused} refused with 503); soak at {rate:.1f}/s"
                )
            # any other failure of the bursts and the peak is an error of the soak
            soak.results += [
                Result(f"{label} {r.workload}", r.end_s, r.latency_s, r.error)
                for label, rs in (("burst", warm), ("peak", at_peak))
                for r in rs
                if r.error and REFUSED not in r.error
            ]
            soak.procs = processes.deployment(triton, {"gateway": deployment.gateway}, deployment.redis)
            say(f"{len(soak.procs)} processes sampled: {', '.join(p.name for p in soak.procs)}")
            start = time.monotonic()
            soak.sample(0.0, latency=False)

            async def sampler() -> None:
                for k in range(1, int(args.duration / args.interval + 1e-6) + 1):
                    await asyncio.sleep(max(0.0, start + k * args.interval - time.monotonic()))
                    soak.sample(time.monotonic() - start)
                    rows = [r for r in soak.latency if r["time_s"] == soak.last_t and r["p99_ms"]]
                    say(
                        f"t={soak.last_t:5.0f} s: errors {sum(r['errors'] for r in soak.latency)}, P99 ms "
                        + ", ".join(f"{r['workload']} {r['p99_ms']:.0f}" for r in rows)
                    )

            loop = poisson_loop(lambda _n: send(draw(), soak.results), rate, args.duration, 2, args.max_in_flight, start)
            tally, _ = await asyncio.gather(loop, sampler())
            soak.shed = tally.errors  # send() records its own failures: the loop's errors are the arrivals it shed
        finally:
            await gen.close()
    return peak, rate


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
    p = parser("perf.drills.soak", __doc__)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of soak (default 600)")
    p.add_argument("--interval", type=float, help="seconds between samples (default 60; 10 for runs under 300 s)")
    p.add_argument("--warmup", type=float, help="seconds before the checks start (default 60; a third of runs under 300 s)")
    add_peak(p)
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
    args = finish(p, p.parse_args(argv), argv)  # --duration > 0, args.argv
    short = args.duration < 300
    args.interval = args.interval or (10.0 if short else 60.0)
    args.warmup = args.warmup if args.warmup is not None else (args.duration / 3 if short else 60.0)
    peak_ok = args.peak_seconds > 0 and args.peak_concurrency >= 1
    if not (0 < args.interval <= args.duration and 0 < args.load <= 1 and args.max_tokens >= 4 and peak_ok):
        p.error("--duration, --interval (<= duration), --peak-* must be positive, --load in (0, 1], --max-tokens >= 4")
    return args


def run(args: argparse.Namespace) -> int:
    out, say, load = results_dir(args.out, "soak"), progress(), load_average()
    say(
        f"perf.drills.soak: {args.duration:g} s, sampling every {args.interval:g} s, warm-up {args.warmup:g} s; load average {load}"
    )
    key, deployment, failures = "sk-soak-" + secrets.token_hex(16), None, []
    soak, peak, rate = Soak([]), 0.0, 0.0
    with tempfile.TemporaryDirectory(prefix="perf-soak-") as workdir:
        try:
            deployment = start_deployment(MODELS, Path(workdir), key, not args.no_redis, say)
            peak, rate = asyncio.run(run_soak(args, deployment, key, soak, say))
        except Exception as exc:  # noqa: BLE001 - reported with what was measured
            failures.append(f"stopped early: {type(exc).__name__}: {exc}")
            say(f"perf.drills.soak {failures[0]}")
        finally:
            if deployment is not None:
                deployment.stop(logs_to=out)

    rss = rss_checks(soak.samples, args.warmup, args.rss_growth_pct, args.rss_growth_mib)
    p99 = p99_checks(soak.latency, args.warmup, args.p99_growth)
    errors = [r.error for r in soak.results if r.error]
    if errors or soak.shed:
        refused = sum(REFUSED in e for e in errors)
        failures.append(f"{len(errors) + soak.shed} errors ({refused} refused with 503, {soak.shed} shed)")
    if soak.lost:
        failures.append(f"processes exited: {', '.join(soak.lost)}")
    failures += [
        f"RSS of {r['process']}: {r['note']}"
        if "note" in r
        else f"RSS of {r['process']} grew {r['fitted_growth_mib']} MiB (limit {r['limit_mib']})"
        for r in rss
        if not r["ok"]
    ]
    failures += [f"P99 of {r['workload']} rose {r['fitted_rise_ms']} ms (limit {r['limit_ms']})" for r in p99 if not r["ok"]]
    failures += [] if soak.samples else ["no samples"]
    at = f" = {args.load:g} x the peak {peak:.1f}/s ({args.peak_concurrency} closed-loop clients, {args.peak_seconds:g} s)"
    lines = header("Soak", "perf.drills.soak", args.argv, load) + [
        f"- {args.duration:g} s open loop (Poisson) at {rate:.1f} requests/s" + (at if peak else " (--rate)"),
        f"- mix (share of arrivals): {', '.join(f'{n} {w:g}' for n, w in args.mix.items() if w)}; streams {args.max_tokens} tokens, every {args.cancel_every}th cancelled",
        f"- sampled every {args.interval:g} s; checks after a {args.warmup:g} s warm-up: RSS fitted growth <= max({args.rss_growth_pct:g} %, "
        f"{args.rss_growth_mib:g} MiB), P99 fitted rise (Theil-Sen) <= max({args.p99_growth:g} x median, {MIN_P99_RISE_MS:g} ms), zero errors",
        f"- Redis L2 {'on' if deployment is not None and deployment.redis else 'off'}; requests refused (503) while measuring the peak: {soak.peak_refused}",
        "",
        f"**Result: {'FAILED: ' + '; '.join(failures) if failures else 'passed'}**",
        "",
    ]
    text = "\n".join(lines + soak_tables(soak.results, soak.samples, soak.latency, rss, p99)) + "\n"
    if soak.samples:
        soak_plot(out / "soak.png", soak.samples, soak.latency, args.warmup)
    write(out, text, csvs={"samples.csv": soak.samples, "latency.csv": soak.latency}, say=say)
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
