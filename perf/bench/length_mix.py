"""`python -m perf.bench.length_mix`: mixed-length traffic served against its in-process limit.

Texts of 8-128 tokens (``--mix``) at ``--concurrency`` 32 connections, one per HTTP request, to
``text_encoder`` (token ids, unpadded) and ``text_embedding`` (unique texts). Two tritonservers side
by side (CPU variants, no front door): ``after``, the shipped configs (``allow_ragged_batch`` and a
``max_batch_tokens`` budget: the backend groups rows by length, python_backends.onnx_engine.batching);
``before``, a linked copy without both (export.variants.drop_ragged, what a GPU variant serves).
Phases interleave over ``--rounds`` rounds of ``--duration`` s (medians); each figure is also a
ratio to the in-process limit for the same mix (perf.baselines.limit --length-mix). ``--url
HOST:PORT`` measures one running server (no limit unless ``--limit-rounds``). Writes length_mix.csv
and summary.md under perf/results/length-mix-<UTC>/.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from perf.baselines import limit as limit_mod
from perf.lib import lifecycle, load, options, report, triton_stats, wrk
from perf.lib import served as served_mod
from perf.lib.harness import write_csv
from perf.lib.paths import ROOT
from perf.lib.report import load_average, progress, table
from perf.lib.workload import infer_body, text_request

WORKLOADS = ("text_encoder", "text_embedding")
MODELS = ("text_embedding",)  # the ensemble loads the tokenizer and the encoder
HEADERS = {"Content-Type": "application/json"}


def token_body(ids: Sequence[int]) -> bytes:
    """text_encoder's request for one row of token ids, as long as the row (unpadded)."""
    n = len(ids)
    inputs = [("input_ids", list(ids)), ("attention_mask", [1] * n)]
    return infer_body([{"name": k, "shape": [1, n], "datatype": "INT64", "data": v} for k, v in inputs])[0]


def mixed_texts(lengths: Sequence[int], tokenizer, seed: int = 0) -> list[str]:
    """One text per length whose tokenization (with [CLS], [SEP] and a request number of up to
    4 tokens put in front later) is about that long: words from a fixed list, as many as fit
    (a space-separated text tokenizes to the sum of its words' tokens)."""
    words = (
        "serving models under load keeps the tail of latency short when batches form from requests of similar "
        "length and the encoder runs fewer padded tokens per call"
    ).split()
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
    make: Callable[[int], bytes]
    lua: str  # wrk: the Lua ``request`` function and the data it draws from

    def script(self) -> str:
        """A wrk Lua script sending the workload's requests (perf.lib.wrk)."""
        return wrk.script(f"/v2/models/{self.name}/infer", HEADERS, self.lua)


def workloads(mix: tuple[int, int], nonce: str, seed: int = 0, pool: int = 2000) -> dict[str, Workload]:
    lengths = limit_mod.mix_lengths(pool, *mix, seed=seed)
    rows = [r.tolist() for r in limit_mod.token_rows(lengths, seed=seed)]
    texts = mixed_texts(lengths, served_mod.served_tokenizer(), seed=seed)
    # a number in front makes every text unique: Triton's response cache never answers
    return {
        "text_encoder": Workload(
            "text_encoder", lambda i: token_body(rows[i % pool]), wrk.cycle([token_body(r) for r in rows[:500]])
        ),
        "text_embedding": Workload(
            "text_embedding",
            lambda i: text_request(f"{nonce}{i} {texts[i % pool]}")[0],
            wrk.unique_texts(texts, text_request("\0")[0], nonce, before=True),
        ),
    }


@dataclass
class Window(load.Window):
    batch_rows: float | None = None  # text_encoder's rows per execution over the window


def measure(url: str, w: Workload, window: Window, duration: float, warmup: float, start: int, script: Path | None) -> None:
    """One window: wrk with ``script`` (C, one thread: little of the 2 cores), else asyncio."""
    endpoint = f"http://{url}/v2/models/{w.name}/infer"
    make = lambda n: (w.make(n), HEADERS)  # noqa: E731
    if warmup > 0:
        asyncio.run(load.closed_loop(endpoint, make, window.concurrency, warmup, start=start + 10**9))
    before = triton_stats.snapshot(url)
    if script is not None:
        window.take_wrk(wrk.run(url, script, window.concurrency, duration))
    else:
        window.take(asyncio.run(load.closed_loop(endpoint, make, window.concurrency, duration, start=start)))
    window.stats = triton_stats.per_request(before, triton_stats.snapshot(url), ("text_encoder",))
    window.batch_rows = window.stats.get("text_encoder", {}).get("batch")


def before_repository(source: Path, target: Path) -> Path:
    """``source``'s models at ``target`` (files linked) with text_encoder's configs not ragged."""
    from export.variants import drop_ragged

    return lifecycle.linked_repository(
        source, target, lambda model, _, text: drop_ragged(text) if model == "text_encoder" else None
    )


def _f(value, digits: int = 1) -> str:
    return report.fmt(value, digits, missing="-")


def markdown(header: Sequence[str], results: Sequence[Window], mix_limit) -> str:
    limit_rps = mix_limit.best[2] if mix_limit else None
    rows = [
        (p.workload, p.phase, p.concurrency, _f(p.rps, 0), _f(p.rps / limit_rps if p.rps and limit_rps else None, 2))
        + (_f(p.p50_ms), _f(p.p99_ms), _f(p.max_ms), _f(p.batch_rows), p.errors)
        for p in sorted(results, key=lambda p: (p.workload, p.concurrency, p.phase))
    ]
    columns = ["workload", "phase", "conc", "req/s", "ratio to limit", "P50 ms", "P99 ms", "max ms", "encoder rows/execution"]
    lines = [*header, "", table([*columns, "errors"], rows, left=2)]
    if mix_limit is not None:
        lines += ["", limit_mod.mix_markdown(mix_limit)]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = options.parser("perf.bench.length_mix", __doc__)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    mix = f"{limit_mod.DEFAULT_MIX[0]}-{limit_mod.DEFAULT_MIX[1]}"
    p.add_argument("--mix", default=mix, metavar="LOW-HIGH", help="tokens per text, drawn uniformly (default 8-128)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--phases", default="after,before", help="comma-separated, of: after, before")
    p.add_argument("--url", help="HOST:PORT of a running tritonserver's HTTP endpoint: measure it alone (phase url)")
    options.add_run(p, "length-mix", rounds=3, duration=8.0, warmup=2.0)
    limit_help = "rounds of the in-process limit (default 3; 0 skips it; with --url default 0)"
    p.add_argument("--limit-rounds", type=int, default=None, help=limit_help)
    p.add_argument("--limit-seconds", type=float, default=1.0)
    p.add_argument("--limit-pool", type=int, default=512)
    budgets = ",".join(map(str, limit_mod.DEFAULT_BUDGETS))
    p.add_argument("--budgets", default=budgets, help="token budgets the limit tries (comma-separated)")
    options.add_client(p)
    args = p.parse_args(argv)
    args.workload_list = options.names(p, "--workloads", args.workloads, WORKLOADS)
    args.mix_range = tuple(int(x) for x in args.mix.split("-"))
    args.phase_list = ["url"] if args.url else options.names(p, "--phases", args.phases, ("after", "before"))
    if args.limit_rounds is None:
        args.limit_rounds = 0 if args.url else 3
    return options.finish(p, args, argv)


def run(args: argparse.Namespace) -> int:
    from server.deployment import Deployment

    # SIGTERM (a timeout, a CI cancel) raises, so the servers are stopped in ``finally``.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    say = progress()

    out_dir = report.results_dir(args.out_dir, "length-mix")
    served = served_mod.served_encoder(args.precision)
    load_avg = load_average()
    nonce = secrets.token_hex(4)
    work = workloads(args.mix_range, nonce)
    windows: list[Window] = []
    servers: dict[str, Deployment] = {}
    workdir = Path(tempfile.mkdtemp(prefix="perf-length-mix-"))
    try:
        repositories = {phase: ROOT / "model_repository" for phase in ([] if args.url else args.phase_list)}
        if "before" in repositories:
            repositories["before"] = before_repository(repositories["before"], workdir / "repository-before")
        servers = lifecycle.start(repositories, MODELS, workdir, say, model_config_name=served.config_name)
        if not lifecycle.wait_ready(servers, say):
            return 1
        urls = {"url": args.url} if args.url else {phase: server.triton_http_url for phase, server in servers.items()}
        scripts = {}
        for name in args.workload_list if args.use_wrk else ():
            scripts[name] = workdir / f"{name}.lua"
            scripts[name].write_text(work[name].script())
        for sequence, (name, (rnd, phase)) in enumerate(
            (name, turn) for name in args.workload_list for turn in lifecycle.interleaved(args.phase_list, args.rounds)
        ):
            window = Window(phase, name, args.concurrency, rnd, "wrk" if args.use_wrk else "python")
            measure(urls[phase], work[name], window, args.duration, args.warmup, sequence * 10**6, scripts.get(name))
            windows.append(window)
            say(f"{window.line()}  encoder rows/execution {_f(window.batch_rows)}")
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
    results = load.points(windows)
    header = [
        *report.header("Mixed-length traffic against its in-process limit", "perf.bench.length_mix", args.argv, load_avg),
        (
            f"- {args.mix} tokens per text, one text per HTTP request, {args.concurrency} connections; phases "
            f"{', '.join(args.phase_list)} interleaved in {args.rounds} rounds of {args.duration:g} s (after "
            f"{args.warmup:g} s warm-up); client {'wrk (1 thread)' if args.use_wrk else 'asyncio'}; encoder variant "
            f"{served.variant}; ratio = served req/s over the limit's seq/s"
        ),
    ]
    text = markdown(header, results, mix_limit)
    report.write(out_dir, text)
    write_csv(out_dir / "length_mix.csv", [w.record() for w in windows])
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
