"""`python -m perf.bench.tail`: the latency tail of every served model and ensemble, side by side.

Two tritonservers at once (`make serve`'s models, CPU variants, response cache on, no front door):
``after`` serves the shipped configs; ``before`` a linked copy whose batching configs add
``priority_levels: 2``, ``default_priority_level: 2`` and a REJECT ``default_queue_policy`` (the
settings that make tritonserver 2.51's batcher miss wake-ups, docs/performance.md), or with
``--alt-configs DIR`` ("alt") DIR's configs. Each workload (tail_measure.py: the text and image
models and ensembles, cache hits and misses, a generation stream, the OpenAI gateway's embeddings
and chat) runs at each ``--concurrency`` for ``--rounds`` interleaved rounds of ``--duration`` s
under wrk or the asyncio client (``--client``); a point is the median over rounds. Each window also
records the client's, server's and machine's CPU and each model's batch, queue and compute time.

``--long 60``: one 60 s window per workload and phase at concurrency 32. The targets (all-hit P99
<= 50 ms, every other P99 <= 3 x P50, in long mode max <= 5 x P50) are printed at the end with the
CPU of their window. Writes tail.csv, summary.md, targets.md/csv and the logs under
perf/results/tail-<UTC time>/.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from perf.bench.tail_measure import (
    GATEWAY_WORKLOADS,
    HIT_WORKLOADS,
    STATS_MODELS,
    STREAM_WORKLOADS,
    WORKLOADS,
    Window,
    measure,
    warm_up,
    workloads,
    wrk_script,
)
from perf.lib import lifecycle, load, options, report
from perf.lib.deployment import start_gateways
from perf.lib.paths import ROOT  # noqa: F401 - the shipped repository, beside before_repository's copy
from perf.lib.report import fmt as _f
from perf.lib.report import load_average, progress, table
from perf.lib.workload import prompts, sentences
from server.process import DEFAULT_CACHE_SIZE_MB

SERVED_MODELS = ("text_embedding", "text_embedding_cached", "image_classification")
# The generation engine before its admission window (docs/generation-internals.md#the-engine): the before phase
# serves text_generation with these parameters.
BEFORE_PARAMETERS = {"text_generation": {"admission_window_ms": "0"}}
PHASES = ("after", "before", "alt")


STALL_PBTXT = (
    "priority_levels: 2\n  default_priority_level: 2\n"
    "  default_queue_policy { timeout_action: REJECT allow_timeout_override: true }\n"
)


def stall_config_text(text: str, model: str = "", variant: bool = False) -> str:
    """A config.pbtxt text with the stall settings added to its dynamic_batching block (if any),
    and ``model``'s BEFORE_PARAMETERS values in place of its shipped ones (a generated variant in
    configs/ may predate a parameter: left as it is)."""
    text = text.replace("dynamic_batching {", "dynamic_batching {\n  " + STALL_PBTXT, 1)
    for key, value in BEFORE_PARAMETERS.get(model, {}).items():

        def with_value(m: re.Match[str], v: str = value) -> str:
            return m.group(1) + v + m.group(2)

        text, n = re.subn(
            r'(parameters \{ key: "' + re.escape(key) + r'" value: \{ string_value: ")[^"]*(")',
            with_value,
            text,
        )
        if n != 1 and not variant:
            raise ValueError(f"{model}/config.pbtxt: no parameter {key} to set for the before phase")
    return text


def before_repository(source: Path, target: Path, alt_configs: Path | None = None) -> Path:
    """``source``'s models at ``target`` (perf.lib.lifecycle.linked_repository) with the stall settings
    added to their configs, or, with ``alt_configs``, the configs of ``alt_configs/<model>/`` where it has them."""

    def config(model: str, relative: str, text: str) -> str | None:
        if alt_configs is None:
            return stall_config_text(text, model, variant=relative != "config.pbtxt")
        replacement = alt_configs / model / relative
        return replacement.read_text() if replacement.is_file() else None

    return lifecycle.linked_repository(source, target, config)


# --------------------------------------------------------------------------- report

TARGET_MAX_OVER_P50 = 5.0
TARGET_HITS_P99_MS = 50.0
TARGET_P99_OVER_P50 = 3.0


def targets(results: Sequence[Window], concurrency: int, phase: str = "after", long: bool = False) -> list[dict]:
    """The issue's targets, checked on ``phase`` at ``concurrency``: all-hit P99 <= 50 ms, every other
    workload P99 <= 3 x P50 (streams: the whole answer and TTFT), and with ``long`` (one long window
    per workload) max <= 5 x P50. Each row: target, value, met, and the figures it comes from."""
    rows = []
    by = {(r.phase, r.workload, r.concurrency): r for r in results}
    ratio, most = f"{TARGET_P99_OVER_P50:g} x P50", f"{TARGET_MAX_OVER_P50:g} x P50 (long window)"
    for name in WORKLOADS:
        if (r := by.get((phase, name, concurrency))) is None:
            continue
        if name in HIT_WORKLOADS:
            checks = [(f"P99 <= {TARGET_HITS_P99_MS:g} ms", r.p99_ms, TARGET_HITS_P99_MS, f"P99 {_f(r.p99_ms)} ms")]
        else:
            what = "answer " if name in STREAM_WORKLOADS else ""
            checks = [
                (f"{what}P99 <= {ratio}", r.p99_over_p50, TARGET_P99_OVER_P50, f"P50 {_f(r.p50_ms)}, P99 {_f(r.p99_ms)} ms")
            ]
        ttft = r.ttft_p50_ms if name in STREAM_WORKLOADS else None
        if ttft:
            detail = f"TTFT P50 {_f(ttft)}, P99 {_f(r.ttft_p99_ms)} ms"
            checks.append((f"TTFT P99 <= {ratio}", (r.ttft_p99_ms or 0) / ttft, TARGET_P99_OVER_P50, detail))
        if long:
            checks.append((f"max <= {most}", r.max_over_p50, TARGET_MAX_OVER_P50, f"P50 {_f(r.p50_ms)}, max {_f(r.max_ms)} ms"))
        if long and ttft:
            detail = f"TTFT P50 {_f(ttft)}, max {_f(r.ttft_max_ms)} ms"
            checks.append((f"TTFT max <= {most}", (r.ttft_max_ms or 0) / ttft, TARGET_MAX_OVER_P50, detail))
        cores = f"client {_f(r.client_cores, 2)}, server {_f(r.server_cores, 2)} (waiting {_f(r.server_wait_cores, 2)})"
        cores += f", machine {_f(r.machine_cores, 2)}"
        for what, value, limit, detail in checks:
            met = value is not None and value <= limit and not r.errors
            row = {"target": f"{name}, c{concurrency}: {what}", "value": value, "limit": limit, "detail": detail}
            rows.append(row | {"met": met, "cores": cores})
    return rows


def targets_table(rows: Sequence[dict]) -> str:
    """The targets as a markdown table: each target, the figure, PASS / FAIL, and the CPU beside it."""
    header = ["target", "value", "result", "from", "CPU cores (client, server, machine)"]
    body = [(t["target"], _f(t["value"], 2), "PASS" if t["met"] else "FAIL", t["detail"], t["cores"]) for t in rows]
    return table(header, body) + "\n"


def markdown(header: Sequence[str], results: Sequence[Window], target_rows: Sequence[dict]) -> str:
    ordered = sorted(results, key=lambda r: (WORKLOADS.index(r.workload), r.concurrency, r.phase != "before", r.phase))
    rows: list[tuple] = []
    for r in ordered:
        spread = f" ({_f(r.p99_range[0])}-{_f(r.p99_range[1])})" if r.p99_range and r.round > 1 else ""
        rps = _f(r.rps, 0 if r.rps and r.rps > 100 else 1)
        rows.append(
            (r.workload, r.phase, r.concurrency, rps, _f(r.p50_ms), _f(r.p99_ms) + spread, _f(r.max_ms), _f(r.p99_over_p50, 2))
            + (r.errors, _f(r.client_cores, 2), _f(r.server_cores, 2), _f(r.server_wait_cores, 2), _f(r.machine_cores, 2))
        )
    columns = ["workload", "phase", "conc.", "requests/s", "P50 ms", "P99 ms (rounds)", "max ms", "P99/P50", "errors"]
    lines = [*header, "", table(columns + ["client cores", "server cores", "server waiting", "machine cores"], rows, left=2)]
    streams = [r for r in ordered if r.workload in STREAM_WORKLOADS]
    if streams:
        columns = ["workload", "phase", "conc.", "answers/s", "TTFT P50 ms", "TTFT P99 ms", "TTFT max ms", "TTFT P99/P50"]
        rows = [
            (r.workload, r.phase, r.concurrency, _f(r.rps, 1), _f(r.ttft_p50_ms), _f(r.ttft_p99_ms), _f(r.ttft_max_ms))
            + (_f(r.ttft_p99_ms / r.ttft_p50_ms if r.ttft_p99_ms and r.ttft_p50_ms else None, 2), _f(r.gateway_cores, 2))
            for r in streams
        ]
        lines += ["", "Streams (P50/P99/max above are of the whole answer): time to the first text piece.", ""]
        lines.append(table(columns + ["gateway cores"], rows, left=2))
    if target_rows:
        lines += ["", "Targets:", "", targets_table(target_rows).rstrip("\n")]
    rows = [
        (r.workload, r.phase, model, r.concurrency, _f(s["batch"], 2), _f(s["queue_ms"], 2), _f(s["compute_ms"], 2))
        for r in ordered
        for model, s in ((m, r.stats[m]) for m in STATS_MODELS if m in r.stats)
    ]
    lines += [
        "",
        "Where the time goes (/v2/models/stats, medians over rounds): mean batch, queue ms and "
        "compute ms per request of each model the workload reached.",
        "",
        table(["workload", "phase", "model", "conc.", "batch", "queue ms", "compute ms"], rows, left=3),
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def check_before(http_url: str, generation: bool) -> None:
    """The before phase's server serves the stall settings, and text_generation its BEFORE_PARAMETERS."""
    from ops.repository import RepositoryClient

    config = RepositoryClient(http_url, timeout=10).config
    if (levels := config("text_tokenizer").get("dynamic_batching", {}).get("priority_levels", 0)) != 2:
        raise RuntimeError(f"before phase: text_tokenizer serves priority_levels {levels}, not 2")
    params = config("text_generation").get("parameters", {}) if generation else {}
    for key, value in BEFORE_PARAMETERS["text_generation"].items():
        if generation and params.get(key, {}).get("string_value") != value:
            raise RuntimeError(f"before phase: text_generation serves {key} {params.get(key)}, not {value}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = options.parser("perf.bench.tail", __doc__)
    p.add_argument(
        "--workloads",
        type=options.choices(WORKLOADS),
        default=list(WORKLOADS),
        help=f"comma-separated, of: {', '.join(WORKLOADS)}",
    )
    p.add_argument("--concurrency", type=options.int_list, help="comma-separated connection counts (default 4,32; --long: 32)")
    p.add_argument(
        "--phases",
        type=options.choices(PHASES),
        default=["after", "before"],
        help="after (shipped configs) and/or before (stall settings; 'alt' with --alt-configs)",
    )
    p.add_argument(
        "--alt-configs",
        type=Path,
        help="a folder of <model>/config.pbtxt (and <model>/configs/*.pbtxt) the second server serves "
        "instead of the stall settings (phase 'alt')",
    )
    options.add_run(p, "tail", rounds=3, duration=4.0, warmup=1.0)
    options.add_client(p, "; image_classification always uses the asyncio client")
    cache_help = f"Triton's response cache (default {DEFAULT_CACHE_SIZE_MB}, as make serve)"
    p.add_argument("--cache-size-mb", type=int, default=DEFAULT_CACHE_SIZE_MB, help=cache_help)
    p.add_argument(
        "--long",
        type=float,
        metavar="SECONDS",
        help="long mode: one window of SECONDS per workload and phase at concurrency 32 (unless "
        "--concurrency names others), and the max <= 5 x P50 target checked on it",
    )
    tokens_help = "new tokens per streamed answer (ignore_eos, greedy) of the generation workloads (default 8)"
    p.add_argument("--max-tokens", type=int, default=8, help=tokens_help)
    args = p.parse_args(argv)
    if args.long is not None:
        args.rounds, args.duration = 1, args.long
    args.workload_list = args.workloads
    args.concurrency_list = args.concurrency or ([32] if args.long is not None else [4, 32])
    second = "alt" if args.alt_configs else "before"
    args.phase_list = [second if x in ("before", "alt") else x for x in args.phases]
    if set(args.phase_list) - {"after", second} or not args.phase_list:
        p.error(f"--phases: after, {second} or both")
    if args.alt_configs and not args.alt_configs.is_dir():
        p.error(f"--alt-configs {args.alt_configs}: not a folder")
    if args.max_tokens < 1:
        p.error("--max-tokens must be positive")
    return options.finish(p, args, argv)


def run(args: argparse.Namespace) -> int:
    from perf.lib import served as served_mod

    say = progress()

    out_dir = report.results_dir(args.out_dir, "tail")
    served = served_mod.served_encoder(args.precision)
    texts = sentences()
    load_avg = load_average()
    needs_image = "image_classification" in args.workload_list
    models = SERVED_MODELS if needs_image else tuple(m for m in SERVED_MODELS if m != "image_classification")
    if any(w in STREAM_WORKLOADS for w in args.workload_list):
        models += ("text_generation",)
    if "text_encoder_router" in args.workload_list:  # off text_embedding's path outside a rollout
        models += ("text_encoder_router",)
    nonce = secrets.token_hex(4)
    api_key = "sk-tail-" + secrets.token_hex(16)
    work = workloads(nonce, texts, api_key)
    windows: list[Window] = []

    def salt(w, script: Path | None) -> None:
        # Each wrk run counts from 1: a fresh salt per run, or the warm-up's texts (and an earlier
        # window's) come back as cache hits in the measured window.
        if script is not None:
            script.write_text(wrk_script(w, texts, f"{nonce}-{secrets.token_hex(3)}"))

    say(f"perf.bench.tail: response cache {args.cache_size_mb} MiB")
    config = {"model_config_name": served.config_name, "cache_size_bytes": args.cache_size_mb << 20}
    before = lambda source, target: before_repository(source, target, args.alt_configs)  # noqa: E731
    with lifecycle.side_by_side(args.phase_list, models, out_dir, say, before, **config) as (servers, workdir):
        if servers is None:
            return 1
        wrk_able = [n for n in args.workload_list if args.use_wrk and work[n].kind not in ("image", "chat", "generation")]
        scripts = {name: workdir / f"{name}.lua" for name in wrk_able}  # written by salt() before each run
        gateways: dict = {}
        try:
            if any(w in GATEWAY_WORKLOADS for w in args.workload_list):
                wanted = {phase: (server.triton_grpc_url, ["--no-request-log"]) for phase, server in servers.items()}
                start_gateways(wanted, workdir, api_key, say, gateways)
            if "before" in servers:
                check_before(servers["before"].triton_http_url, "text_generation" in models)

            for conc in args.concurrency_list:
                for name in args.workload_list:
                    for rnd, phase in lifecycle.interleaved(args.phase_list, args.rounds):
                        w, server, script = work[name], servers[phase], scripts.get(name)
                        gateway = gateways.get(phase) if w.via_gateway else None
                        window = Window(phase, name, conc, rnd, "wrk" if script else "python")
                        stream = (api_key, prompts(), args.max_tokens, args.warmup) if name in STREAM_WORKLOADS else None
                        if not stream:
                            salt(w, script)
                            warm_up(server, gateway, w, conc, args.warmup, script)
                        salt(w, script)
                        measure(window, w, server, gateway, script, args.duration, stream)
                        windows.append(window)
                        say(
                            window.line() + f"  client {_f(window.client_cores, 2)} server {_f(window.server_cores, 2)} "
                            f"waiting {_f(window.server_wait_cores, 2)} machine {_f(window.machine_cores, 2)} cores"
                            + (f"  TTFT P50 {_f(window.ttft_p50_ms)} P99 {_f(window.ttft_p99_ms)}" if stream else "")
                            + (f"  gateway {_f(window.gateway_cores, 2)} cores" if gateway else "")
                        )
        finally:
            lifecycle.stop(gateways, out_dir, "gateway")

    results = load.points(windows)
    main_phase = "after" if "after" in args.phase_list else args.phase_list[0]
    target_rows = targets(results, max(args.concurrency_list), main_phase, long=args.long is not None)
    second = "a second server on the same machine with " + (
        f"the configs of {args.alt_configs}" if args.alt_configs else "the old settings"
    )
    header = [
        *report.header("Latency tail per model and ensemble, side by side", "perf.bench.tail", args.argv, load_avg),
        (
            f"- phases {', '.join(args.phase_list)} interleaved in {args.rounds} rounds of {args.duration:g} s "
            f"(after {args.warmup:g} s warm-up); the second phase: {second}; encoder variant {served.variant}; "
            f"client {'wrk (1 thread, Lua)' if args.use_wrk else 'asyncio'} over HTTP keep-alive, straight to tritonserver "
            "(gateway_*: to an OpenAI gateway in front of each server); unique texts and images per request (hits: 60 "
            f"texts sent once first); streams: asyncio clients (SSE; gRPC for text_generation_stream), {args.max_tokens} "
            "new tokens (ignore_eos, greedy), the prompts of perf/data/generation_prompts.json in turn"
        ),
        "- figures: medians over the rounds (P99 range in brackets), max the largest; cores: CPU seconds per second; "
        "server waiting: seconds per second the server's threads were runnable but waited for a CPU (schedstat)",
    ]
    if args.long is None:
        header.append("- max <= 5 x P50 is a target over one long window per workload: `--long 60`")
    (out_dir / "targets.md").write_text("\n".join(header[:3]) + "\n\n" + targets_table(target_rows))
    csvs = {"tail.csv": [w.record() for w in windows], "targets.csv": target_rows}
    report.write(out_dir, markdown(header, results, target_rows), csvs=csvs, say=say)
    print(f"Targets at c{max(args.concurrency_list)} ({main_phase}):\n\n" + targets_table(target_rows), flush=True)
    return 0 if windows and all(w.requests and not w.errors for w in windows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
