"""`python -m perf.bench.generate_bench` (`make perf-generate`): text generation, every system side by side.

Streams at concurrency 1, 4, 16 and 32 (closed loop: each client starts its next request
when one ends), 128 new tokens per request with ``ignore_eos`` (so every stream makes
exactly that many), greedy, the checked-in prompts of perf/data/generation_prompts.json
cycled, the model's chat template applied by the benchmark for every system, each request's
prompt starting with a line of its own (``request <system>-<n>``) so that no prefix cache
spares any system a prefill (``--repeat-prompts`` sends them as they are). The served
model and the in-process engine run the weights precision ``--precision`` resolves to
(``PRECISION``, default auto: the best variant gated on this CPU). Systems:

  naive    perf/baselines/naive_generate_server.py: transformers ``generate()`` one request at a time
           behind FastAPI (SSE); the clients are concurrent, the server serialises them;
  engine   the generation engine in this process, no Triton (LLMEngine + EngineLoop, the
           clients submit through EngineLoop.submit): the limit of this design;
  grpc     Triton's ``text_generation`` over a gRPC stream (tritonclient.grpc.aio);
  http     the same over HTTP SSE (``POST /v2/models/text_generation/generate_stream``),
           both through the launcher's front door as clients reach it;
  llama    llama.cpp's ``llama-server`` (built beside the runtime's libraries) on the peers' GGUF:
           the published Q4_1 requantized to Q4_0 by llama.cpp's quantizer, as a llama.cpp user
           does (``--peer-type``; perf/baselines/llama_cpp.py), ``--parallel`` = the concurrency,
           ``--cont-batching``, its ``/completion`` stream (ggml's thread pool, as the runtime's build:
           the same speed as an OpenMP build here);
  openvino OpenVINO GenAI's ``ContinuousBatchingPipeline`` in this process on the same GGUF, stepped
           by one thread as OpenVINO Model Server does (perf/baselines/openvino_genai.py).

The in-process engine takes the served model's config.pbtxt parameters (KV pool, block
size, batch limits), so engine and served model run the same settings.

Each (system, concurrency) cell is a window of --duration seconds: its output tokens per
second are the tokens that arrived in the window over its length; at the window's end
the requests still streaming are cancelled (the benchmark then waits until that system is
idle). The systems take turns at each concurrency, in an order rotated from one level to
the next (and --rounds repeats the grid), so a noisy neighbour hurts them alike; within a
concurrency every system gets the same prompts in the same (shuffled) order. TTFT is
from a request's send to its first token; a request still without one at the window's end
counts with its waiting time so far (a lower bound; the table says how many). Inter-token
latency is the gap between two streamed responses, per token they carry.

Then prefill (``--prefill N``): the long prompts (400+ tokens), one request at a time with
one new token, each starting with a line no other request has (no prefix cache helps),
on engine, grpc, llama and openvino in turn: prompt tokens/s.

Then prefix caching: the shared ~500-token system prompt with a different user message
per request, one at a time, on two in-process engines (same weights) with
enable_prefix_caching on and off, requests alternating between them: TTFT with the
prefix cached (second request onward) over TTFT without.

Prints a table and the ratios the targets are written in (engine / naive tokens/s at 32
streams >= 10, served / engine at every concurrency >= 0.9, served / llama.cpp tokens/s >= 0.9
alone and served / OpenVINO >= 1.0, both >= 1.0 at 16 and 32 streams, TTFT P50 at 16 streams
<= llama.cpp's, cached / uncached TTFT <= 0.3), and writes cells.csv, requests.csv, prefill.csv, prefix.csv, ratios.csv
and summary.md under
perf/results/generate-<UTC time>/. ``--quick``: concurrency 1 and 4, 16 tokens, a few
prompts, short windows (the CI smoke).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perf.bench.generate_phases import (
    measure_prefill,
    measure_prefix,
    prefill_summary,
    prefix_summary,
    run_genai_perf,
    run_memory,
    run_profile,
)
from perf.bench.generate_report import _fmt, markdown, pa_display, ratios
from perf.lib import report
from perf.lib.generation_load import Cell, Stream, System, Workload, load_workload, run_window, wait_idle
from perf.lib.generation_systems import (
    DEFAULT_MODEL_DIR,
    MODEL,
    PEERS,
    EngineSystem,
    GrpcSystem,
    LlamaSystem,
    OpenVinoSystem,
    SseSystem,
    resolve_precision,
    served_engine_settings,
    start_engine,
    start_triton,
    triton_busy,
)
from perf.lib.harness import write_csv
from perf.lib.paths import GENERATION_PROMPTS, ROOT
from perf.lib.report import load_average

if TYPE_CHECKING:  # imported where they are used: the in-process systems need neither
    pass

log = logging.getLogger(__name__)

# The OpenMP wait policy of the served engine (python_backends/generation/__init__.py) for the
# in-process engine and the naive server too; before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULT_DATA = GENERATION_PROMPTS
SYSTEMS = ("naive", "engine", "nodraft", "grpc", "http", "llama", "openvino")
# Measured only when named in --systems.
OPTIONAL_SYSTEMS = ("nodraft",)
SYSTEM_NAMES = {
    "naive": "naive: transformers generate(), one request at a time (FastAPI, SSE)",
    "engine": "engine in-process (LLMEngine + EngineLoop, no Triton)",
    "nodraft": "engine in-process with prompt-lookup drafts off (num_speculative_tokens 0)",
    "grpc": "Triton text_generation, gRPC stream",
    "http": "Triton text_generation, HTTP SSE (generate_stream)",
    "llama": "llama.cpp llama-server on the peers' GGUF (SmolLM2-135M-Instruct, the published Q4_1 requantized by "
    "llama.cpp's quantizer, --peer-type), --parallel = the concurrency, --cont-batching, its /completion stream "
    "(perf/baselines/llama_cpp.py)",
    "openvino": "OpenVINO GenAI ContinuousBatchingPipeline in process on the peers' GGUF, stepped by one thread "
    "(perf/baselines/openvino_genai.py)",
}
PROTOCOLS = {
    "naive": "http sse",
    "engine": "in-process",
    "nodraft": "in-process",
    "grpc": "grpc stream",
    "http": "http sse",
    "llama": "http sse",
    "openvino": "in-process",
}


class Bench:
    def __init__(self, args: argparse.Namespace, out_dir: Path):
        self.args, self.out_dir = args, out_dir
        self.started = time.monotonic()
        self.cells: dict[tuple[str, int], Cell] = {}
        self.notes: list[str] = []
        self.prefill: list[dict[str, Any]] = []

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:5.0f} s] {message}", flush=True)

    def run_grid(self, systems: dict[str, System], workload: Workload) -> None:
        a = self.args
        order = [k for k in SYSTEMS if k in systems]
        aio = asyncio.new_event_loop()
        try:
            for system in systems.values():
                aio.run_until_complete(system.open())
            for key in order:  # warm-up: first requests allocate; keep them out of the windows
                aio.run_until_complete(systems[key].prepare(a.concurrency[0]))
                warm = Stream(key, 0, 0, time.perf_counter())
                try:
                    aio.run_until_complete(asyncio.wait_for(systems[key].stream(workload.prompts[0], 4, warm), 120))
                except Exception as exc:  # noqa: BLE001 - its windows will say so too
                    self.say(f"    warm-up of {key} failed: {exc}")
            turn = 0
            # Every system of a (round, concurrency) gets the same prompts in the same order: a window
            # that drew the long prompts would otherwise do several times the prefill of its neighbour's.
            order_of_prompts = list(range(len(workload.prompts)))
            random.Random(20261203).shuffle(order_of_prompts)  # the kinds (short, long, code) mixed
            prompts = [workload.prompts[i] for i in order_of_prompts]
            for rnd in range(a.rounds):
                for c in a.concurrency:
                    start = (rnd * len(a.concurrency) + a.concurrency.index(c)) * 17 % len(prompts)
                    for key in order[turn % len(order) :] + order[: turn % len(order)]:
                        cell = self.cells.setdefault((key, c), Cell(key, c, PROTOCOLS[key]))
                        aio.run_until_complete(systems[key].prepare(c))
                        aio.run_until_complete(
                            run_window(
                                systems[key],
                                c,
                                a.duration,
                                prompts,
                                a.max_tokens,
                                start,
                                cell,
                                unique=not a.repeat_prompts,
                                warmup=a.warmup,
                            )
                        )
                        idle = wait_idle(systems[key], a.idle_timeout)
                        if not idle:
                            cell.errors.append(f"still busy {a.idle_timeout:.0f} s after the window")
                        s = cell.summary()
                        self.say(
                            f"  round {rnd + 1} c{c:<3} {key:<6} {s['tokens_per_s']} tokens/s, "
                            f"TTFT p50 {s['ttft_p50_ms']} ms, ITL p50 {s['itl_p50_ms']} ms"
                            + ("" if idle else " (did not become idle)")
                        )
                    turn += 1
            if a.prefill and workload.long_prompts:
                self.prefill = aio.run_until_complete(measure_prefill(systems, workload, a.prefill, self.say))
        finally:
            for system in systems.values():
                aio.run_until_complete(system.close())
            aio.close()


# --------------------------------------------------------------------------- main


def split_openvino_config(items: Sequence[str]) -> tuple[dict[str, object], dict[str, str]]:
    """--openvino-config KEY=VALUE items: (SchedulerConfig fields, CPU plugin properties as given)."""
    from perf.baselines.openvino_genai import SCHEDULER_DEFAULTS

    scheduler: dict[str, object] = {}
    plugin: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--openvino-config {item!r}: expected KEY=VALUE")
        if key not in SCHEDULER_DEFAULTS:
            plugin[key] = value
        elif isinstance(SCHEDULER_DEFAULTS[key], bool):
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--openvino-config {key}: expected true or false, got {value!r}")
            scheduler[key] = value.lower() == "true"
        else:
            try:
                scheduler[key] = type(SCHEDULER_DEFAULTS[key])(value)
            except ValueError:
                raise ValueError(f"--openvino-config {key}: expected a number, got {value!r}") from None
    return scheduler, plugin


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.generate_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="concurrency 1 and 4, 16 tokens, a few prompts, 4 s windows (CI smoke; figures are rough)",
    )
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        help="comma-separated stream counts (default 1,8,16,32; --quick 1,4)",
    )
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 128, --quick 16)")
    p.add_argument("--duration", type=float, help="seconds per (system, concurrency) window (default 30, --quick 4)")
    p.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="seconds the clients run before each window is measured (default 0: the window starts with "
        "every client's first request at once, a cold-start burst; e.g. 30 for the steady state)",
    )
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole grid (default 1)")
    p.add_argument(
        "--systems",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=None,
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default all but nodraft)",
    )
    p.add_argument(
        "--peer-type",
        default="Q4_0",
        choices=("Q4_0", "Q4_1", "Q8_0"),
        help="the peers' GGUF: the published Q4_1 as it is or requantized by llama.cpp's quantizer (default "
        "Q4_0, the format llama.cpp has repacked x86 kernels for)",
    )
    p.add_argument(
        "--openvino-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an OpenVINO GenAI SchedulerConfig field (cache_size, max_num_seqs, max_num_batched_tokens, "
        "dynamic_split_fuse, enable_prefix_caching) or a CPU plugin property (KV_CACHE_PRECISION=u8), repeatable",
    )
    p.add_argument("--no-prefix", action="store_true", help="skip the prefix-caching comparison")
    p.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="send the checked-in prompts as they are, so repeats hit prefix caches (default: each "
        "request starts with a line of its own and every prompt is computed in full)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=8,
        metavar="N",
        help="after the grid, N long prompts (400+ tokens) one at a time on engine, grpc and llama: "
        "prompt tokens/s (default 8, 0: skip; --quick: 0)",
    )
    p.add_argument("--prefix-max-tokens", type=int, default=4, help="new tokens per prefix-caching request (default 4)")
    p.add_argument(
        "--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="exported weights (default model_repository/text_generation/1)"
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="prompts JSON (default perf/data/generation_prompts.json)")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a system to finish cancelled work after a window (default 60)",
    )
    p.add_argument(
        "--genai-perf",
        type=Path,
        metavar="EXE",
        help="also run NVIDIA's genai-perf (installed in its own venv: the path of its genai-perf script) "
        "against the served model over gRPC at the highest concurrency, one request per stream",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="only profile steps of the in-process engine (torch.profiler): decode-only at 1 stream and the "
        "highest concurrency, then the served workload's steady state (a closed loop over every prompt) "
        "at 16 and the highest: matrix products vs attention vs other ops vs Python outside the ops",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="only measure the text_generation stub's RSS per weights precision (each variant served in turn, "
        "or only --precision when it names one: once loaded, and after the highest concurrency's streams over the longest prompts)",
    )
    p.add_argument("--out-dir", type=Path, help="results folder (default perf/results/generate-<UTC time>)")
    p.add_argument(
        "--precision",
        default=os.environ.get("PRECISION", "auto"),
        help="the weights precision served, as `make serve PRECISION=...` (default auto: the best variant "
        "that passed its gate on this CPU; fp32, fp16_fp32, bf16, int4_bf16)",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    q = args.quick
    if args.systems is None:
        args.systems = [k for k in SYSTEMS if k not in OPTIONAL_SYSTEMS]
    if q:
        args.prefill = 0
    for name, full, quick in (("concurrency", [1, 4, 16, 32], [1, 4]), ("max_tokens", 128, 16), ("duration", 30.0, 4.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.duration <= 0 or args.rounds < 1:
        p.error("--concurrency, --max-tokens, --duration and --rounds must be positive")
    if not (args.model_dir / "config.json").is_file():
        p.error(f"{args.model_dir} has no config.json: export the model first (python -m export.generation)")
    try:
        args.openvino_scheduler, args.openvino_plugin = split_openvino_config(args.openvino_config)
        args.config_name, args.weights_precision = resolve_precision(ROOT / "model_repository", args.precision)
    except ValueError as exc:
        p.error(str(exc))
    return args


def run(args: argparse.Namespace) -> int:
    from perf.baselines.naive_generate_server import NaiveGenerateServer
    from server.process import ServerError, free_port

    out_dir = report.results_dir(args.out_dir, "generate")
    if args.profile:
        return run_profile(args, out_dir)
    if args.memory:
        return run_memory(args, out_dir)
    bench = Bench(args, out_dir)
    load = load_average()
    bench.say(
        f"perf.bench.generate_bench: {', '.join(args.systems)} at concurrency {args.concurrency}, "
        f"{args.max_tokens} tokens, {args.duration:g} s windows x {args.rounds} round(s), load average {load}"
    )
    from python_backends.generation.linear import describe_cpu

    bench.say(f"weights precision {args.weights_precision} (PRECISION={args.precision}), CPU: {describe_cpu()}")

    wanted = set(args.systems)
    workdir = Path(tempfile.mkdtemp(prefix="perf-generate-"))
    triton = naive = loop = nodraft_loop = genai = None
    systems: dict[str, System] = {}
    try:
        # The servers load while this process loads its own engine.
        if wanted & {"grpc", "http"}:
            triton = start_triton(args.model_dir, workdir, args.config_name)
            bench.say(f"tritonserver starting ({MODEL} only): http {triton.http_url}, grpc {triton.grpc_url}")
        if "naive" in wanted:
            naive = NaiveGenerateServer(free_port(), out_dir / "naive_server.log", model_dir=args.model_dir).start()
            bench.say(f"naive server starting on {naive.http_url}")
        settings = served_engine_settings(ROOT / "model_repository", args.config_name)
        engine, loop = start_engine(args.model_dir, settings)
        bench.say(f"engine loaded in-process: {settings or 'EngineConfig defaults'}")
        workload = load_workload(args.data, engine.tokenizer, args.quick)
        if "engine" in wanted:
            systems["engine"] = EngineSystem(loop)
        if "nodraft" in wanted:
            _, nodraft_loop = start_engine(args.model_dir, {**settings, "num_speculative_tokens": 0})
            systems["nodraft"] = EngineSystem(nodraft_loop, "nodraft")
        if naive is not None:
            try:
                naive.wait_ready()
                systems["naive"] = SseSystem(
                    "naive", naive.http_url, lambda: bool((st := naive.stats())["queued"] or st["running"])
                )
            except RuntimeError as exc:
                bench.say(f"naive server did not start: {exc}")
                bench.notes.append("naive server did not start")
        if wanted & set(PEERS):
            from perf.baselines import llama_cpp

            try:
                gguf = llama_cpp.model(args.peer_type, say=bench.say)
            except llama_cpp.LlamaCppError as exc:
                gguf = None
                bench.say(f"the peers' GGUF is unavailable: {exc}")
                bench.notes.append(f"peers unavailable: {str(exc)[:200]}")
        if "llama" in wanted and gguf is not None:
            try:
                binary = llama_cpp.server(say=bench.say)
                systems["llama"] = LlamaSystem(binary, gguf, out_dir / "llama_server.log")
                bench.say(f"llama-server: {pa_display(binary)} on {gguf.name}")
            except llama_cpp.LlamaCppError as exc:
                bench.say(f"llama-server unavailable: {exc}")
                bench.notes.append(f"llama-server unavailable: {str(exc)[:200]}")
        if "openvino" in wanted and gguf is not None:
            from perf.baselines.openvino_genai import Pipeline

            started = time.perf_counter()
            pipeline = Pipeline(gguf, os.cpu_count() or 1, args.openvino_scheduler, args.openvino_plugin)
            systems["openvino"] = OpenVinoSystem(pipeline, engine.tokenizer)
            bench.say(f"OpenVINO GenAI on {gguf.name} in {time.perf_counter() - started:.1f} s: {pipeline.settings}")
        if triton is not None:
            try:
                triton.wait_ready(timeout=300)
                probe = triton_busy(triton.metrics_url)
                if "grpc" in wanted:
                    systems["grpc"] = GrpcSystem(triton.grpc_url, probe)
                if "http" in wanted:
                    systems["http"] = SseSystem(
                        "http",
                        triton.http_url,
                        probe,
                        extra={"return_num_output_tokens": True, "return_finish_reason": True, "exclude_input_in_output": True},
                    )
            except ServerError as exc:
                bench.say(f"tritonserver did not start: {exc}\n{exc.log_tail}")
                bench.notes.append("tritonserver did not start")
        bench.say(f"{len(workload.prompts)} prompts; measuring {', '.join(systems)}")
        bench.run_grid(systems, workload)
        genai = None
        if args.genai_perf is not None and "grpc" in systems:
            assert triton is not None  # the grpc system is Triton's
            c = max(args.concurrency)
            bench.say(f"genai-perf at concurrency {c} ({args.genai_perf})")
            genai = run_genai_perf(
                args.genai_perf,
                triton.grpc_url,
                args.model_dir,
                out_dir,
                workload.prompts,
                c,
                args.max_tokens,
                requests=max(c, 4),
                timeout=max(120.0, 6 * args.duration),
            )
            bench.say(f"    {genai.get('error') or genai}")

        prefix_rows, prefix = [], None
        if not args.no_prefix:
            bench.say("prefix caching on / off (in-process engines, shared system prompt)")
            loop.shutdown()
            loop = None
            prefix_rows = measure_prefix(engine, workload, args.prefix_max_tokens, bench.say)
            prefix = prefix_summary(prefix_rows)
    finally:
        for engine_loop in (loop, nodraft_loop):
            if engine_loop is not None:
                engine_loop.shutdown()
        if naive is not None:
            naive.stop()
        if triton is not None:
            triton.stop()
            if triton.log_path.is_file():
                shutil.copyfile(triton.log_path, out_dir / "tritonserver.log")
        shutil.rmtree(workdir, ignore_errors=True)

    summaries = {k: c.summary() for k, c in bench.cells.items()}
    ordered = [summaries[(k, c)] for c in args.concurrency for k in SYSTEMS if (k, c) in summaries]
    prefill = prefill_summary(bench.prefill)
    ratio_rows = ratios(args, summaries, prefix, prefill)
    header = [
        f"# Text generation side by side: {MODEL} ({pa_display(args.model_dir)})",
        "",
        (f"- {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before measuring {load}"),
        f"- command: `{' '.join(['python -m perf.bench.generate_bench', *args.argv])}`",
        (
            f"- {len(workload.prompts)} prompts ({pa_display(args.data)}), chat template applied, {args.max_tokens} new "
            f"tokens each (ignore_eos), greedy; closed-loop clients, {args.duration:g} s window per system and "
            f"concurrency{f' after {args.warmup:g} s of warm-up' if args.warmup else ''}, {args.rounds} round(s), "
            f"systems interleaved"
        ),
        f"- engine settings (from config.pbtxt): {json.dumps(settings) if settings else 'defaults'}",
        *[f"- {n}" for n in bench.notes],
    ]
    for key in SYSTEMS:
        if key in systems:
            header.append(f"- {key}: {SYSTEM_NAMES[key]}")
    table = markdown(header, ordered, ratio_rows, prefix)
    if prefill:
        write_csv(out_dir / "prefill.csv", bench.prefill)
        table += (
            "\n| prefill: long prompts one at a time, 1 new token | prompts | prompt tokens/s P50 | TTFT P50 ms |\n"
            "| --- | ---: | ---: | ---: |\n"
            + "".join(
                f"| {r['system']} | {r['prompts']} | {_fmt(r['prompt_tokens_per_s_p50'])} | {_fmt(r['ttft_p50_ms'])} |\n"
                for r in prefill
            )
        )
    if genai is not None:
        write_csv(out_dir / "genai_perf.csv", [genai])
        ours = summaries.get(("grpc", genai["concurrency"]), {})
        table += (
            "\n| genai-perf (perf_analyzer, gRPC stream) | concurrency | tokens/s | TTFT P50 ms | TTFT P99 ms | "
            "ITL P50 ms | ITL P99 ms | this benchmark's grpc tokens/s |\n| --- | ---: | ---: | ---: | ---: | ---: | "
            "---: | ---: |\n"
            f"| {genai.get('error') or 'measured'} | {genai['concurrency']} | {_fmt(genai.get('tokens_per_s'))} | "
            f"{_fmt(genai.get('ttft_p50_ms'))} | {_fmt(genai.get('ttft_p99_ms'))} | {_fmt(genai.get('itl_p50_ms'))} | "
            f"{_fmt(genai.get('itl_p99_ms'))} | {_fmt(ours.get('tokens_per_s'))} |\n"
        )
    report.write(out_dir, table)
    write_csv(out_dir / "cells.csv", ordered)
    write_csv(out_dir / "ratios.csv", ratio_rows)
    if prefix_rows:
        write_csv(out_dir / "prefix.csv", prefix_rows)
    requests = [
        {
            "system": s.system,
            "concurrency": s.concurrency,
            "prompt": s.prompt_index,
            "ttft_ms": round(1000 * (s.first - s.sent), 1) if s.first else None,
            "tokens": s.tokens,
            "finished": s.finished,
            "cancelled": s.cancelled,
            "error": s.error,
        }
        for c in bench.cells.values()
        for s in c.streams
    ]
    if requests:
        write_csv(out_dir / "requests.csv", requests)
    print("\n" + table, flush=True)
    bench.say(f"perf.bench.generate_bench: results in {pa_display(out_dir)}")
    ok = all(s["output_tokens"] > 0 for s in ordered) and len(ordered) == len(args.systems) * len(args.concurrency)
    return 0 if ok and (prefix is not None or args.no_prefix) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
