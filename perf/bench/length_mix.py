"""`python -m perf.bench.length_mix`: mixed-length traffic served against its in-process limit.

Texts of 8-128 tokens (``--mix``) arrive at ``--concurrency`` 32 connections, one text per
HTTP request, on two workloads: ``text_encoder`` direct (token ids, each request as long as
its text, unpadded) and ``text_embedding`` (texts, unique per request, through the tokenizer).
Two tritonservers run side by side on this machine (the CPU variants, no front door):

  after   the configs as shipped: text_encoder's inputs ``allow_ragged_batch`` and a token
          budget per run (``max_batch_tokens``): the batcher merges any lengths and the
          backend groups rows by length (python_backends.onnx_engine.batching);
  before  a copy of the repository (model files linked) whose text_encoder configs drop both
          (export.variants.drop_ragged, what a GPU variant serves): Triton batches only
          requests of equal shape, so lengths fragment the encoder's batches.

Phases are interleaved A B, B A, ... in ``--rounds`` rounds of ``--duration`` seconds; a
figure is the median over rounds. The in-process limit for the same mix is measured after
(perf.baselines.limit --length-mix: the whole pool sorted by length and cut under each token budget,
the served encoder file, threads and layouts), and each served figure is given as a ratio to
it. ``--url HOST:PORT`` measures one running server instead (phase "url", no limit unless
``--limit-rounds``). Writes length_mix.csv and summary.md under perf/results/length-mix-<UTC>/.
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
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from perf.baselines import limit as limit_mod
from perf.lib import lifecycle, load, report, wrk
from perf.lib import served as served_mod
from perf.lib.harness import write_csv
from perf.lib.paths import ROOT
from perf.lib.report import load_average, progress
from perf.lib.stats import median

WORKLOADS = ("text_encoder", "text_embedding")
MODELS = ("text_embedding",)  # the ensemble loads the tokenizer and the encoder


def token_body(ids: Sequence[int]) -> bytes:
    n = len(ids)
    return json.dumps(
        {
            "inputs": [
                {"name": "input_ids", "shape": [1, n], "datatype": "INT64", "data": list(ids)},
                {"name": "attention_mask", "shape": [1, n], "datatype": "INT64", "data": [1] * n},
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()


def text_body(text: str) -> bytes:
    return json.dumps(
        {
            "inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()


def mixed_texts(lengths: Sequence[int], tokenizer, seed: int = 0) -> list[str]:
    """One text per length whose tokenization (with [CLS], [SEP] and a request number of up to
    4 tokens put in front later) is about that long: words from a fixed list, as many as fit
    (a space-separated text tokenizes to the sum of its words' tokens)."""
    words = [
        "serving",
        "models",
        "under",
        "load",
        "keeps",
        "the",
        "tail",
        "of",
        "latency",
        "short",
        "when",
        "batches",
        "form",
        "from",
        "requests",
        "of",
        "similar",
        "length",
        "and",
        "the",
        "encoder",
        "runs",
        "fewer",
        "padded",
        "tokens",
        "per",
        "call",
    ]
    cost = dict(zip(words, (int(n) - 2 for n in tokenizer.encode(words).lengths)))
    rng = random.Random(seed)
    out = []
    for n in lengths:
        chosen: list[str] = []
        used, target = 0, max(1, n - 6)
        while True:
            word = rng.choice(words)
            if chosen and used + cost[word] > target:
                break
            chosen.append(word)
            used += cost[word]
        out.append(" ".join(chosen))
    return out


@dataclass
class Workload:
    name: str
    model: str
    make: Callable[[int], bytes]
    lua: str = ""  # wrk: the Lua ``request`` function and the data it draws from


def workloads(mix: tuple[int, int], nonce: str, seed: int = 0, pool: int = 2000) -> dict[str, Workload]:
    lengths = limit_mod.mix_lengths(pool, *mix, seed=seed)
    rows = [r.tolist() for r in limit_mod.token_rows(lengths, seed=seed)]
    texts = mixed_texts(lengths, served_mod.served_tokenizer(), seed=seed)
    token_bodies = [token_body(r).decode() for r in rows[:500]]
    head, _, tail = text_body("\0").decode().partition("\\u0000")
    encoder_lua = (
        wrk.lua_list("bodies", token_bodies) + "request = function()\n  n = n + 1\n"
        "  return wrk.format('POST', path, headers, bodies[(n % #bodies) + 1])\nend\n"
    )
    embedding_lua = (
        wrk.lua_list("texts", texts) + "request = function()\n  n = n + 1\n"
        f"  local body = {wrk.lua_string(head)} .. '{nonce}' .. tid .. 'x' .. n .. ' ' .. "
        f"texts[(n % #texts) + 1] .. {wrk.lua_string(tail)}\n"
        "  return wrk.format('POST', path, headers, body)\nend\n"
    )
    return {
        "text_encoder": Workload("text_encoder", "text_encoder", lambda i: token_body(rows[i % pool]), encoder_lua),
        # a number in front makes every text unique: Triton's response cache never answers
        "text_embedding": Workload(
            "text_embedding", "text_embedding", lambda i: text_body(f"{nonce}{i} {texts[i % pool]}"), embedding_lua
        ),
    }


def wrk_script(w: Workload) -> str:
    """A wrk Lua script sending ``w``'s requests; ``done`` prints the figures as one JSON line."""
    return wrk.script(f"/v2/models/{w.model}/infer", {"Content-Type": "application/json"}, w.lua)


@dataclass
class Window:
    phase: str
    workload: str
    concurrency: int
    round: int
    requests: int = 0
    errors: int = 0
    first_error: str = ""
    seconds: float = 0.0
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    batch_rows: float | None = None  # text_encoder's rows per execution over the window
    stats: dict = field(default_factory=dict)


async def closed_loop(
    url: str, w: Workload, concurrency: int, duration: float, start: int
) -> tuple[list[float], int, str, float]:
    """``concurrency`` clients, each sending its next request when its answer came."""
    headers = {"Content-Type": "application/json"}
    endpoint = f"http://{url}/v2/models/{w.model}/infer"
    return await load.closed_loop(endpoint, lambda n: (w.make(n), headers), concurrency, duration, start=start)


def encoder_stats(url: str) -> tuple[int, int]:
    """text_encoder's (inference_count, execution_count) so far."""
    import urllib.request

    with urllib.request.urlopen(f"http://{url}/v2/models/text_encoder/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"]
    return sum(int(s["inference_count"]) for s in stats), sum(int(s["execution_count"]) for s in stats)


def measure(
    url: str, w: Workload, window: Window, duration: float, warmup: float, start: int, script: Path | None = None
) -> None:
    """One window: wrk with ``script`` (C, one thread: little of the 2 cores), else asyncio."""
    if warmup > 0:
        asyncio.run(closed_loop(url, w, window.concurrency, warmup, start + 10**9))
    before = encoder_stats(url)
    if script is not None:
        result = wrk.run(url, script, window.concurrency, duration)
        after = encoder_stats(url)
        window.seconds = result["duration_us"] / 1e6
        window.requests, window.errors = result["requests"] - result["errors"], result["errors"]
        if window.requests:
            window.rps = window.requests / window.seconds
            window.p50_ms, window.p99_ms, window.max_ms = (result[k] / 1e3 for k in ("p50_us", "p99_us", "max_us"))
    else:
        latencies, window.errors, window.first_error, window.seconds = asyncio.run(
            closed_loop(url, w, window.concurrency, duration, start)
        )
        after = encoder_stats(url)
        window.requests = len(latencies)
        if latencies:
            window.rps, window.p50_ms, window.p99_ms, window.max_ms = load.figures(latencies, window.seconds)
    executions = after[1] - before[1]
    window.batch_rows = (after[0] - before[0]) / executions if executions else None


def before_repository(source: Path, target: Path) -> Path:
    """``source``'s models at ``target`` (files linked) with text_encoder's configs not ragged."""
    from export.variants import drop_ragged

    for model_dir in sorted(p for p in source.iterdir() if (p / "config.pbtxt").is_file()):
        out = target / model_dir.name
        out.mkdir(parents=True)
        for entry in model_dir.iterdir():
            if model_dir.name == "text_encoder" and entry.name == "config.pbtxt":
                (out / entry.name).write_text(drop_ragged(entry.read_text()))
            elif model_dir.name == "text_encoder" and entry.name == "configs":
                (out / "configs").mkdir()
                for variant in entry.glob("*.pbtxt"):
                    (out / "configs" / variant.name).write_text(drop_ragged(variant.read_text()))
            else:
                (out / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return target


@dataclass
class Point:
    phase: str
    workload: str
    concurrency: int
    rounds: int
    requests: int
    errors: int
    rps: float | None
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    batch_rows: float | None
    ratio_to_limit: float | None = None


def points(windows: Sequence[Window], limit_rps: float | None) -> list[Point]:
    keys = sorted({(w.phase, w.workload, w.concurrency) for w in windows}, key=lambda k: (k[1], k[2], k[0]))
    out = []
    for phase, workload, conc in keys:
        ws = [w for w in windows if (w.phase, w.workload, w.concurrency) == (phase, workload, conc)]
        rps = median([w.rps for w in ws])
        out.append(
            Point(
                phase,
                workload,
                conc,
                len(ws),
                sum(w.requests for w in ws),
                sum(w.errors for w in ws),
                rps,
                median([w.p50_ms for w in ws]),
                median([w.p99_ms for w in ws]),
                max((w.max_ms for w in ws if w.max_ms is not None), default=None),
                median([w.batch_rows for w in ws]),
                rps / limit_rps if rps and limit_rps else None,
            )
        )
    return out


def _f(value, digits: int = 1) -> str:
    return report.fmt(value, digits, missing="-")


def markdown(header: Sequence[str], results: Sequence[Point], mix_limit) -> str:
    lines = [
        *header,
        "",
        "| workload | phase | conc | req/s | ratio to limit | P50 ms | P99 ms | max ms | encoder rows/execution | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in results:
        lines.append(
            f"| {p.workload} | {p.phase} | {p.concurrency} | {_f(p.rps, 0)} | {_f(p.ratio_to_limit, 2)} | "
            f"{_f(p.p50_ms)} | {_f(p.p99_ms)} | {_f(p.max_ms)} | {_f(p.batch_rows)} | {p.errors} |"
        )
    if mix_limit is not None:
        lines += ["", limit_mod.mix_markdown(mix_limit)]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.length_mix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument(
        "--mix",
        default=f"{limit_mod.DEFAULT_MIX[0]}-{limit_mod.DEFAULT_MIX[1]}",
        metavar="LOW-HIGH",
        help="tokens per text, drawn uniformly (default 8-128)",
    )
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--phases", default="after,before", help="comma-separated, of: after, before")
    p.add_argument("--url", help="HOST:PORT of a running tritonserver's HTTP endpoint: measure it alone (phase url)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per window (default 8)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each window (default 2)")
    p.add_argument("--precision", default="cpu", help="what the servers serve, as `make serve PRECISION=` (default cpu)")
    p.add_argument(
        "--limit-rounds",
        type=int,
        default=None,
        help="rounds of the in-process limit (default 3; 0 skips it; with --url default 0)",
    )
    p.add_argument("--limit-seconds", type=float, default=1.0)
    p.add_argument("--limit-pool", type=int, default=512)
    p.add_argument(
        "--budgets", default=",".join(map(str, limit_mod.DEFAULT_BUDGETS)), help="token budgets the limit tries (comma-separated)"
    )
    p.add_argument(
        "--client",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="load generator: wrk when installed (auto), else asyncio",
    )
    p.add_argument("--out-dir", type=Path, help="results folder (default perf/results/length-mix-<UTC time>)")
    args = p.parse_args(argv)
    args.use_wrk = args.client == "wrk" or (args.client == "auto" and shutil.which("wrk") is not None)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    args.workload_list = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workload_list) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    args.mix_range = tuple(int(x) for x in args.mix.split("-"))
    args.phase_list = ["url"] if args.url else [x for x in args.phases.split(",") if x]
    if set(args.phase_list) - {"after", "before", "url"}:
        p.error("--phases: after, before")
    if args.limit_rounds is None:
        args.limit_rounds = 0 if args.url else 3
    return args


def run(args: argparse.Namespace) -> int:
    from perf.lib.deployment import server_deployment
    from server.process import TritonServer

    # SIGTERM (a timeout, a CI cancel) raises, so the servers are stopped in ``finally``.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    say = progress()

    out_dir = report.results_dir(args.out_dir, "length-mix")
    served = served_mod.served_encoder(args.precision)
    load_avg = load_average()
    nonce = secrets.token_hex(4)
    work = workloads(args.mix_range, nonce)
    windows: list[Window] = []
    urls: dict[str, str] = {"url": args.url} if args.url else {}
    servers: dict[str, TritonServer] = {}
    workdir = Path(tempfile.mkdtemp(prefix="perf-length-mix-"))
    try:
        for phase in [] if args.url else args.phase_list:
            repository = ROOT / "model_repository"
            if phase == "before":
                repository = before_repository(repository, workdir / "repository-before")
            servers[phase] = server_deployment(
                MODELS,
                workdir / phase,
                model_repository=repository,
                model_config_name=served.config_name,
                repository_token=secrets.token_urlsafe(16),
                front_door=False,
            ).triton
            say(f"starting tritonserver for {phase} (--model-config-name={served.config_name or '(none)'})")
            servers[phase].start()
        if not lifecycle.wait_ready(servers, say):
            return 1
        urls.update((phase, server.triton_http_url) for phase, server in servers.items())
        scripts = {}
        if args.use_wrk:
            for name in args.workload_list:
                scripts[name] = workdir / f"{name}.lua"
                scripts[name].write_text(wrk_script(work[name]))
        sequence = 0
        for name in args.workload_list:
            for rnd in range(args.rounds):
                order = args.phase_list if rnd % 2 == 0 else args.phase_list[::-1]
                for phase in order:
                    window = Window(phase, name, args.concurrency, rnd + 1)
                    measure(urls[phase], work[name], window, args.duration, args.warmup, sequence, scripts.get(name))
                    sequence += 10**6
                    windows.append(window)
                    say(
                        f"{phase:6} {name:15} c{args.concurrency} r{rnd + 1} {_f(window.rps, 0):>6} req/s  "
                        f"P50 {_f(window.p50_ms)}  P99 {_f(window.p99_ms)}  max {_f(window.max_ms)} ms  "
                        f"encoder rows/execution {_f(window.batch_rows)}  errors {window.errors}"
                        + (f" ({window.first_error})" if window.first_error else "")
                    )
    finally:
        lifecycle.stop(servers, out_dir)
        shutil.rmtree(workdir, ignore_errors=True)

    mix_limit = None
    if args.limit_rounds > 0:
        say(f"in-process limit for {args.mix}: {args.limit_rounds} rounds")
        mix_limit = limit_mod.measure_length_mix(
            served,
            args.mix_range,
            [int(b) for b in args.budgets.split(",")],
            pool=args.limit_pool,
            rounds=args.limit_rounds,
            seconds=args.limit_seconds,
            progress=say,
        )
    limit_rps = mix_limit.best[2] if mix_limit else None
    results = points(windows, limit_rps)
    header = [
        "# Mixed-length traffic against its in-process limit",
        "",
        (
            f"- {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before "
            f"{load_avg}, after {load_average()}"
        ),
        f"- command: `{' '.join(['python -m perf.bench.length_mix', *args.argv])}`",
        (
            f"- {args.mix} tokens per text, one text per HTTP request, {args.concurrency} connections; phases "
            f"{', '.join(args.phase_list)} interleaved in {args.rounds} rounds of {args.duration:g} s (after "
            f"{args.warmup:g} s warm-up); client {'wrk (1 thread)' if args.use_wrk else 'asyncio'}; encoder variant "
            f"{served.variant}; ratio = served req/s over the limit's seq/s"
        ),
    ]
    text = markdown(header, results, mix_limit)
    report.write(out_dir, text)
    write_csv(out_dir / "length_mix.csv", [asdict(w) | {"stats": ""} for w in windows])
    if mix_limit:
        write_csv(out_dir / "limit.csv", mix_limit.rows())
    print(text)
    print(f"results: {out_dir}")
    errors = sum(p.errors for p in results)
    return 1 if errors or not windows else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
