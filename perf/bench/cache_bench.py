"""``python -m perf.bench.cache_bench`` (``make cache-bench``): the result cache on a repeated-text workload.

One Zipf stream over 10,000 sentences (perf/bench/cache_workload.py), asyncio gRPC, one text a
request, side by side: **without cache** (``text_embedding``, response cache off); **with cache**
(``text_embedding_cached``, response cache on, a fresh redis-server as L2, cold); **new replica**
(the model reloaded: empty L1, warm L2); **hits only** (the most frequent sentences at concurrency
1, client and server latency). Writes summary.md and results.json under perf/results/cache-<UTC
time>/: throughput and ratio, P50/P99, hit rate per level (L1, L2, Triton's cache), the hit P50.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from perf.bench.cache_workload import DISTINCT, repeat_fraction, sentences, zipf_ranks
from perf.lib import load, options, report, triton_stats
from perf.lib.stats import percentile_of

CACHED, ENSEMBLE = "text_embedding_cached", "text_embedding"


say = report.progress()


@dataclass
class Phase(load.Window):
    """One phase (``phase``: its name, ``workload``: the model it sends to) and what the cache did in it."""

    repeat_p50_ms: float | None = None  # requests whose text came earlier in the stream
    first_p50_ms: float | None = None  # first occurrences
    levels: dict[str, float | None] = field(default_factory=dict)  # hit rates (None: no lookups) and counts
    server_compute_us: float | None = None  # per request, Triton statistics (hits-only phase)
    server_queue_us: float | None = None
    lookup_us: float | None = None  # L1 + L2 lookup of one batch, from embedding_cache_lookup_seconds


def drive(url: str, model: str, texts: Sequence[str], concurrency: int) -> load.Tally:
    """Send texts (one per request, each once) over gRPC with ``concurrency`` requests in flight."""
    tally = load.kserve_texts("grpc", url, model, texts.__getitem__, concurrency, count=len(texts), output="EMBEDDING")
    return asyncio.run(tally)


def cache_counts(metrics_url: str) -> dict[str, float]:
    m = triton_stats.metrics(metrics_url)

    def get(name: str, **labels: str) -> float:
        key = ",".join(sorted(f'{k}="{v}"' for k, v in labels.items()))
        return m.get(f"{name}{{{key}}}", 0.0)

    counts = {
        f"{lvl}_{res}": get("embedding_cache_lookups_total", level=lvl, model=CACHED, result=res)
        for lvl in ("l1", "l2")
        for res in ("hit", "miss")
    }
    counts["triton_tokenizer_hit"] = get("nv_cache_num_hits_per_model", model="text_tokenizer", version="1")
    counts["triton_tokenizer_miss"] = get("nv_cache_num_misses_per_model", model="text_tokenizer", version="1")
    counts["model_texts"] = get("embedding_cache_model_texts_total", model=CACHED)
    counts["redis_errors"] = sum(
        get("embedding_cache_redis_errors_total", kind=k, model=CACHED) for k in ("connection", "timeout", "garbage", "other")
    )
    return counts


def level_rates(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    d = {k: after[k] - before[k] for k in after}
    rate = lambda hit, miss: round(hit / (hit + miss), 4) if hit + miss else None  # noqa: E731
    return {
        "l1_hit_rate": rate(d["l1_hit"], d["l1_miss"]),
        "l2_hit_rate": rate(d["l2_hit"], d["l2_miss"]),  # of the L1 misses
        "triton_tokenizer_hit_rate": rate(d["triton_tokenizer_hit"], d["triton_tokenizer_miss"]),
        "overall_hit_rate": rate(d["l1_hit"] + d["l2_hit"], d["l2_miss"] if d["l2_hit"] + d["l2_miss"] else d["l1_miss"]),
        **{k: d[k] for k in ("l1_hit", "l1_miss", "l2_hit", "l2_miss", "triton_tokenizer_hit", "model_texts", "redis_errors")},
    }


def lookup_seconds(metrics_url: str) -> tuple[float, float]:
    m = triton_stats.metrics(metrics_url)
    labels = f'{{model="{CACHED}"}}'
    return m.get(f"embedding_cache_lookup_seconds_sum{labels}", 0.0), m.get(f"embedding_cache_lookup_seconds_count{labels}", 0.0)


def phase(name: str, model: str, server, texts: Sequence[str], concurrency: int, ranks: np.ndarray | None = None) -> Phase:
    """One phase's load on ``server``, with the hit rates per cache level over it (from its metrics)."""
    say(f"cache_bench: {name}: {len(texts)} requests to {model} at concurrency {concurrency}")
    before = cache_counts(server.metrics_url) if model == CACHED else None
    tally = drive(server.grpc_url, model, texts, concurrency)
    p = Phase(name, model, concurrency, client="grpc asyncio")
    p.take(tally)
    if before is not None:
        p.levels = level_rates(before, cache_counts(server.metrics_url))
    if ranks is not None:  # a request repeats when its sentence came earlier in the stream
        first = {int(r): i for i, r in reversed(list(enumerate(ranks)))}
        repeat = [ms for i, ms in zip(tally.ok_index, tally.ok) if first[int(ranks[i])] != i]
        once = [ms for i, ms in zip(tally.ok_index, tally.ok) if first[int(ranks[i])] == i]
        p.repeat_p50_ms, p.first_p50_ms = 1000 * percentile_of(repeat, 50), 1000 * percentile_of(once, 50)
    return p


@contextlib.contextmanager
def serving(models: tuple[str, ...], cache_mb: int, env: dict[str, str], precision: str) -> Iterator[tuple[Any, str]]:
    """tritonserver with ``models`` (text_encoder's variant for PRECISION, a response cache of ``cache_mb``),
    ready, and that variant; stopped after, its scratch folder removed."""
    from export import variants
    from perf.lib.deployment import server_deployment
    from server.layout import ROOT

    local = tuple(v for v in variants.VARIANTS if v != "trt_plan")
    config_name, served = variants.resolve_precision(ROOT / "model_repository", ["text_encoder"], precision, loadable=local)
    with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp:
        server = server_deployment(models, Path(tmp), cache_size_bytes=cache_mb << 20, model_config_name=config_name, env=env)
        say(
            f"cache_bench: starting tritonserver ({', '.join(models)}; text_encoder={served['text_encoder']}; "
            f"response cache {cache_mb} MiB; log {server.triton.log_path})"
        )
        with server:
            yield server, served["text_encoder"]


def markdown(phases: list[Phase], ratio: float, variant: str, args: argparse.Namespace, repeat: float) -> str:
    lines = [
        f"Workload: {args.requests} requests, Zipf s={args.zipf_s} over {DISTINCT} distinct sentences "
        f"({repeat:.1%} of requests repeat an earlier one), one text per request, gRPC asyncio client, "
        f"concurrency {args.concurrency}; text_encoder variant {variant}.",
        "",
    ]

    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"

    def f(v: float | None) -> str:
        return report.fmt(v, 2, missing="-")

    header = ["phase", "model", "req/s", "P50 ms", "P99 ms", "repeat P50 ms", "first-seen P50 ms", "L1 hit"]
    header += ["L2 hit (of L1 misses)", "Triton tokenizer hit", "errors"]
    rows = [
        (p.phase, p.workload, report.fmt(p.rps), f(p.p50_ms), f(p.p99_ms), f(p.repeat_p50_ms), f(p.first_p50_ms))
        + (rate(p.levels.get("l1_hit_rate")), rate(p.levels.get("l2_hit_rate")), rate(p.levels.get("triton_tokenizer_hit_rate")))
        + (p.errors,)
        for p in phases
    ]
    lines.append(report.table(header, rows, left=2))
    hits = phases[-1]
    lines += [
        "",
        f"**Throughput ratio with/without cache: {ratio:.2f}x** (P50 {f(phases[1].p50_ms)} vs {f(phases[0].p50_ms)} ms, "
        f"P99 {f(phases[1].p99_ms)} vs {f(phases[0].p99_ms)} ms).",
        f"**Cache-hit latency** (hits only, concurrency 1): client P50 {f(hits.p50_ms)} ms, P99 {f(hits.p99_ms)} ms; "
        f"on the server (Triton statistics of {CACHED}) {hits.server_compute_us} µs compute and "
        f"{hits.server_queue_us} µs queue per request, of which the L1 lookup {hits.lookup_us} µs.",
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from server.redis_process import RedisProcess

    if not args.no_export:
        from export import __main__ as export_main

        if export_main.main(["--no-speed"]) != 0:
            say("cache_bench: export failed")
            return 1
    texts = sentences()
    ranks = zipf_ranks(args.requests, s=args.zipf_s)
    stream = [texts[r] for r in ranks]
    warmup = [f"Warm-up sentence number {i} is not part of the workload." for i in range(50)]
    out_dir = report.results_dir(args.results_dir, "cache")
    phases: list[Phase] = []

    with serving((ENSEMBLE,), 0, {}, args.precision) as (server, variant):
        drive(server.grpc_url, ENSEMBLE, warmup, args.concurrency)
        phases.append(phase("without cache", ENSEMBLE, server, stream, args.concurrency))

    with RedisProcess(maxmemory_mb=512) as redis_server:
        l2 = {"EMBEDDING_CACHE_L2_REDIS_URL": redis_server.url}
        with serving((ENSEMBLE, CACHED), args.cache_size_mb, l2, args.precision) as (server, _):
            drive(server.grpc_url, CACHED, warmup, args.concurrency)
            phases.append(phase("with cache (cold start)", CACHED, server, stream, args.concurrency, ranks))

            import tritonclient.http as httpclient

            admin = httpclient.InferenceServerClient(server.http_url)
            admin.unload_model(CACHED)
            admin.load_model(CACHED)
            admin.close()
            drive(server.grpc_url, CACHED, warmup[:5], 1)
            phases.append(phase("new replica (empty L1, warm L2)", CACHED, server, stream, args.concurrency, ranks))

            top = [texts[r] for r in range(min(200, DISTINCT))] * max(1, args.hit_requests // 200)
            drive(server.grpc_url, CACHED, top[:200], 1)  # every one cached (computed if it never came up)
            stats0, l0 = triton_stats.snapshot(server.triton_http_url), lookup_seconds(server.metrics_url)
            p = phase("hits only", CACHED, server, top, 1)
            stats = triton_stats.per_request(stats0, triton_stats.snapshot(server.triton_http_url), (CACHED,))[CACHED]
            l1 = lookup_seconds(server.metrics_url)
            p.server_compute_us, p.server_queue_us = round(stats["compute_ms"] * 1000, 1), round(stats["queue_ms"] * 1000, 1)
            p.lookup_us = round((l1[0] - l0[0]) / max(l1[1] - l0[1], 1) * 1e6, 1)
            phases.append(p)

    ratio = phases[1].rps / phases[0].rps if phases[0].rps and phases[1].rps else math.nan
    summary = markdown(phases, ratio, variant, args, repeat_fraction(ranks))
    data = {
        "args": vars(args),
        "variant": variant,
        "throughput_ratio": round(ratio, 3),
        "repeat_fraction": repeat_fraction(ranks),
    }
    report.write(out_dir, summary, data | {"phases": [asdict(p) for p in phases]}, say=say)
    return 0 if all(p.errors == 0 for p in phases) else 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = options.parser("perf.bench.cache_bench", __doc__)
    p.add_argument("--requests", type=int, default=20000, help="requests per phase (default 20000)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    p.add_argument("--hit-requests", type=int, default=1000, help="requests of the hits-only phase (default 1000)")
    p.add_argument("--precision", default="auto", help="text_encoder variant, as make serve's PRECISION (default auto)")
    p.add_argument("--cache-size-mb", type=int, default=128, help="Triton response cache of the cached server (default 128)")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--no-export", action="store_true", help="do not run the export first")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
