"""`python -m perf.bench.cpu_cost` (`make cpu-cost`): CPU-seconds per 1,000 requests of every process on each
request path.

Starts its own deployment with the launcher's code: tritonserver behind the nginx front door
(server.deployment.Deployment, Triton's response cache at the launcher's default size), Redis
as text_embedding_cached's L2 when redis-server is installed (--no-redis: off), and the OpenAI
gateway (server.gateway.GatewayProcess, rate limit off, request log on as deployed). Then, one
path after the other, it sends a fixed number of requests at a fixed concurrency and reads
utime + stime of every process (/proc/<pid>/stat) before and after:

  text_tokenizer                 POST /v2/models/text_tokenizer/infer, unique texts (front door -> Triton)
  text_encoder                   token ids (16 tokens) straight to the encoder
  text_embedding                 the ensemble (tokenizer -> encoder; the router only during a rollout), unique texts
  text_embedding_cached_miss     the cached entry point, unique texts (every one a miss)
  text_embedding_cached_hit      the cached entry point, 60 texts sent once beforehand (every one a hit)
  gateway_embeddings             POST /v1/embeddings, unique texts (gateway -> Triton's gRPC port)
  image_classification           unique JPEGs (the bundled sample photos, one pixel changed per request)
  text_generation                gRPC streams through the front door, --max-tokens each (ignore_eos);
                                 its figures are per 1,000 generated tokens

Every request body is built before its window, so the load generator's figure is the cost of
sending and reading, not of making inputs. A request the admission control refuses (HTTP 503)
is sent again after a backoff and counted in the table's ``refused`` column. An idle window first gives each process's idle
CPU rate; the table shows the net cost (raw - idle rate x window length, never below 0); the
CSV has both. Processes are summed per group: every instance of a model's stub is one
column. Writes cpu_cost.csv and cpu_cost.md under perf/results/cpu-cost-<UTC time>/
(--out DIR) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
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

from perf.lib import processes
from perf.lib.deployment import start_deployment
from perf.lib.harness import write_csv
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.report import load_average, progress
from perf.lib.workload import gateway_request, image_request, prompts, sentences, text_request, token_request, unique_jpegs

MODELS = ("text_embedding", "text_embedding_cached", "image_classification", "text_generation")
PATHS = (
    "text_tokenizer",
    "text_encoder",
    "text_embedding",
    "text_embedding_cached_miss",
    "text_embedding_cached_hit",
    "gateway_embeddings",
    "image_classification",
    "text_generation",
)
# The columns, in path order; a group a deployment lacks (no Redis) is left out.
GROUP_ORDER = (
    "frontdoor (nginx)",
    "gateway",
    "tritonserver",
    "stub text_embedding_cached",
    "stub text_tokenizer",
    "stub text_encoder_router",
    "stub text_encoder",
    "stub image_preprocess",
    "stub image_classifier",
    "stub image_postprocess",
    "stub text_generation",
    "redis",
    "load generator",
)


# --------------------------------------------------------------------------- measurement


@dataclass
class PathResult:
    path: str
    unit: str  # "requests" or "tokens"
    units: int = 0  # requests answered (or tokens generated)
    requests: int = 0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    refused: int = 0  # HTTP 503 answers (admission control), each sent again after a pause
    raw_cpu_s: dict[str, float] = field(default_factory=dict)  # group -> CPU-seconds in the window
    net_cpu_s: dict[str, float] = field(default_factory=dict)  # minus the idle rate x wall_s

    def per_1000(self, group: str, net: bool = True) -> float | None:
        cpu = (self.net_cpu_s if net else self.raw_cpu_s).get(group)
        return None if cpu is None or not self.units else 1000 * cpu / self.units


def group_cpu(procs: Sequence[processes.Proc], snap: dict[str, processes.Sample]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs:
        if p.name in snap:
            out[p.group] = out.get(p.group, 0.0) + snap[p.name].cpu_s
    return out


RETRIES = 6  # a 503 (the admission control refusing) is sent again after 10, 20, 40 ... ms


async def http_window(
    url: str, bodies: Sequence[tuple[bytes, dict[str, str]]], concurrency: int, result: PathResult, check=None
) -> None:
    """Send every body once, ``concurrency`` at a time; a 503 is retried with backoff (counted in
    ``refused``: its cost is part of the path's), any other non-200 answer is an error."""
    import aiohttp

    todo = iter(bodies)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120), connector=aiohttp.TCPConnector(limit=0)
    ) as session:

        async def client():
            for body, headers in todo:
                try:
                    for attempt in range(RETRIES + 1):
                        async with session.post(url, data=body, headers=headers) as r:
                            raw = await r.read()
                        if r.status == 503 and attempt < RETRIES:
                            result.refused += 1
                            await asyncio.sleep(0.01 * 2**attempt)
                            continue
                        if r.status != 200:
                            raise RuntimeError(f"HTTP {r.status}: {raw[:200]!r}")
                        if check is not None:
                            check(raw)
                        break
                    result.units += 1
                except Exception as exc:  # noqa: BLE001 - counted; the window goes on
                    result.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                result.requests += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))


async def generation_window(
    grpc_url: str, prompt_list: Sequence[str], concurrency: int, max_tokens: int, result: PathResult
) -> None:
    from clients.generation import AsyncGenerationClient

    client = AsyncGenerationClient(grpc_url, protocol="grpc", timeout_s=300)
    todo = iter(prompt_list)
    try:

        async def one():
            for prompt in todo:
                try:
                    stream = client.chat_stream(
                        [{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, ignore_eos=True
                    )
                    async with stream:
                        async for _ in stream:
                            pass
                    if stream.result is None or not stream.result.num_output_tokens:
                        raise RuntimeError("the stream ended without a token count")
                    result.units += stream.result.num_output_tokens
                except Exception as exc:  # noqa: BLE001
                    result.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                result.requests += 1

        await asyncio.gather(*(one() for _ in range(concurrency)))
    finally:
        await client.close()


def embedding_check(raw: bytes) -> None:
    doc = json.loads(raw)
    if len(doc["data"][0]["embedding"]) != 384:
        raise RuntimeError("not a 384-value embedding")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.cpu_cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=1000, help="requests per text path (default 1000)")
    p.add_argument("--image-requests", type=int, default=300, help="requests of image_classification (default 300)")
    p.add_argument("--gen-requests", type=int, default=24, help="text_generation streams (default 24)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per generation stream, ignore_eos (default 32)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8; generation: 4)")
    p.add_argument("--gen-concurrency", type=int, default=4, help="generation streams in flight (default 4)")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="the idle window (default 5)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    p.add_argument("--no-redis", action="store_true", help="no Redis L2 for text_embedding_cached")
    p.add_argument("--out", type=Path, help="results folder (default perf/results/cpu-cost-<UTC time>)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown:
        p.error(f"unknown paths {unknown}; choose from {','.join(PATHS)}")
    if (
        min(args.requests, args.image_requests, args.gen_requests, args.max_tokens, args.concurrency, args.gen_concurrency) < 1
        or args.idle_seconds <= 0
    ):
        p.error("counts, concurrency and --idle-seconds must be positive")
    return args


async def measure(args, triton, gateway, redis, key: str, say) -> tuple[dict[str, float], list[PathResult], list[str]]:
    """The idle rates, then each path's window. Returns (idle CPU-s per s by group, results, groups)."""
    procs = processes.deployment(triton, {"gateway": gateway}, redis)
    present = list(dict.fromkeys(p.group for p in procs))
    # Known groups in path order; stubs of models added later go in before Redis and the load generator.
    groups = (
        [g for g in GROUP_ORDER[:-2] if g in present]
        + sorted(set(present) - set(GROUP_ORDER))
        + [g for g in GROUP_ORDER[-2:] if g in present]
    )
    nonce = secrets.token_hex(4)
    texts = sentences()
    counter = iter(range(10**12))

    def unique(n: int) -> list[str]:
        return [f"{texts[k % len(texts)]} ({nonce}-{k})" for k in (next(counter) for _ in range(n))]

    # Warm every path once (connections, first-execution costs, the hit set cached).
    hit_bodies = [text_request(s) for s in texts]
    warm = PathResult("warm", "requests")
    base = f"http://{triton.http_url}/v2/models"
    rng = random.Random(nonce)
    await http_window(f"{base}/text_tokenizer/infer", [text_request(t) for t in unique(8)], 4, warm)
    await http_window(f"{base}/text_encoder/infer", [token_request(rng) for _ in range(8)], 4, warm)
    await http_window(f"{base}/text_embedding/infer", [text_request(t) for t in unique(8)], 4, warm)
    await http_window(f"{base}/text_embedding_cached/infer", hit_bodies, 4, warm)
    await http_window(f"{base}/text_embedding_cached/infer", hit_bodies, 4, warm)  # hits in L1 now
    await http_window(f"{gateway.url}/v1/embeddings", [gateway_request(t, key) for t in unique(8)], 4, warm, embedding_check)
    if "image_classification" in args.paths:
        await http_window(
            f"{base}/image_classification/infer", [image_request(b) for b in unique_jpegs(4, nonce + "warm")], 2, warm
        )
    if "text_generation" in args.paths:
        await generation_window(triton.grpc_url, prompts()[:2], 2, 4, PathResult("warm", "tokens"))
    if warm.errors:
        raise RuntimeError(f"warm-up failed: {warm.errors[0]}")

    before = group_cpu(procs, processes.snapshot(procs))
    t0 = time.perf_counter()
    await asyncio.sleep(args.idle_seconds)
    idle_wall = time.perf_counter() - t0
    after = group_cpu(procs, processes.snapshot(procs))
    idle = {g: max(0.0, (after.get(g, 0.0) - before.get(g, 0.0)) / idle_wall) for g in groups}
    say("idle CPU (cores): " + ", ".join(f"{g} {v:.3f}" for g, v in idle.items()))

    results = []
    for path in args.paths:
        unit = "tokens" if path == "text_generation" else "requests"
        r = PathResult(path, unit)
        n = args.image_requests if path == "image_classification" else args.requests
        if path == "text_tokenizer":
            work = http_window(f"{base}/text_tokenizer/infer", [text_request(t) for t in unique(n)], args.concurrency, r)
        elif path == "text_encoder":
            work = http_window(f"{base}/text_encoder/infer", [token_request(rng) for _ in range(n)], args.concurrency, r)
        elif path == "text_embedding":
            work = http_window(f"{base}/text_embedding/infer", [text_request(t) for t in unique(n)], args.concurrency, r)
        elif path == "text_embedding_cached_miss":
            work = http_window(f"{base}/text_embedding_cached/infer", [text_request(t) for t in unique(n)], args.concurrency, r)
        elif path == "text_embedding_cached_hit":
            work = http_window(
                f"{base}/text_embedding_cached/infer", [hit_bodies[k % len(hit_bodies)] for k in range(n)], args.concurrency, r
            )
        elif path == "gateway_embeddings":
            work = http_window(
                f"{gateway.url}/v1/embeddings", [gateway_request(t, key) for t in unique(n)], args.concurrency, r, embedding_check
            )
        elif path == "image_classification":
            work = http_window(
                f"{base}/image_classification/infer", [image_request(b) for b in unique_jpegs(n, nonce)], args.concurrency, r
            )
        else:
            plist = prompts()
            work = generation_window(
                triton.grpc_url,
                [plist[k % len(plist)] for k in range(args.gen_requests)],
                args.gen_concurrency,
                args.max_tokens,
                r,
            )
        before = group_cpu(procs, processes.snapshot(procs))
        t0 = time.perf_counter()
        await work
        r.wall_s = time.perf_counter() - t0
        after = group_cpu(procs, processes.snapshot(procs))
        for g in groups:
            r.raw_cpu_s[g] = after.get(g, 0.0) - before.get(g, 0.0)
            r.net_cpu_s[g] = max(0.0, r.raw_cpu_s[g] - idle[g] * r.wall_s)
        gone = [p.name for p in procs if not processes.alive(p)]
        if gone:
            r.errors.append(f"processes exited: {', '.join(gone)}")
        total = sum(r.net_cpu_s.values())
        say(
            f"{path}: {r.units} {unit} in {r.wall_s:.1f} s, {len(r.errors)} errors, {r.refused} refused (503), "
            f"{1000 * total / max(1, r.units):.2f} CPU-s per 1000 {unit}"
        )
        results.append(r)
    return idle, results, groups


def short(group: str) -> str:
    return group.removeprefix("stub ")


def markdown(header: Sequence[str], idle: dict[str, float], results: Sequence[PathResult], groups: Sequence[str]) -> str:
    lines = list(header) + [
        "",
        (
            "CPU-seconds per 1,000 requests (text_generation: per 1,000 generated tokens), net "
            "of each process's idle rate; `-`: below 0.005."
        ),
        "",
    ]
    lines.append("| path | " + " | ".join(short(g) for g in groups) + " | total | wall s | refused | errors |")
    lines.append("| --- |" + " ---: |" * (len(groups) + 4))
    for r in results:
        cells = []
        for g in groups:
            v = r.per_1000(g)
            cells.append("-" if v is None or v < 0.005 else f"{v:.2f}")
        total = sum(r.per_1000(g) or 0.0 for g in groups)
        lines.append(
            f"| {r.path}{' (per 1k tokens)' if r.unit == 'tokens' else ''} | "
            + " | ".join(cells)
            + f" | {total:.2f} | {r.wall_s:.1f} | {r.refused} | {len(r.errors)} |"
        )
    lines.append(
        "| idle, CPU-s per 1,000 s | "
        + " | ".join(f"{1000 * idle.get(g, 0.0):.1f}" for g in groups)
        + f" | {1000 * sum(idle.values()):.1f} | | | |"
    )
    return "\n".join(lines) + "\n"


def csv_rows(idle: dict[str, float], results: Sequence[PathResult], groups: Sequence[str]) -> list[dict]:
    rows = []
    for r in results:
        for g in groups:
            rows.append(
                {
                    "path": r.path,
                    "process": g,
                    "unit": r.unit,
                    "units": r.units,
                    "requests": r.requests,
                    "wall_s": round(r.wall_s, 3),
                    "raw_cpu_s": round(r.raw_cpu_s.get(g, 0.0), 4),
                    "net_cpu_s": round(r.net_cpu_s.get(g, 0.0), 4),
                    "net_cpu_s_per_1000": round(r.per_1000(g) or 0.0, 4),
                    "idle_cores": round(idle.get(g, 0.0), 5),
                    "refused": r.refused,
                    "errors": len(r.errors),
                }
            )
    return rows


def run(args: argparse.Namespace) -> int:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or DEFAULT_RESULTS / f"cpu-cost-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    say = progress()

    load = load_average()
    say(f"perf.bench.cpu_cost: paths {','.join(args.paths)}; load average {load}")
    key = "sk-cpu-" + secrets.token_hex(16)
    workdir = Path(tempfile.mkdtemp(prefix="perf-cpu-cost-"))
    deployment = None
    failure = ""
    idle: dict[str, float] = {}
    results: list[PathResult] = []
    groups: list[str] = []
    try:
        models = [
            m
            for m in MODELS
            if not (m == "image_classification" and m not in args.paths) and not (m == "text_generation" and m not in args.paths)
        ]
        deployment = start_deployment(models, workdir, key, not args.no_redis, say)
        idle, results, groups = asyncio.run(measure(args, deployment, deployment.gateway, deployment.redis, key, say))
    except Exception as exc:  # noqa: BLE001 - reported with what was measured
        failure = f"{type(exc).__name__}: {exc}"
        say(f"perf.bench.cpu_cost stopped: {failure}")
    finally:
        if deployment is not None:
            deployment.stop(logs_to=out)
        shutil.rmtree(workdir, ignore_errors=True)

    header = [
        "# CPU cost per request path",
        "",
        f"- {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before {load}",
        f"- command: `{' '.join(['python -m perf.bench.cpu_cost', *args.argv])}`",
        (
            f"- {args.requests} requests per text path, {args.image_requests} images, {args.gen_requests} generation "
            f"streams of {args.max_tokens} tokens; concurrency {args.concurrency} (generation {args.gen_concurrency}); "
            f"Redis L2 {'on' if deployment is not None and deployment.redis else 'off'}; front door on every direct path, the gateway on gateway_embeddings"
        ),
    ]
    if failure:
        header.append(f"- stopped early: {failure}")
    errors = [f"{r.path}: {e}" for r in results for e in r.errors[:3]]
    if errors:
        header.append(f"- errors: {'; '.join(errors[:5])}")
    table = markdown(header, idle, results, groups)
    (out / "cpu_cost.md").write_text(table)
    write_csv(out / "cpu_cost.csv", csv_rows(idle, results, groups))
    print("\n" + table, flush=True)
    say(f"perf.bench.cpu_cost: results in {out}")
    complete = [r.path for r in results] == args.paths and all(r.units > 0 for r in results)
    return 0 if not failure and not errors and complete else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
