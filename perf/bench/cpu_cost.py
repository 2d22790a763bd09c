"""`python -m perf.bench.cpu_cost` (`make cpu-cost`): CPU-seconds per 1,000 requests of every process on each
request path.

The deployment (perf.lib.deployment.start_deployment: front door, Redis L2 unless --no-redis, the
gateway); one path of PATHS at a time, a fixed number of requests at a fixed concurrency, every
process's utime + stime read before and after (perf.lib.processes), net of its idle rate (an idle
window first). Unique texts (the hit path: 60 texts sent beforehand), photos with one pixel changed,
generation per 1,000 tokens; a 503 is retried after a backoff. Writes cpu_cost.csv (raw and net) and
cpu_cost.md under perf/results/cpu-cost-<UTC time>/ (--out DIR).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from perf.lib import options, processes, report
from perf.lib.deployment import start_deployment
from perf.lib.load import Request, call_loop
from perf.lib.report import header, load_average, progress, results_dir
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
GEN_CONCURRENCY = 4  # generation streams in flight
RETRIES = 6  # a 503 (the admission control refusing) is sent again after 10, 20, 40 ... ms


@dataclass
class PathResult:
    path: str
    unit: str  # "requests" or "tokens"
    units: int = 0  # requests answered (or tokens generated)
    requests: int = 0
    wall_s: float = 0.0
    errors: int = 0
    first_error: str = ""
    refused: int = 0  # HTTP 503 answers (admission control), each sent again after a pause
    raw_cpu_s: dict[str, float] = field(default_factory=dict)  # group -> CPU-seconds in the window
    net_cpu_s: dict[str, float] = field(default_factory=dict)  # minus the idle rate x wall_s

    def per_1000(self, group: str) -> float | None:
        cpu = self.net_cpu_s.get(group)
        return None if cpu is None or not self.units else 1000 * cpu / self.units


def group_cpu(procs: Sequence[processes.Proc]) -> dict[str, float]:
    out: dict[str, float] = {}
    snap = processes.snapshot(procs)
    for p in procs:
        if p.name in snap:
            out[p.group] = out.get(p.group, 0.0) + snap[p.name].cpu_s
    return out


def embedding_check(raw: bytes) -> None:
    if len(json.loads(raw)["data"][0]["embedding"]) != 384:
        raise RuntimeError("not a 384-value embedding")


async def http_window(url: str, bodies: Sequence[Request], concurrency: int, result: PathResult, check=None) -> None:
    """Send every body once, ``concurrency`` at a time; a 503 is sent again after a backoff (counted in
    ``refused``: its cost is part of the path's), any other answer but a 200 is an error."""
    import aiohttp

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120), connector=aiohttp.TCPConnector(limit=0)
    ) as session:

        async def call(n: int) -> None:
            body, headers = bodies[n]
            for attempt in range(RETRIES + 1):
                async with session.post(url, data=body, headers=headers) as r:
                    raw = await r.read()
                if r.status != 503 or attempt == RETRIES:
                    break
                result.refused += 1
                await asyncio.sleep(0.01 * 2**attempt)
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {raw[:200]!r}")
            if check is not None:
                check(raw)

        tally = await call_loop(call, concurrency, count=len(bodies))
    result.units += len(tally.ok)
    result.requests += len(bodies)
    result.errors += tally.errors
    result.first_error = result.first_error or tally.first_error


async def generation_window(grpc_url: str, plist: Sequence[str], concurrency: int, max_tokens: int, result: PathResult) -> None:
    from clients.generation import AsyncGenerationClient
    from perf.lib.chat_streams import DirectChat

    chat = DirectChat(AsyncGenerationClient(grpc_url, protocol="grpc", timeout_s=300))

    async def call(n: int) -> None:
        _, tokens = await chat.stream(plist[n], max_tokens)
        result.units += tokens

    try:
        tally = await call_loop(call, concurrency, count=len(plist))
    finally:
        await chat.client.close()
    result.requests += len(plist)
    result.errors += tally.errors
    result.first_error = result.first_error or tally.first_error


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = options.parser("perf.bench.cpu_cost", __doc__)
    p.add_argument("--requests", type=int, default=1000, help="requests per text path (default 1000)")
    p.add_argument("--image-requests", type=int, default=300, help="requests of image_classification (default 300)")
    p.add_argument("--gen-requests", type=int, default=24, help="text_generation streams (default 24)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per generation stream, ignore_eos (default 32)")
    p.add_argument("--concurrency", type=int, default=8, help=f"requests in flight (default 8; generation: {GEN_CONCURRENCY})")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="the idle window (default 5)")
    p.add_argument("--no-redis", action="store_true", help="no Redis L2 for text_embedding_cached")
    p.add_argument("--out", type=Path, help="results folder (default perf/results/cpu-cost-<UTC time>)")
    args = options.finish(p, p.parse_args(argv), argv)
    counts = (args.requests, args.image_requests, args.gen_requests, args.max_tokens, args.concurrency)
    if min(counts) < 1 or args.idle_seconds <= 0:
        p.error("counts, concurrency and --idle-seconds must be positive")
    return args


async def measure(args, deployment, key: str, say) -> tuple[dict[str, float], list[PathResult], list[str]]:
    """The idle rates, then each path's window. Returns (idle CPU-s per s by group, results, groups)."""
    triton, gateway = deployment, deployment.gateway  # the front door's URLs (deployment.triton: tritonserver's own)
    procs = processes.deployment(deployment, {"gateway": gateway}, deployment.redis)
    present = list(dict.fromkeys(p.group for p in procs))
    # Known groups in path order; stubs of models added later go in before Redis and the load generator.
    groups = [g for g in GROUP_ORDER[:-2] if g in present] + sorted(set(present) - set(GROUP_ORDER))
    groups += [g for g in GROUP_ORDER[-2:] if g in present]
    nonce = secrets.token_hex(4)
    texts, plist, counter, rng = sentences(), prompts(), iter(range(10**12)), random.Random(nonce)
    hits = [text_request(s) for s in texts]
    infer = f"http://{triton.http_url}/v2/models/{{}}/infer"

    def unique(n: int) -> list[str]:
        return [f"{texts[k % len(texts)]} ({nonce}-{k})" for k in (next(counter) for _ in range(n))]

    def window(path: str, n: int, concurrency: int, result: PathResult):
        """The load of one window of ``path``: ``n`` requests, their bodies built now."""
        check: Callable[[bytes], None] | None = None
        if path == "text_generation":
            return generation_window(
                triton.grpc_url, [plist[k % len(plist)] for k in range(n)], concurrency, args.max_tokens, result
            )
        if path in ("text_tokenizer", "text_embedding", "text_embedding_cached_miss"):
            url, bodies = infer.format(path.removesuffix("_miss")), [text_request(t) for t in unique(n)]
        elif path == "text_encoder":
            url, bodies = infer.format(path), [token_request(rng) for _ in range(n)]
        elif path == "text_embedding_cached_hit":
            url, bodies = infer.format("text_embedding_cached"), [hits[k % len(hits)] for k in range(n)]
        elif path == "gateway_embeddings":
            url, bodies, check = f"{gateway.url}/v1/embeddings", [gateway_request(t, key) for t in unique(n)], embedding_check
        else:
            url, bodies = infer.format(path), [image_request(b) for b in unique_jpegs(n, f"{nonce}-{next(counter)}")]
        return http_window(url, bodies, concurrency, result, check)

    # Warm each path (connections, first executions) and cache the hit set, in L1 too (sent twice).
    warm = PathResult("warm", "requests")
    for path in PATHS:
        if path == "text_generation":
            await generation_window(triton.grpc_url, plist[:2], 2, 4, PathResult("warm", "tokens"))
            continue
        for _ in range(2 if path == "text_embedding_cached_hit" else 1):
            await window(path, len(hits) if path == "text_embedding_cached_hit" else 4, 4, warm)
    if warm.errors:
        raise RuntimeError(f"warm-up failed: {warm.first_error}")

    before, t0 = group_cpu(procs), time.perf_counter()
    await asyncio.sleep(args.idle_seconds)
    idle_wall, after = time.perf_counter() - t0, group_cpu(procs)
    idle = {g: max(0.0, (after.get(g, 0.0) - before.get(g, 0.0)) / idle_wall) for g in groups}
    say("idle CPU (cores): " + ", ".join(f"{g} {v:.3f}" for g, v in idle.items()))

    results = []
    for path in PATHS:
        r = PathResult(path, "tokens" if path == "text_generation" else "requests")
        n = {"image_classification": args.image_requests, "text_generation": args.gen_requests}.get(path, args.requests)
        work = window(path, n, GEN_CONCURRENCY if path == "text_generation" else args.concurrency, r)
        before, t0 = group_cpu(procs), time.perf_counter()
        await work
        r.wall_s, after = time.perf_counter() - t0, group_cpu(procs)
        for g in groups:
            r.raw_cpu_s[g] = after.get(g, 0.0) - before.get(g, 0.0)
            r.net_cpu_s[g] = max(0.0, r.raw_cpu_s[g] - idle[g] * r.wall_s)
        if gone := [p.name for p in procs if not processes.alive(p)]:
            r.errors += 1
            r.first_error = r.first_error or f"processes exited: {', '.join(gone)}"
        say(
            f"{path}: {r.units} {r.unit} in {r.wall_s:.1f} s, {r.errors} errors, {r.refused} refused (503), "
            f"{1000 * sum(r.net_cpu_s.values()) / max(1, r.units):.2f} CPU-s per 1000 {r.unit}"
        )
        results.append(r)
    return idle, results, groups


def markdown(head: Sequence[str], idle: dict[str, float], results: Sequence[PathResult], groups: Sequence[str]) -> str:
    rows = []
    for r in results:
        cells = ["-" if (v := r.per_1000(g)) is None or v < 0.005 else f"{v:.2f}" for g in groups]
        total = sum(r.per_1000(g) or 0.0 for g in groups)
        name = f"{r.path}{' (per 1k tokens)' if r.unit == 'tokens' else ''}"
        rows.append([name, *cells, f"{total:.2f}", f"{r.wall_s:.1f}", r.refused, r.errors])
    idle_cells = [f"{1000 * idle.get(g, 0.0):.1f}" for g in groups]
    rows.append(["idle, CPU-s per 1,000 s", *idle_cells, f"{1000 * sum(idle.values()):.1f}", "", "", ""])
    columns = ["path", *(g.removeprefix("stub ") for g in groups), "total", "wall s", "refused", "errors"]
    note = "CPU-seconds per 1,000 requests (text_generation: per 1,000 generated tokens), net of each process's idle rate; "
    return "\n".join([*head, "", note + "`-`: below 0.005.", "", report.table(columns, rows)]) + "\n"


def csv_rows(idle: dict[str, float], results: Sequence[PathResult], groups: Sequence[str]) -> list[dict]:
    return [
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
            "errors": r.errors,
        }
        for r in results
        for g in groups
    ]


def run(args: argparse.Namespace) -> int:
    out = results_dir(args.out, "cpu-cost")
    say, load = progress(), load_average()
    say(f"perf.bench.cpu_cost: paths {','.join(PATHS)}; load average {load}")
    key = "sk-cpu-" + secrets.token_hex(16)
    deployment, failure = None, ""
    idle: dict[str, float] = {}
    results: list[PathResult] = []
    groups: list[str] = []
    with tempfile.TemporaryDirectory(prefix="perf-cpu-cost-") as workdir:
        try:
            deployment = start_deployment(MODELS, Path(workdir), key, not args.no_redis, say)
            idle, results, groups = asyncio.run(measure(args, deployment, key, say))
        except Exception as exc:  # noqa: BLE001 - reported with what was measured
            failure = f"{type(exc).__name__}: {exc}"
            say(f"perf.bench.cpu_cost stopped: {failure}")
        finally:
            if deployment is not None:
                deployment.stop(logs_to=out)

    head = header("CPU cost per request path", "perf.bench.cpu_cost", args.argv, load)
    head.append(
        f"- {args.requests} requests per text path, {args.image_requests} images, {args.gen_requests} generation streams "
        f"of {args.max_tokens} tokens; concurrency {args.concurrency} (generation {GEN_CONCURRENCY}); Redis L2 "
        f"{'on' if deployment is not None and deployment.redis else 'off'}; front door on every direct path, the "
        "gateway on gateway_embeddings"
    )
    if failure:
        head.append(f"- stopped early: {failure}")
    errors = [f"{r.path}: {r.first_error}" for r in results if r.errors]
    if errors:
        head.append(f"- errors: {'; '.join(errors[:5])}")
    csvs = {"cpu_cost.csv": csv_rows(idle, results, groups)}
    report.write(out, markdown(head, idle, results, groups), name="cpu_cost.md", csvs=csvs, say=say)
    complete = [r.path for r in results] == list(PATHS) and all(r.units > 0 for r in results)
    return 0 if not failure and not errors and complete else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
