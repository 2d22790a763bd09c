"""perf.bench.generate_bench's other measurements: prefill (long prompts one at a time), prefix
caching on and off, genai-perf beside it, ``--profile`` (a step's time split) and ``--memory``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perf.bench.generate_report import pa_display
from perf.lib import processes
from perf.lib.generation_load import Stream, System, Workload, load_workload
from perf.lib.generation_systems import MODEL, GrpcSystem, resolve_precision, served_engine_settings, start_engine, start_triton
from perf.lib.harness import write_csv
from perf.lib.paths import ROOT
from perf.lib.stats import percentile

if TYPE_CHECKING:  # imported where they are used: the in-process systems need neither
    pass


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
    for key in chosen:
        mine = [r for r in rows if r["system"] == key]
        if mine:
            say(
                f"  prefill {key:<6} median {statistics.median(r['prompt_tokens_per_s'] for r in mine):.0f} prompt "
                f"tokens/s over {len(mine)} prompts of {min(r['prompt_tokens'] for r in mine)}-"
                f"{max(r['prompt_tokens'] for r in mine)} tokens"
            )
    return rows


def prefill_summary(rows: Sequence[dict]) -> list[dict[str, Any]]:
    out = []
    for key in PREFILL_SYSTEMS:
        mine = [r for r in rows if r["system"] == key]
        if mine:
            out.append(
                {
                    "system": key,
                    "prompts": len(mine),
                    "prompt_tokens_per_s_p50": round(statistics.median(r["prompt_tokens_per_s"] for r in mine), 1),
                    "ttft_p50_ms": round(statistics.median(r["ttft_ms"] for r in mine), 1),
                }
            )
    return out


def measure_prefix(engine, workload: Workload, max_tokens: int, say) -> list[dict[str, Any]]:
    """TTFT of the shared-system-prompt requests on two engines (prefix caching on / off),
    the same weights, one request at a time, alternating."""
    from python_backends.generation.engine import LLMEngine
    from python_backends.generation.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engines = {}
    for on in (True, False):
        # A small pool: one request at a time plus the cached prefix (zeroing the served 1 GiB twice costs seconds).
        cfg = dataclasses.replace(
            engine.config,
            enable_prefix_caching=on,
            num_blocks=None,
            kv_cache_bytes=min(engine.config.kv_cache_bytes, 128 * 2**20),
        )
        engines[on] = LLMEngine(cfg, weights=engine.weights, tokenizer=engine.tokenizer)
        # A first request that shares nothing with the measured ones: the pool's pages and the
        # runner's workspaces are touched here, not in the first measured request.
        engines[on].generate(["Hello! Write one word."], params)
    rows = []
    for i, prompt in enumerate(workload.prefix_prompts):
        for on in (True, False) if i % 2 == 0 else (False, True):
            e = engines[on]
            before = e.stats()
            rid = f"prefix-{on}-{i}"
            sent = time.perf_counter()
            e.add_request(rid, prompt, params)
            first = None
            while e.has_unfinished():
                for out in e.step():
                    if first is None and out.token_ids:
                        first = time.perf_counter()
            after = e.stats()
            computed = after.get("prompt_tokens_computed", 0) - before.get("prompt_tokens_computed", 0)
            rows.append(
                {
                    "request": i,
                    "prefix_caching": "on" if on else "off",
                    "prompt_tokens": len(e.tokenizer.encode(prompt, add_special_tokens=False)),
                    "prompt_tokens_computed": computed,
                    "ttft_ms": round(1000 * (first - sent), 1) if first else None,
                }
            )
    say(f"    prefix: {len(rows)} requests, shared prefix {workload.prefix_tokens} tokens")
    return rows


def prefix_summary(rows: Sequence[dict]) -> dict[str, Any]:
    """Medians over the second request onward (the first one fills the cache)."""

    def med(on: str) -> float | None:
        values = sorted(r["ttft_ms"] for r in rows if r["prefix_caching"] == on and r["request"] > 0 and r["ttft_ms"])
        return percentile(values, 50) if values else None

    on, off = med("on"), med("off")
    first = next((r["ttft_ms"] for r in rows if r["prefix_caching"] == "on" and r["request"] == 0), None)
    computed_on = [r["prompt_tokens_computed"] for r in rows if r["prefix_caching"] == "on" and r["request"] > 0]
    prompt = [r["prompt_tokens"] for r in rows if r["prefix_caching"] == "on" and r["request"] > 0]
    return {
        "ttft_cached_p50_ms": on,
        "ttft_uncached_p50_ms": off,
        "ttft_first_on_ms": first,
        "mean_prompt_tokens": round(sum(prompt) / len(prompt), 1) if prompt else None,
        "mean_prompt_tokens_computed_cached": round(sum(computed_on) / len(computed_on), 1) if computed_on else None,
        "ratio": round(on / off, 3) if on and off else None,
    }


def run_genai_perf(
    exe: Path,
    grpc_url: str,
    tokenizer_dir: Path,
    out_dir: Path,
    prompts: Sequence[str],
    concurrency: int,
    max_tokens: int,
    requests: int,
    timeout: float,
) -> dict[str, Any]:
    """NVIDIA's genai-perf (its own venv: ``exe``) against the served model over a gRPC stream.

    The benchmark's prompts (an --input-file; its synthetic prompts can come out empty,
    which the served model refuses and perf_analyzer then stops). The sampling parameters go as a
    typed JSON input (--extra-inputs) that says exactly what runs (genai-perf's own
    --output-tokens-mean writes ``{"max_tokens": "128"}``, numbers as strings, which the
    served model converts as the vLLM backend does).
    No warm-up requests: perf_analyzer 2.50 with --warmup-request-count 1 at concurrency 4
    never finished against it (without, the same run took 3 s)."""
    import subprocess

    from perf.lib import perf_analyzer as pa

    _, env = pa.check()  # libcudart for perf_analyzer
    env = {**env, "PATH": os.pathsep.join((str(Path(exe).parent), env.get("PATH", ""))), "HF_HUB_OFFLINE": "1"}
    artifacts = out_dir / "genai-perf"
    inputs = out_dir / "genai-perf-input"
    inputs.mkdir(exist_ok=True)
    (inputs / "prompts.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    sampling = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    cmd = [
        str(exe),
        "profile",
        "-m",
        MODEL,
        "--backend",
        "vllm",
        "--endpoint-type",
        "kserve",
        "--streaming",
        "-u",
        grpc_url,
        "--tokenizer",
        str(tokenizer_dir),
        "--input-file",
        str(inputs),
        "--extra-inputs",
        json.dumps({"sampling_parameters": sampling}),
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(requests),
        "--warmup-request-count",
        "0",
        "--num-dataset-entries",
        str(max(requests, 8)),
        "--artifact-dir",
        str(artifacts),
    ]
    row: dict[str, Any] = {"concurrency": concurrency, "requests": requests, "command": " ".join(cmd[1:])}
    log_path = out_dir / "genai-perf.log"
    with log_path.open("w") as log_file:
        # Its own session: on a timeout, perf_analyzer (genai-perf's child) goes too.
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=out_dir, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    output = log_path.read_text(errors="replace")
    found = sorted(artifacts.rglob("*_genai_perf.json"))
    if code != 0 or not found:
        tail = [line.strip() for line in output.splitlines() if line.strip()][-3:]
        why = f"no result after {timeout:.0f} s" if code is None else f"exit {code}"
        return {**row, "error": f"{why}: {' | '.join(tail)}"[:300]}
    stats = json.loads(found[-1].read_text())

    def get(metric, stat):
        value = (stats.get(metric) or {}).get(stat)
        return None if value is None else round(float(value), 2)

    return {
        **row,
        "error": "",
        "tokens_per_s": get("output_token_throughput", "avg"),
        "ttft_p50_ms": get("time_to_first_token", "p50"),
        "ttft_p99_ms": get("time_to_first_token", "p99"),
        "itl_p50_ms": get("inter_token_latency", "p50"),
        "itl_p99_ms": get("inter_token_latency", "p99"),
        "output_tokens_p50": get("output_sequence_length", "p50"),
    }


OV_MATRIX = {"FullyConnected", "MatMul", "Gemm"}  # OpenVINO CPU node types: the weights' products
OV_ATTENTION = {"PagedAttentionExtension", "PagedAttention"}


def profile_step(
    engine, prompts: Sequence[str], batch: int, steps: int, steady: bool = False, warm_steps: int = 150
) -> dict[str, Any]:
    """Where a step of ``batch`` streams spends its time (torch.profiler on ``steps`` steps).

    Decode-only (``steady`` False): every prompt prefilled first, then ``steps`` decode steps.
    ``steady``: the served workload in-process, a closed loop of ``batch`` streams of 128 tokens
    (``ignore_eos``) over every prompt (the long ones too), each request with a line of its own
    so the prefix cache spares nothing, a finished stream replaced at once; ``warm_steps`` steps
    first, so the window holds decodes of mixed context lengths and the prompt chunks of new
    requests, as a serving step does.

    ``matrix``: the matrix products (the weights' share); ``attention``: the paged attention's
    gathers and its attention kernel; ``other ops``: every other ATen op (norms, RoPE, SiLU,
    casts, sampling); ``outside ops``: the rest of the step's wall time, i.e. Python in the
    scheduler, block manager, runner, sampler and detokenizer plus op dispatch. Self times,
    main thread. On the OpenVINO runtime the forward pass's nodes come from OpenVINO's own
    counters (the runner is recompiled with them on): ``FullyConnected``/``MatMul`` nodes are
    ``matrix``, ``PagedAttentionExtension`` is ``attention``, the rest ``other ops``; where the
    counters add up to more than the runner's wall time they share that time out. A runtime
    without such counters (llama.cpp) leaves the three columns empty: its forward pass is
    ``runner_ms``."""
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
    settings = served_engine_settings(ROOT / "model_repository", args.config_name)
    engine, loop = start_engine(args.model_dir, settings)
    loop.shutdown()  # the profile drives the engine itself
    workload = load_workload(args.data, engine.tokenizer, quick=False)
    short = [p for p in workload.prompts if len(p) < 1200]  # decode steps: the prompts' lengths hardly matter
    batch = max(args.concurrency)
    rows = []
    runs = [(b, False) for b in sorted({1, batch})] + [(b, True) for b in sorted({batch} if args.quick else {16, batch})]
    for b, steady in runs:
        steps = (5 if steady else 8) if args.quick else (30 if steady else 20)
        row = profile_step(
            engine, workload.prompts if steady else short, b, steps=steps, steady=steady, warm_steps=20 if args.quick else 150
        )
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    write_csv(out_dir / "profile.csv", rows)
    print(f"perf.bench.generate_bench --profile: {pa_display(out_dir / 'profile.csv')}", flush=True)
    return 0


async def _fill(system: System, prompts: Sequence[str], streams: int, max_tokens: int) -> int:
    records = [Stream(system.key, streams, i, time.perf_counter()) for i in range(streams)]
    await asyncio.gather(
        *(
            system.stream(f"request memory-{i}-{time.monotonic_ns()}\n" + prompts[i % len(prompts)], max_tokens, r)
            for i, r in enumerate(records)
        )
    )
    return sum(r.tokens for r in records)


async def _drive(system: System, prompts: Sequence[str], streams: int, max_tokens: int) -> int:
    await system.open()
    try:
        return await _fill(system, prompts, streams, max_tokens)
    finally:
        await system.close()


def run_memory(args: argparse.Namespace, out_dir: Path) -> int:
    """The text_generation stub's memory per weights precision: tritonserver serving each variant that
    passed its gate in turn, the stub's RSS once loaded, then its RSS and peak (VmHWM) after
    ``max(concurrency)`` gRPC streams of --max-tokens over the longest prompts (the KV pool is
    preallocated zeroed, so its pages count as they are written)."""
    from python_backends.generation.linear import PRECISIONS, kv_cache_dtype
    from python_backends.generation.llama_cpp_runtime import LLAMA_PRECISIONS, kv_bytes_per_block
    from python_backends.generation.model_runner import DTYPES, LlamaConfig
    from python_backends.generation.openvino_runtime import OV_PRECISIONS
    from python_backends.generation.paged_attention import bytes_per_block
    from server.stubs import find_stubs

    streams = max(args.concurrency)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    workload = load_workload(args.data, tokenizer, quick=False)
    prompts = [p for p, _ in sorted(workload.long_prompts, key=lambda pn: -pn[1])] or workload.prompts
    mcfg = LlamaConfig.from_folder(args.model_dir)
    rows = []
    every = (*PRECISIONS, *LLAMA_PRECISIONS, *OV_PRECISIONS)
    for precision in every if args.precision in ("auto", "cpu") else (args.precision,):
        try:
            config_name, served = resolve_precision(ROOT / "model_repository", precision)
        except ValueError as exc:  # not gated on this CPU: the reason is the row
            rows.append({"precision": precision, "note": f"not served here: {exc}"})
            print(f"{precision}: not served here: {exc}", flush=True)
            continue
        if served != precision:  # no config of its own here: it failed its gate or was not built
            rows.append({"precision": precision, "note": f"not served here: PRECISION={precision} serves {served}"})
            print(f"{precision}: not served here (no configs/{precision}.pbtxt)", flush=True)
            continue
        settings = served_engine_settings(ROOT / "model_repository", config_name)
        if served in LLAMA_PRECISIONS:  # llama.cpp's cache cells
            kv_dtype = settings.get("kv_cache_type", "f16")
            per_block = kv_bytes_per_block(mcfg, settings["block_size"], kv_dtype)
        elif served in OV_PRECISIONS:  # OpenVINO's paged cache, 2-byte elements
            kv_dtype = "bf16/f16"
            per_block = kv_bytes_per_block(mcfg, settings["block_size"], "f16")
        else:
            torch_dtype = kv_cache_dtype(served, DTYPES[settings.get("dtype", "float32")])
            per_block = bytes_per_block(mcfg.num_layers, settings["block_size"], mcfg.num_kv_heads, mcfg.head_dim, torch_dtype)
            kv_dtype = str(torch_dtype).removeprefix("torch.")
        blocks = settings["kv_cache_bytes"] // per_block
        workdir = Path(tempfile.mkdtemp(prefix=f"perf-generate-memory-{precision}-"))
        triton = start_triton(args.model_dir, workdir, config_name)
        try:
            triton.wait_ready(timeout=300)
            stubs = [st for st in find_stubs(triton.process.pid) if st.model == MODEL]
            if len(stubs) != 1:
                raise RuntimeError(f"expected one {MODEL} stub, found {stubs}")
            pid = stubs[0].pid
            loaded = processes.sample(pid)
            tokens = asyncio.run(_drive(GrpcSystem(triton.grpc_url), prompts, streams, args.max_tokens))
            after = processes.sample(pid)
            if loaded is None or after is None:
                raise RuntimeError(f"the {MODEL} stub (pid {pid}) is gone")
            row = {
                "precision": served,
                "kv_dtype": kv_dtype,
                "kv_pool_mib": round(blocks * per_block / 2**20),
                "kv_tokens": blocks * settings["block_size"],
                "rss_loaded_mib": round(loaded.rss_bytes / 2**20),
                "rss_after_mib": round(after.rss_bytes / 2**20),
                "rss_peak_mib": round(after.peak_rss_bytes / 2**20),
                "streams": streams,
                "tokens": tokens,
            }
        finally:
            triton.stop()
            shutil.rmtree(workdir, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_csv(out_dir / "memory.csv", rows)
    print(f"perf.bench.generate_bench --memory: {pa_display(out_dir / 'memory.csv')}", flush=True)
    return 0
