"""`python -m perf.tail`: the latency tail of every served model and ensemble, before and after.

One tritonserver (the models `make serve` loads, the CPU variants, Triton's response cache on)
and one closed-loop HTTP load generator (asyncio, one keep-alive connection per client). Each
workload runs at each ``--concurrency`` for ``--duration`` seconds, in two phases on the same
server, side by side:

  after   the configs as shipped (model_repository/*/config.pbtxt);
  before  a second server on a copy of the repository (model files linked, not copied) whose
          batching configs add what they had until the fix: ``priority_levels: 2``,
          ``default_priority_level: 2`` and ``default_queue_policy { timeout_action: REJECT
          allow_timeout_override: true }``. On tritonserver 2.51 those make the dynamic batcher
          miss wake-ups and wait out its 500 ms default wait (docs/performance.md).
          ``--before-via reload`` instead reloads the models of the first server with config
          overrides through the restricted repository API; on 2.51 that left
          text_embedding_cached hanging or aborted the server once its BLS chain had served,
          so it is not the default.

Workloads: text_tokenizer, text_encoder (direct, token ids), text_encoder_router (token ids),
text_embedding, text_embedding_cached with unique texts (all misses) and with 60 texts sent
once beforehand (all hits), image_classification (unique 64 x 64 PNGs). Texts and images are
unique per request across the whole run, so neither Triton's response cache nor the
embedding cache answers them. Reports requests/s, P50, P99, max and P99/P50, and checks the
targets at the highest concurrency: text_embedding_cached all hits P99 <= 50 ms, every text
workload P99 <= 3 x P50. Writes tail.csv, summary.md and the server log under
perf/results/tail-<UTC time>/.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import csv
import datetime as dt
import io
import json
import os
import random
import secrets
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

PERF_DIR = Path(__file__).resolve().parent
ROOT = PERF_DIR.parent
DEFAULT_RESULTS = PERF_DIR / "results"
SENTENCES = PERF_DIR / "data" / "sentences_16tok.json"

# What every batching model of the served path had until the fix, as a JSON config override.
STALL_BATCHING = {
    "priority_levels": "2",
    "default_priority_level": "2",
    "default_queue_policy": {"timeout_action": "REJECT", "allow_timeout_override": True},
}
# Reloaded for the "before" phase, leaves first (a step before the models that call it).
BATCHING_MODELS = ("text_encoder", "text_tokenizer", "text_encoder_router", "text_embedding_cached",
                   "image_preprocess", "image_classifier", "image_postprocess")
SERVED_MODELS = ("text_embedding", "text_embedding_cached", "image_classification")
TEXT_WORKLOADS = ("text_tokenizer", "text_encoder", "text_encoder_router", "text_embedding",
                  "text_embedding_cached_unique", "text_embedding_cached_hits")
WORKLOADS = TEXT_WORKLOADS + ("image_classification",)
TARGET_HITS_P99_MS = 50.0
TARGET_P99_OVER_P50 = 3.0
VOCAB = (1000, 30000)  # token ids drawn for the encoder's direct inputs (all-MiniLM-L6-v2: 30,522)


# --------------------------------------------------------------------------- requests


def infer_body(inputs: list[dict], binary: bytes = b"") -> tuple[bytes, dict[str, str]]:
    """A KServe v2 HTTP request; outputs come back in Triton's binary extension (cheap to skip)."""
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    headers = {"Content-Type": "application/octet-stream"}
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(header))
    return header + binary, headers


def text_request(text: str) -> tuple[bytes, dict[str, str]]:
    return infer_body([{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}])


def token_request(rng: random.Random, length: int = 16) -> tuple[bytes, dict[str, str]]:
    ids = [101] + [rng.randrange(*VOCAB) for _ in range(length - 2)] + [102]
    return infer_body([
        {"name": "input_ids", "shape": [1, length], "datatype": "INT64", "data": ids},
        {"name": "attention_mask", "shape": [1, length], "datatype": "INT64", "data": [1] * length},
    ])


def png(seed: int, size: int = 64) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    image = Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image_request(blob: bytes) -> tuple[bytes, dict[str, str]]:
    raw = struct.pack("<I", len(blob)) + blob
    return infer_body([{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES",
                        "parameters": {"binary_data_size": len(raw)}}], raw)


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    make: Callable[[int], tuple[bytes, dict[str, str]]]  # request number -> (body, headers)
    warm: Sequence[tuple[bytes, dict[str, str]]] = ()  # sent once, unmeasured, before a measurement


def workloads(nonce: str, sentences: Sequence[str]) -> dict[str, Workload]:
    """Every workload; ``nonce`` makes the unique texts unique across runs and phases too."""
    rng = random.Random(nonce)
    counter = iter(range(10**12))

    def unique_text(_: int) -> tuple[bytes, dict[str, str]]:
        n = next(counter)
        return text_request(f"{sentences[n % len(sentences)]} ({nonce}-{n})")

    hits = [text_request(s) for s in sentences]

    def image(_: int) -> tuple[bytes, dict[str, str]]:
        n = next(counter)  # a new image per request: image_preprocess's response cache never answers
        return image_request(png(hash((nonce, n)) & 0xFFFFFFFF))

    return {
        "text_tokenizer": Workload("text_tokenizer", "text_tokenizer", unique_text),
        "text_encoder": Workload("text_encoder", "text_encoder", lambda _: token_request(rng)),
        "text_encoder_router": Workload("text_encoder_router", "text_encoder_router", lambda _: token_request(rng)),
        "text_embedding": Workload("text_embedding", "text_embedding", unique_text),
        "text_embedding_cached_unique": Workload("text_embedding_cached_unique", "text_embedding_cached", unique_text),
        "text_embedding_cached_hits": Workload("text_embedding_cached_hits", "text_embedding_cached",
                                               lambda n: hits[n % len(hits)], warm=hits),
        "image_classification": Workload("image_classification", "image_classification", image),
    }


# --------------------------------------------------------------------------- load generator


@dataclass
class Result:
    phase: str
    workload: str
    concurrency: int
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    first_error: str = ""

    @property
    def p99_over_p50(self) -> float | None:
        return self.p99_ms / self.p50_ms if self.p99_ms and self.p50_ms else None

    def record(self) -> dict:
        return {**asdict(self), "p99_over_p50": self.p99_over_p50}


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


async def _closed_loop(url: str, w: Workload, concurrency: int, duration: float, warmup: float) -> tuple[list[float], int, str, float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    latencies: list[float] = []
    errors = 0
    first_error = ""
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        endpoint = f"http://{url}/v2/models/{w.model}/infer"
        for body, headers in w.warm:
            async with session.post(endpoint, data=body, headers=headers) as r:
                await r.read()
        started = time.monotonic()
        measure_from, stop_at = started + warmup, started + warmup + duration
        n = iter(range(10**12))

        async def client() -> None:
            nonlocal errors, first_error
            while True:
                now = time.monotonic()
                if now >= stop_at:
                    return
                body, headers = w.make(next(n))
                t0 = time.perf_counter()
                try:
                    async with session.post(endpoint, data=body, headers=headers) as r:
                        payload = await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    ok, payload = False, repr(exc).encode()
                elapsed = time.perf_counter() - t0
                if now < measure_from:
                    continue
                if ok:
                    latencies.append(elapsed)
                else:
                    errors += 1
                    first_error = first_error or payload[:200].decode(errors="replace")

        await asyncio.gather(*(client() for _ in range(concurrency)))
        measured = time.monotonic() - measure_from
    return latencies, errors, first_error, measured


def measure(url: str, phase: str, w: Workload, concurrency: int, duration: float, warmup: float = 1.0) -> Result:
    latencies, errors, first_error, seconds = asyncio.run(_closed_loop(url, w, concurrency, duration, warmup))
    r = Result(phase, w.name, concurrency, len(latencies), errors, seconds, first_error=first_error)
    if latencies:
        ms = sorted(x * 1000.0 for x in latencies)
        r.rps = len(ms) / seconds if seconds > 0 else None
        r.p50_ms, r.p99_ms, r.max_ms = percentile(ms, 50), percentile(ms, 99), ms[-1]
    return r


# --------------------------------------------------------------------------- phases


def with_stall_settings(config: dict) -> dict:
    """A served config (JSON, as GET /v2/models/<m>/config returns it) with the old batcher settings."""
    out = copy.deepcopy(config)
    if "dynamic_batching" not in out:
        raise ValueError(f"{config.get('name')} has no dynamic_batching")
    out["dynamic_batching"].update(copy.deepcopy(STALL_BATCHING))
    return out


def apply_before(client, models: Sequence[str], ensembles: Sequence[str], say: Callable[[str], None]) -> dict[str, dict]:
    """Reload each of ``models`` with the stall settings; returns the configs served before."""
    served = {}
    for model in models:
        served[model] = client.config(model)
        client.load(model, with_stall_settings(served[model]))
        batching = client.config(model).get("dynamic_batching", {})
        if int(batching.get("priority_levels", 0)) != 2:
            raise RuntimeError(f"{model}: the override did not take (dynamic_batching {batching})")
        say(f"    {model}: reloaded with priority_levels 2 and the queue policy")
    for ensemble in ensembles:
        client.wait_ready(ensemble)
    return served


STALL_PBTXT = ("priority_levels: 2\n  default_priority_level: 2\n"
               "  default_queue_policy { timeout_action: REJECT allow_timeout_override: true }\n")


def stall_config_text(text: str) -> str:
    """A config.pbtxt text with the stall settings added to its dynamic_batching block (if any)."""
    return text.replace("dynamic_batching {", "dynamic_batching {\n  " + STALL_PBTXT, 1)


def before_repository(source: Path, target: Path) -> Path:
    """A repository at ``target`` serving ``source``'s models with the stall settings: version
    folders and other files are symlinks, config.pbtxt and configs/*.pbtxt rewritten copies."""
    for model_dir in sorted(p for p in source.iterdir() if (p / "config.pbtxt").is_file()):
        out = target / model_dir.name
        out.mkdir(parents=True)
        for entry in model_dir.iterdir():
            if entry.name == "config.pbtxt":
                (out / entry.name).write_text(stall_config_text(entry.read_text()))
            elif entry.name == "configs" and entry.is_dir():
                (out / "configs").mkdir()
                for variant in entry.glob("*.pbtxt"):
                    (out / "configs" / variant.name).write_text(stall_config_text(variant.read_text()))
            else:
                (out / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return target


def targets(results: Sequence[Result], concurrency: int) -> list[dict]:
    """The issue's targets, checked on the "after" phase at ``concurrency``."""
    rows = []
    by = {(r.phase, r.workload, r.concurrency): r for r in results}
    hits = by.get(("after", "text_embedding_cached_hits", concurrency))
    if hits is not None:
        met = hits.p99_ms is not None and hits.p99_ms <= TARGET_HITS_P99_MS and not hits.errors
        rows.append({"target": f"text_embedding_cached all hits, c{concurrency}: P99 <= {TARGET_HITS_P99_MS:g} ms",
                     "value": hits.p99_ms, "met": met})
    for name in TEXT_WORKLOADS:
        r = by.get(("after", name, concurrency))
        if r is None:
            continue
        ratio = r.p99_over_p50
        rows.append({"target": f"{name}, c{concurrency}: P99 <= {TARGET_P99_OVER_P50:g} x P50",
                     "value": ratio, "met": ratio is not None and ratio <= TARGET_P99_OVER_P50 and not r.errors})
    return rows


def _f(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(header: Sequence[str], results: Sequence[Result], target_rows: Sequence[dict]) -> str:
    lines = list(header) + ["", "| workload | conc. | phase | requests/s | P50 ms | P99 ms | max ms | P99/P50 | errors |",
                            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(results, key=lambda r: (WORKLOADS.index(r.workload), r.concurrency, r.phase != "before")):
        lines.append(f"| {r.workload} | {r.concurrency} | {r.phase} | {_f(r.rps, 0)} | {_f(r.p50_ms)} | {_f(r.p99_ms)} | "
                     f"{_f(r.max_ms)} | {_f(r.p99_over_p50, 2)} | {r.errors} |")
    if target_rows:
        lines += ["", "| target (after) | value | met |", "| --- | ---: | --- |"]
        for t in target_rows:
            lines.append(f"| {t['target']} | {_f(t['value'], 2)} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, records: Sequence[dict]) -> None:
    columns: list[str] = []
    for record in records:
        columns += [k for k in record if k not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m perf.tail", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--concurrency", default="4,32", help="comma-separated connection counts (default 4,32)")
    p.add_argument("--phases", default="after,before", help="after (shipped configs), before (stall settings), or both")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per point (default 8)")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each point (default 1)")
    p.add_argument("--precision", default="cpu", help="what the server serves, as `make serve PRECISION=` (default cpu)")
    p.add_argument("--before-via", choices=("server", "reload"), default="server",
                   help="before phase on a second server (default) or by reloading the first one's models")
    p.add_argument("--cache-size-mb", type=int, default=64, help="Triton's response cache (default 64, as make serve)")
    p.add_argument("--out-dir", type=Path, help="results folder (default perf/results/tail-<UTC time>)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.workload_list = [w for w in args.workloads.split(",") if w]
    args.concurrency_list = [int(c) for c in args.concurrency.split(",") if c]
    args.phase_list = [x for x in args.phases.split(",") if x]
    if unknown := set(args.workload_list) - set(WORKLOADS):
        p.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    if set(args.phase_list) - {"after", "before"} or not args.phase_list:
        p.error("--phases: after, before or both")
    if not args.concurrency_list or min(args.concurrency_list) < 1 or args.duration <= 0:
        p.error("--concurrency and --duration must be positive")
    return args


def run(args: argparse.Namespace) -> int:
    from clients.repository import RepositoryClient
    from perf import limit as limit_mod
    from server.process import ServerError, ServerOptions, TritonServer

    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", flush=True)

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or DEFAULT_RESULTS / f"tail-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    served = limit_mod.served_encoder(args.precision)
    sentences = limit_mod.load_sentences(SENTENCES)
    load_avg = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    needs_image = "image_classification" in args.workload_list
    models = SERVED_MODELS if needs_image else tuple(m for m in SERVED_MODELS if m != "image_classification")
    token = secrets.token_urlsafe(16)
    batching = [m for m in BATCHING_MODELS if needs_image or not m.startswith("image_")]
    work = workloads(secrets.token_hex(4), sentences)
    results: list[Result] = []

    def measure_phase(phase: str, url: str) -> None:
        for conc in args.concurrency_list:
            for name in args.workload_list:
                r = measure(url, phase, work[name], conc, args.duration, args.warmup)
                results.append(r)
                say(f"{phase:6} {name:28} c{conc:<3} {_f(r.rps, 0):>6} req/s  P50 {_f(r.p50_ms):>7}  "
                    f"P99 {_f(r.p99_ms):>7}  max {_f(r.max_ms):>7} ms  errors {r.errors}"
                    + (f" ({r.first_error})" if r.first_error else ""))

    # One server per phase (or one for both with --before-via reload), one after the other.
    servers = [["after"], ["before"]] if args.before_via == "server" else [list(args.phase_list)]
    servers = [[p for p in group if p in args.phase_list] for group in servers]
    for group in (g for g in servers if g):
        workdir = Path(tempfile.mkdtemp(prefix="perf-tail-"))
        repository = ROOT / "model_repository"
        if group == ["before"]:
            repository = before_repository(repository, workdir / "repository-before")
        server = TritonServer(ServerOptions.with_free_ports(
            workdir=workdir, model_repository=repository, models=models, model_config_name=served.config_name,
            cache_size_bytes=args.cache_size_mb * 1024 * 1024, repository_token=token))
        say(f"perf.tail: starting tritonserver for {' and '.join(group)} ({', '.join(models)}; "
            f"--model-config-name={served.config_name or '(none)'}, response cache {args.cache_size_mb} MiB)")
        server.start()
        try:
            try:
                server.wait_ready(timeout=300)
            except ServerError as exc:
                say(f"    {exc}\n{exc.log_tail}")
                return 1
            client = RepositoryClient(server.http_url, token=token)
            for phase in group:
                if phase == "before" and group != ["before"]:
                    say("before: reloading every batching model with the old settings (repository API, config override)")
                    apply_before(client, batching, models, say)
                if phase == "before":
                    levels = int(client.config("text_tokenizer").get("dynamic_batching", {}).get("priority_levels", 0))
                    if levels != 2:
                        raise RuntimeError(f"before phase: text_tokenizer serves priority_levels {levels}, not 2")
                measure_phase(phase, server.http_url)
        finally:
            server.stop()
            if server.log_path.is_file():
                shutil.copyfile(server.log_path, out_dir / f"tritonserver-{'-'.join(group)}.log")
            shutil.rmtree(workdir, ignore_errors=True)

    target_rows = targets(results, max(args.concurrency_list))
    header = [
        "# Latency tail per model and ensemble, before and after the batcher fix",
        "",
        f"- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before {load_avg}",
        f"- command: `{' '.join(['python -m perf.tail', *args.argv])}`",
        f"- before: {'a second server, configs with' if args.before_via == 'server' else 'the same server reloaded with'} the old settings; "
        f"encoder variant {served.variant}; HTTP closed loop, {args.duration:g} s per point after "
        f"{args.warmup:g} s warm-up; unique texts and images per request (hits: 60 texts sent once first)",
        "- old settings: every batching model with priority_levels 2, default_priority_level 2 and "
        "default_queue_policy { timeout_action: REJECT allow_timeout_override: true }",
    ]
    table = markdown(header, results, target_rows)
    (out_dir / "summary.md").write_text(table)
    write_csv(out_dir / "tail.csv", [r.record() for r in results])
    print("\n" + table, flush=True)
    say(f"perf.tail: results in {out_dir.relative_to(ROOT) if out_dir.is_relative_to(ROOT) else out_dir}")
    return 0 if results and all(r.requests and not r.errors for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
