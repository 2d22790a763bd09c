"""`python -m perf.bench.generate_bench` (`make perf-generate`): text generation, every system side by side.

Closed-loop clients at 1, 4, 16 and 32 streams, 128 new tokens a request (``ignore_eos``, greedy),
the prompts of perf/data/generation_prompts.json (chat template applied, each led by a line of its
own so that no prefix cache spares a prefill). Systems: engine (in process, the served precision
and config.pbtxt settings), grpc and http (Triton's ``text_generation``), gateway (the OpenAI gateway's
streamed ``/v1/chat/completions`` on that tritonserver), llama (``llama-server`` on
the peers' Q4_0 GGUF, perf/baselines/llama_cpp.py), openvino (perf/baselines/openvino_genai.py).
Each (system, concurrency) cell is a --duration window, systems taking turns on the same prompts:
tokens/s arrived in it (streams still open at its end are cancelled, the system waited for until
idle), TTFT from send to first token (a lower bound for one still waiting), ITL per token. Then
--prefill N long prompts one at a time (prompt tokens/s). Writes summary.md (with the target
ratios), cells.csv, requests.csv, prefill.csv and ratios.csv under perf/results/generate-<UTC time>/.
Instead: ``--profile`` splits the in-process engine's step (profile.csv); ``--memory`` serves each
precision for the stub's RSS, loaded and after the longest prompts' streams (memory.csv).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perf.bench.generate_phases import measure_prefill, prefill_summary, run_memory, run_profile
from perf.lib import lifecycle, options, report
from perf.lib.deployment import start_gateways
from perf.lib.generation_load import Cell, Stream, System, Workload, load_workload, run_window, wait_idle
from perf.lib.generation_systems import (
    DEFAULT_MODEL_DIR,
    MODEL,
    PEERS,
    EngineSystem,
    GatewaySystem,
    LlamaSystem,
    OpenVinoSystem,
    TritonSystem,
    resolve_precision,
    served_engine_settings,
    start_engine,
    start_triton,
    triton_busy,
)
from perf.lib.paths import GENERATION_PROMPTS, ROOT
from perf.lib.report import display_path

# The OpenMP wait policy of the served engine (python_backends/generation/__init__.py) for the
# in-process engine too; before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SYSTEMS = ("engine", "grpc", "http", "gateway", "llama", "openvino")
SYSTEM_NAMES = {
    "engine": "engine in-process (LLMEngine + EngineLoop, no Triton)",
    "grpc": "Triton text_generation, gRPC stream",
    "http": "Triton text_generation, HTTP SSE (generate_stream)",
    "gateway": "OpenAI gateway, /v1/chat/completions SSE, on Triton's gRPC port (request log off)",
    "llama": "llama.cpp llama-server on the published Q4_1 GGUF requantized to Q4_0, --parallel = the concurrency",
    "openvino": "OpenVINO GenAI ContinuousBatchingPipeline in process on the same GGUF, stepped by one thread",
}
PROTOCOLS = {"engine": "in-process", "grpc": "grpc stream", "http": "http sse", "gateway": "http sse", "llama": "http sse"}
IDLE_TIMEOUT = 60.0  # seconds a system gets to finish its cancelled work after a window

# The targets, checked (not enforced) in the printed ratios.
TARGET_SERVED_VS_ENGINE = 0.9
TARGET_GATEWAY_TOKENS = 0.95  # gateway / Triton grpc tokens/s, at least
TARGET_GATEWAY_TTFT_MS = 10.0  # gateway TTFT P50 - Triton grpc TTFT P50, at most
# Ours served over each peer, tokens/s per concurrency: >= 0.9x llama.cpp and >= 1.0x OpenVINO alone,
# >= 1.0x the better peer at 16 and 32 streams; TTFT P50 at 16 streams <= llama.cpp's.
TARGET_VS_PEER = {"llama": {1: 0.9, 16: 1.0, 32: 1.0}, "openvino": {1: 1.0, 16: 1.0, 32: 1.0}}
PEER_NAMES = {"llama": "llama.cpp", "openvino": "OpenVINO GenAI"}


def _f(value, digits: int = 1) -> str:
    if value is None or value == "":
        return ""
    return report.fmt(value, digits) if isinstance(value, float) else str(value)


def ratios(
    concurrency: Sequence[int], summaries: dict[tuple[str, int], dict], prefill: Sequence[dict] = ()
) -> list[dict[str, Any]]:
    """Each ratio with its target (where the issue sets one), whether it is met, and its terms."""
    rows: list[dict[str, Any]] = []

    def ratio(name: str, num, den, target: float | None = None, above: bool = True, unit: str = "") -> None:
        rows.append(report.ratio(name, num, den, target, above, unit=unit))

    def get(key: str, c: int, figure: str = "tokens_per_s"):
        return (summaries.get((key, c)) or {}).get(figure)

    levels = sorted(concurrency, reverse=True)
    for c in levels:
        for key in ("grpc", "http"):
            ratio(f"Triton {key} / engine tokens/s, {c} streams", get(key, c), get("engine", c), TARGET_SERVED_VS_ENGINE)
        if ("gateway", c) in summaries:
            ratio(f"gateway / Triton grpc tokens/s, {c} streams", get("gateway", c), get("grpc", c), TARGET_GATEWAY_TOKENS)
            ttfts = get("gateway", c, "ttft_p50_ms"), get("grpc", c, "ttft_p50_ms")
            name = f"gateway - Triton grpc TTFT P50, {c} streams"
            rows.append(report.ratio(name, *ttfts, TARGET_GATEWAY_TTFT_MS, False, "-", unit=" ms"))
    for c in levels:  # the peers: ours over each
        for peer in (p for p in PEERS if (p, c) in summaries):
            for key in (k for k in ("grpc", "http", "engine") if (k, c) in summaries):
                who, name = ("engine" if key == "engine" else f"Triton {key}"), PEER_NAMES[peer]
                target = None if key == "engine" else TARGET_VS_PEER[peer].get(c)
                ratio(f"{who} / {name} tokens/s, {c} streams", get(key, c), get(peer, c), target)
                if key != "engine":
                    ttft = 1.0 if c == 16 and peer == "llama" else None
                    ratio(
                        f"{who} / {name} TTFT P50 (lower is better), {c} streams",
                        get(key, c, "ttft_p50_ms"),
                        get(peer, c, "ttft_p50_ms"),
                        ttft,
                        above=False,
                        unit=" ms",
                    )
                    ratio(
                        f"{who} / {name} ITL P99 (lower is better), {c} streams",
                        get(key, c, "itl_p99_ms"),
                        get(peer, c, "itl_p99_ms"),
                        unit=" ms",
                    )
    llama = next((r for r in prefill if r["system"] == "llama"), None)
    for r in prefill:
        if llama is not None and r is not llama:
            name = f"prefill {r['system']} / llama.cpp prompt tokens/s (P50, one long prompt at a time)"
            ratio(name, r["prompt_tokens_per_s_p50"], llama["prompt_tokens_per_s_p50"])
    return rows


def markdown(header: Sequence[str], cells: Sequence[dict], ratio_rows: Sequence[dict], prefill: Sequence[dict]) -> str:
    """summary.md: the header lines, one row per (system, concurrency), prefill, the ratios."""
    columns = ["system", "concurrency", "tokens/s", "TTFT P50 ms", "TTFT P99 ms", "TTFT max ms", "ITL P50 ms", "ITL P99 ms"]
    rows = []
    for s in cells:
        notes = []
        if s["ttft_censored"]:
            notes.append(f"{s['ttft_censored']} still waiting at the window's end (TTFT a lower bound)")
        if s["errors"]:
            notes.append(f"{s['errors']} errors: {s['first_error'][:120]}")
        figures = [_f(s[k]) for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "ttft_max_ms", "itl_p50_ms", "itl_p99_ms")]
        rows.append(
            [s["system"], s["concurrency"], *figures, _f(s["itl_max_ms"]), f"{s['requests']} ({s['finished']})", "; ".join(notes)]
        )
    parts = ["\n".join(header), report.table([*columns, "ITL max ms", "requests (finished)", "notes"], rows)]
    if prefill:
        parts.append(
            report.table(
                ["prefill: long prompts one at a time, 1 new token", "prompts", "prompt tokens/s P50", "TTFT P50 ms"],
                ([r["system"], r["prompts"], _f(r["prompt_tokens_per_s_p50"]), _f(r["ttft_p50_ms"])] for r in prefill),
            )
        )
    parts.append(report.ratio_table(ratio_rows))
    return "\n\n".join(parts) + "\n"


def run_grid(args: argparse.Namespace, systems: dict[str, System], workload: Workload, cells: dict, say) -> list[dict]:
    """Every system at every concurrency (--rounds times), then the prefill phase; its rows."""
    order = [k for k in SYSTEMS if k in systems]
    aio = asyncio.new_event_loop()
    try:
        for system in systems.values():
            aio.run_until_complete(system.open())
        for key in order:  # warm-up: first requests allocate; keep them out of the windows
            aio.run_until_complete(systems[key].prepare(args.concurrency[0]))
            warm = systems[key].stream(workload.prompts[0], 4, Stream(key, 0, 0, time.perf_counter()))
            try:
                aio.run_until_complete(asyncio.wait_for(warm, 120))
            except Exception as exc:  # noqa: BLE001 - its windows will say so too
                say(f"    warm-up of {key} failed: {exc}")
        # The same prompts in the same order for every system of a (round, concurrency): a window that
        # drew the long prompts would otherwise do several times the prefill of its neighbour's.
        prompts = list(workload.prompts)
        random.Random(20261203).shuffle(prompts)  # the kinds (short, long, code) mixed
        turn = 0
        for rnd in range(args.rounds):
            for c in args.concurrency:
                start = (rnd * len(args.concurrency) + args.concurrency.index(c)) * 17 % len(prompts)
                for key in order[turn % len(order) :] + order[: turn % len(order)]:
                    cell = cells.setdefault((key, c), Cell(key, c, PROTOCOLS.get(key, "in-process")))
                    aio.run_until_complete(systems[key].prepare(c))
                    window = run_window(systems[key], c, args.duration, prompts, args.max_tokens, start, cell, args.warmup)
                    aio.run_until_complete(window)
                    idle = wait_idle(systems[key], IDLE_TIMEOUT)
                    if not idle:
                        cell.errors.append(f"still busy {IDLE_TIMEOUT:.0f} s after the window")
                    s = cell.summary()
                    say(
                        f"  round {rnd + 1} c{c:<3} {key:<6} {s['tokens_per_s']} tokens/s, TTFT p50 {s['ttft_p50_ms']} ms, "
                        f"ITL p50 {s['itl_p50_ms']} ms" + ("" if idle else " (did not become idle)")
                    )
                turn += 1
        if args.prefill and workload.long_prompts:
            return aio.run_until_complete(measure_prefill(systems, workload, args.prefill, say))
        return []
    finally:
        for system in systems.values():
            aio.run_until_complete(system.close())
        aio.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)  # the defaults follow it
    p = options.parser("perf.bench.generate_bench", __doc__)
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 16 tokens, a few prompts, 4 s windows (CI smoke)")
    p.add_argument(
        "--concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default="1,4" if quick else "1,4,16,32",
        help="comma-separated stream counts (default 1,4,16,32; --quick 1,4)",
    )
    p.add_argument("--max-tokens", type=int, default=16 if quick else 128, help="new tokens per request (default %(default)s)")
    p.add_argument(
        "--systems", type=options.choices(SYSTEMS), default=list(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}"
    )
    p.add_argument("--prefill", type=int, default=0 if quick else 8, metavar="N", help="N long prompts one at a time (0: skip)")
    p.add_argument("--profile", action="store_true", help="only profile the in-process engine's steps (torch.profiler)")
    p.add_argument("--memory", action="store_true", help="only measure the text_generation stub's RSS per precision served")
    options.add_run(p, "generate", 1, 4.0 if quick else 30.0, 0.0, os.environ.get("PRECISION", "auto"))
    args = options.finish(p, p.parse_args(argv), argv)
    args.data = GENERATION_PROMPTS
    if min(args.concurrency) < 1 or args.max_tokens < 1:
        p.error("--concurrency and --max-tokens must be positive")
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        p.error(f"{DEFAULT_MODEL_DIR} has no config.json: export the model first (python -m export.generation)")
    try:
        args.config_name, args.weights_precision = resolve_precision(ROOT / "model_repository", args.precision)
    except ValueError as exc:
        p.error(str(exc))
    return args


def start_peers(wanted: set[str], tokenizer, out_dir: Path, systems: dict[str, System], notes: list[str], say) -> None:
    """llama-server and OpenVINO GenAI on the peers' Q4_0 GGUF (made first if missing), as asked."""
    from perf.baselines import llama_cpp

    try:
        gguf = llama_cpp.model("Q4_0", say=say)
        if "llama" in wanted:
            binary = llama_cpp.server(say=say)
            systems["llama"] = LlamaSystem(binary, gguf, out_dir / "llama_server.log")
            say(f"llama-server: {display_path(binary)} on {gguf.name}")
    except llama_cpp.LlamaCppError as exc:
        say(f"llama.cpp unavailable: {exc}")
        notes.append(f"llama.cpp unavailable: {str(exc)[:200]}")
        return
    if "openvino" in wanted:
        from perf.baselines.openvino_genai import Pipeline

        started = time.perf_counter()
        pipeline = Pipeline(gguf, os.cpu_count() or 1)
        systems["openvino"] = OpenVinoSystem(pipeline, tokenizer)
        say(f"OpenVINO GenAI on {gguf.name} in {time.perf_counter() - started:.1f} s: {pipeline.settings}")


def run(args: argparse.Namespace) -> int:
    from python_backends.generation.engine_loop import EngineLoop
    from python_backends.generation.linear import describe_cpu
    from server.process import ServerError

    out_dir = report.results_dir(args.out_dir, "generate")
    if args.profile:
        return run_profile(args, out_dir)
    if args.memory:
        return run_memory(args, out_dir)
    say, load = report.progress(), report.load_average()
    say(
        f"perf.bench.generate_bench: {', '.join(args.systems)} at concurrency {args.concurrency}, {args.max_tokens} tokens, "
        f"{args.duration:g} s windows x {args.rounds} round(s), load average {load}"
    )
    say(f"weights precision {args.weights_precision} (PRECISION={args.precision}), CPU: {describe_cpu()}")
    wanted, notes = set(args.systems), list[str]()
    cells: dict[tuple[str, int], Cell] = {}
    systems: dict[str, System] = {}
    triton = loop = None
    gateways: dict = {}
    with tempfile.TemporaryDirectory(prefix="perf-generate-") as workdir:
        try:
            # The servers load while this process loads its own engine.
            if wanted & {"grpc", "http", "gateway"}:
                triton = start_triton(Path(workdir), args.config_name)
                say(f"tritonserver starting ({MODEL} only): http {triton.http_url}, grpc {triton.grpc_url}")
            settings = served_engine_settings(ROOT / "model_repository", args.config_name)
            engine = start_engine(settings)
            say(f"engine loaded in-process: {settings or 'EngineConfig defaults'}")
            workload = load_workload(args.data, engine.tokenizer, args.quick)
            if "engine" in wanted:
                systems["engine"] = EngineSystem(loop := EngineLoop(engine))
            if wanted & set(PEERS):
                start_peers(wanted, engine.tokenizer, out_dir, systems, notes, say)
            if triton is not None:
                try:
                    triton.wait_ready(timeout=300)
                    probe = triton_busy(triton.metrics_url)
                    for key in ("grpc", "http"):
                        if key in wanted:
                            systems[key] = TritonSystem(key, triton.grpc_url if key == "grpc" else triton.http_url, key, probe)
                    if "gateway" in wanted:
                        key = "sk-bench-" + secrets.token_hex(16)
                        start_gateways(
                            {"gateway": (triton.triton_grpc_url, ["--no-request-log"])}, Path(workdir), key, say, gateways
                        )
                        systems["gateway"] = GatewaySystem(gateways["gateway"].url, key, workload.texts, probe)
                except ServerError as exc:
                    say(f"tritonserver did not start: {exc}\n{exc.log_tail}")
                    notes.append("tritonserver did not start")
            say(f"{len(workload.prompts)} prompts; measuring {', '.join(systems)}")
            prefill_rows = run_grid(args, systems, workload, cells, say)
        finally:
            if loop is not None:
                loop.shutdown()
            lifecycle.stop(gateways, out_dir, "gateway")
            if triton is not None:
                triton.stop(logs_to=out_dir)

    summaries = {k: c.summary() for k, c in cells.items()}
    ordered = [summaries[(k, c)] for c in args.concurrency for k in SYSTEMS if (k, c) in summaries]
    prefill = prefill_summary(prefill_rows)
    ratio_rows = ratios(args.concurrency, summaries, prefill)
    title = f"Text generation side by side: {MODEL} ({display_path(DEFAULT_MODEL_DIR)})"
    header = [
        *report.header(title, "perf.bench.generate_bench", args.argv, load),
        f"- {len(workload.prompts)} prompts ({display_path(args.data)}), chat template applied, {args.max_tokens} new tokens "
        f"each (ignore_eos), greedy; closed-loop clients, {args.duration:g} s window per system and concurrency"
        f"{f' after {args.warmup:g} s of warm-up' if args.warmup else ''}, {args.rounds} round(s), systems interleaved",
        f"- engine settings (from config.pbtxt): {json.dumps(settings) if settings else 'defaults'}",
        *[f"- {n}" for n in notes],
        *[f"- {key}: {SYSTEM_NAMES[key]}" for key in SYSTEMS if key in systems],
    ]
    requests = [s.row() for c in cells.values() for s in c.streams]
    csvs = {"cells.csv": ordered, "ratios.csv": ratio_rows, "prefill.csv": prefill_rows, "requests.csv": requests}
    report.write(out_dir, markdown(header, ordered, ratio_rows, prefill), csvs=csvs, say=say)
    ok = all(s["output_tokens"] > 0 for s in ordered) and len(ordered) == len(args.systems) * len(args.concurrency)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
