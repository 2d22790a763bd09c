"""perf.bench.generate_bench's other measurements: prefill (long prompts one at a time),
``--profile`` (where a step's time goes) and ``--memory`` (the stub's RSS)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perf.lib import processes
from perf.lib.generation_load import Stream, System, Workload, load_workload
from perf.lib.generation_systems import (
    MODEL,
    TritonSystem,
    resolve_precision,
    served_engine_settings,
    served_gauges,
    start_engine,
    start_triton,
)
from perf.lib.paths import ROOT
from perf.lib.report import display_path, write_csv
from perf.lib.stats import percentile_of

PREFILL_SYSTEMS = ("engine", "grpc", "llama", "openvino")


async def measure_prefill(systems: dict[str, System], workload: Workload, count: int, say) -> list[dict[str, Any]]:
    """Prompt tokens/s: the long prompts (400+ tokens) one request at a time, one new token each,
    the systems taking turns per prompt. Each request starts with a line no other request has, so
    no prefix cache (the engine's blocks, llama.cpp's slot cache) holds any of it: TTFT is the
    whole prompt's prefill plus one decode step and the transport."""
    rows: list[dict[str, Any]] = []
    chosen = [k for k in PREFILL_SYSTEMS if k in systems]
    for i, (prompt, tokens) in enumerate(workload.long_prompts[:count]):
        for key in chosen[i % len(chosen) :] + chosen[: i % len(chosen)]:
            await systems[key].prepare(1)
            record = Stream(key, 1, i, time.perf_counter())
            nonce = f"request {key}-{i}-{time.monotonic_ns()}\n"
            try:
                await asyncio.wait_for(systems[key].stream(nonce + prompt, 1, record), 300)
            except Exception as exc:  # noqa: BLE001 - recorded, the others go on
                say(f"    prefill {key} prompt {i}: {type(exc).__name__}: {exc}")
                continue
            if record.first is not None:
                ttft = record.first - record.sent
                rows.append(
                    {
                        "system": key,
                        "prompt": i,
                        "prompt_tokens": tokens,
                        "ttft_ms": round(1000 * ttft, 1),
                        "prompt_tokens_per_s": round(tokens / ttft, 1),
                    }
                )
    return rows


def prefill_summary(rows: Sequence[dict]) -> list[dict[str, Any]]:
    """Per system: its prompts, P50 prompt tokens/s and P50 TTFT."""
    out = []
    for key in PREFILL_SYSTEMS:
        if mine := [r for r in rows if r["system"] == key]:
            tps, ttft = (percentile_of([r[k] for r in mine], 50) for k in ("prompt_tokens_per_s", "ttft_ms"))
            out.append({"system": key, "prompts": len(mine), "prompt_tokens_per_s_p50": tps, "ttft_p50_ms": ttft})
    return out


OV_MATRIX = {"FullyConnected", "MatMul", "Gemm"}  # OpenVINO CPU node types: the weights' products
OV_ATTENTION = {"PagedAttentionExtension", "PagedAttention"}


def profile_step(
    engine, prompts: Sequence[str], batch: int, steps: int, steady: bool = False, warm_steps: int = 150
) -> dict[str, Any]:
    """Where a step of ``batch`` streams spends its time (torch.profiler on ``steps`` steps).

    Decode-only (``steady`` False): every prompt prefilled, then ``steps`` decode steps. ``steady``: a
    closed loop of ``batch`` streams of 128 tokens over every prompt (each with a line of its own),
    a finished stream replaced at once, after ``warm_steps`` steps: decodes of mixed context lengths
    beside new prompts' chunks, as a serving step. ``matrix``: the matrix products; ``attention``:
    the paged attention's gathers and kernel; ``other ops``: every other op; ``outside ops``: the
    rest of the step's wall time (the engine's Python and op dispatch). Self times, main thread.
    The OpenVINO runtime's nodes come from its own counters (shared out over the runner's time when
    they add up to more); llama.cpp leaves the three columns empty (its forward pass is ``runner_ms``)."""
    from torch.profiler import ProfilerActivity, profile

    from python_backends.generation.model_runner import ModelRunner
    from python_backends.generation.sampling import SamplingParams

    params = SamplingParams(max_tokens=128 if steady else steps + 40, temperature=0.0, ignore_eos=True)
    ids = itertools.count()
    live: list[str] = []
    runner = engine.runner
    node_split = hasattr(runner, "node_times")  # the OpenVINO runtime: its own per-node counters
    torch_split = isinstance(runner, ModelRunner)
    if node_split:
        runner.enable_node_profiling()  # before the warm-up: the recompiled model's first inferences are slow

    def add() -> None:
        n = next(ids)
        rid = f"profile-{n}"
        label = f"request profile-{n}-{time.monotonic_ns()}\n" if steady else ""
        engine.add_request(rid, label + prompts[n % len(prompts)], params)
        live.append(rid)

    def refill() -> None:
        live[:] = [r for r in live if (seq := engine.scheduler.get(r)) is not None and not seq.is_finished]
        while steady and len(live) < batch:
            add()

    for _ in range(batch):
        add()
    if steady:
        for _ in range(warm_steps):
            engine.step()
            refill()
    else:
        while any(not seq.output_tokens for r in live if (seq := engine.scheduler.get(r)) is not None):
            engine.step()  # every prompt prefilled: what follows is decode steps only
        for _ in range(3):
            engine.step()
    runner_s = 0.0
    execute = runner.execute
    nodes: dict[str, tuple[float, int]] = {}

    def timed(plan):
        nonlocal runner_s
        t = time.perf_counter()
        try:
            return execute(plan)
        finally:
            runner_s += time.perf_counter() - t
            if node_split:
                for kind, (s, n) in runner.node_times().items():
                    total, count = nodes.get(kind, (0.0, 0))
                    nodes[kind] = (total + s, count + n)

    engine.runner.execute = timed
    wall = 0.0
    contexts: list[int] = []
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                contexts += [seq.num_tokens for r in live if (seq := engine.scheduler.get(r)) is not None]
                started = time.perf_counter()
                engine.step()
                wall += time.perf_counter() - started
                refill()  # new requests' tokenization is the client's side, not the step's
    finally:
        engine.runner.execute = execute
        for r in live:
            engine.abort(r)
    from python_backends.generation.linear import PRODUCT_OPS

    matrix = {*PRODUCT_OPS, "aten::bmm"}
    attention = {
        "aten::index_select",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_softmax",
        "aten::_safe_softmax",
        "aten::scaled_dot_product_attention",
    }
    groups = {"matrix": 0.0, "attention": 0.0, "other ops": 0.0}
    top = []
    for e in prof.key_averages():
        us = e.self_cpu_time_total
        groups["matrix" if e.key in matrix else "attention" if e.key in attention else "other ops"] += us / 1e6
        top.append((us, e.key, e.count))
    # OpenVINO's counters can add up to more than the inference's wall time (a node's time on both
    # threads): then they only share out the runner's time.
    scale = min(1.0, runner_s / max(sum(s for s, _ in nodes.values()), 1e-9))
    for kind, (s, n) in nodes.items():  # the OpenVINO runtime's nodes, all steps summed
        groups["matrix" if kind in OV_MATRIX else "attention" if kind in OV_ATTENTION else "other ops"] += s * scale
        top.append((s * 1e6, f"ov::{kind}", n))
    in_ops = sum(groups.values())
    per = 1000.0 / steps
    out = {
        "batch": batch,
        "mode": "steady" if steady else "decode",
        "steps": steps,
        "mean_context": round(sum(contexts) / max(len(contexts), 1)),
        "max_context": max(contexts, default=0),
        "step_ms": round(wall * per, 2),
        "runner_ms": round(runner_s * per, 2),
        "engine_outside_runner_ms": round((wall - runner_s) * per, 2),
    }
    split = torch_split or node_split
    for k, v in groups.items():
        out[f"{k.replace(' ', '_')}_ms"] = round(v * per, 2) if split else ""
    if not split:  # the runtime's own ops are not seen: whatever ran outside it is what is known
        in_ops = runner_s
    out["outside_ops_ms"] = round((wall - in_ops) * per, 2)
    # Op calls per step (nested ones included): what the Python and dispatch cost scales with, and not noisy.
    out["ops_per_step"] = sum(n for _, _, n in top) // steps
    out["top_ops"] = "; ".join(
        f"{k} {us / 1000 * per / 1000:.2f} ms ({n // steps}/step)" for us, k, n in sorted(top, reverse=True)[:8]
    )
    return out


def run_profile(args: argparse.Namespace, out_dir: Path) -> int:
    engine = start_engine(served_engine_settings(ROOT / "model_repository", args.config_name))
    workload = load_workload(args.data, engine.tokenizer, quick=False)
    short = [p for p in workload.prompts if len(p) < 1200]  # decode steps: the prompts' lengths hardly matter
    batch = max(args.concurrency)
    rows = []
    runs = [(b, False) for b in sorted({1, batch})] + [(b, True) for b in sorted({batch} if args.quick else {16, batch})]
    for b, steady in runs:
        steps = (5 if steady else 8) if args.quick else (30 if steady else 20)
        warm = 20 if args.quick else 150
        rows.append(profile_step(engine, workload.prompts if steady else short, b, steps=steps, steady=steady, warm_steps=warm))
        print(json.dumps(rows[-1], indent=1), flush=True)
    write_csv(out_dir / "profile.csv", rows)
    print(f"perf.bench.generate_bench --profile: {display_path(out_dir / 'profile.csv')}", flush=True)
    return 0


async def _fill(system: System, prompts: Sequence[str], streams: int, max_tokens: int) -> int:
    """``streams`` requests at once over ``prompts``; the tokens they made."""
    await system.open()
    try:
        records = [Stream(system.key, streams, i, time.perf_counter()) for i in range(streams)]
        labels = [f"request memory-{i}-{time.monotonic_ns()}\n" for i in range(streams)]
        await asyncio.gather(
            *(system.stream(labels[i] + prompts[i % len(prompts)], max_tokens, r) for i, r in enumerate(records))
        )
        return sum(r.tokens for r in records)
    finally:
        await system.close()


def run_memory(args: argparse.Namespace, out_dir: Path) -> int:
    """The text_generation stub's memory per weights precision: tritonserver serving each variant that
    passed its gate in turn (or only --precision when it names one), the stub's RSS once loaded, then
    its RSS and peak (VmHWM) after ``max(concurrency)`` gRPC streams of --max-tokens over the longest
    prompts (the KV pool is preallocated zeroed, so its pages count as they are written)."""
    from transformers import AutoTokenizer

    from perf.lib.generation_systems import DEFAULT_MODEL_DIR
    from python_backends.generation.linear import PRECISIONS
    from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS
    from python_backends.generation.openvino_runtime import OV_PRECISIONS
    from server.stubs import find_stubs

    streams = max(args.concurrency)
    workload = load_workload(args.data, AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR)), quick=False)
    prompts = [p for p, _ in sorted(workload.long_prompts, key=lambda pn: -pn[1])] or workload.prompts
    rows: list[dict[str, Any]] = []
    every = (*PRECISIONS, *LLAMA_PRECISIONS, *OV_PRECISIONS)
    for precision in every if args.precision in ("auto", "cpu") else (args.precision,):
        try:
            config_name, served = resolve_precision(ROOT / "model_repository", precision)
        except ValueError as exc:  # not gated on this CPU: the reason is the row
            served, note = "", f"not served here: {exc}"
        else:  # a precision without a config of its own here failed its gate or was not built
            note = "" if served == precision else f"not served here: PRECISION={precision} serves {served}"
        if note:
            rows.append({"precision": precision, "note": note})
            print(f"{precision}: {note}", flush=True)
            continue
        settings = served_engine_settings(ROOT / "model_repository", config_name)
        with tempfile.TemporaryDirectory(prefix=f"perf-generate-memory-{precision}-") as workdir:
            deployment = start_triton(Path(workdir), config_name)
            try:
                deployment.wait_ready(timeout=300)
                stubs = [st for st in find_stubs(deployment.triton.process.pid) if st.model == MODEL]
                if len(stubs) != 1:
                    raise RuntimeError(f"expected one {MODEL} stub, found {stubs}")
                loaded = processes.sample(stubs[0].pid)
                tokens = asyncio.run(_fill(TritonSystem("grpc", deployment.grpc_url, "grpc"), prompts, streams, args.max_tokens))
                after = processes.sample(stubs[0].pid)
                blocks = served_gauges(deployment.metrics_url).get("llm_kv_cache_blocks_total", 0)
                if loaded is None or after is None:
                    raise RuntimeError(f"the {MODEL} stub (pid {stubs[0].pid}) is gone")
            finally:
                deployment.stop()
        rows.append(
            {
                "precision": served,
                "kv_pool_mib": round(settings["kv_cache_bytes"] / 2**20),
                "kv_tokens": int(blocks) * settings["block_size"],
                "rss_loaded_mib": round(loaded.rss_bytes / 2**20),
                "rss_after_mib": round(after.rss_bytes / 2**20),
                "rss_peak_mib": round(after.peak_rss_bytes / 2**20),
                "streams": streams,
                "tokens": tokens,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    write_csv(out_dir / "memory.csv", rows)
    print(f"perf.bench.generate_bench --memory: {display_path(out_dir / 'memory.csv')}", flush=True)
    return 0
