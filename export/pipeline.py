"""Export every precision variant of a model, gate each against the FP32 reference, report.

For one model: FP32 ONNX (the model's own exporter), then each derived variant the hardware
can build: built, evaluated on held-out data, checked against its gate in gates.toml, and
kept only if it passes. Variants that passed get a Triton config (configs/<variant>.pbtxt),
and configs/cpu.pbtxt / configs/gpu.pbtxt name the best per hardware (see variants.py).
Everything is recorded in <model>/variants.json, which also makes reruns cheap: a variant
whose FP32 source, builder and gate are unchanged is not rebuilt.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from export import bench, variants
from python_backends.files import sha256_file

log = logging.getLogger(__name__)

REPORTS = Path(__file__).resolve().parent / "reports"


class ModelPipeline(Protocol):
    """What a model contributes to the pipeline (see text_encoder.TextEncoderPipeline)."""

    name: str  # the model's folder in the repository
    variants: tuple[str, ...]  # derived variants, in build order (fp32 is implicit)
    builder_version: int | str  # change it when a builder changes what it writes
    bench_batches: tuple[int, ...]

    def export_fp32(self, repo: Path, force: bool) -> Any: ...

    def skip_reason(self, variant: str) -> str | None: ...

    def build(self, variant: str, version_dir: Path, dst: Path) -> None: ...

    def evaluate(self, variant: str, path: Path) -> dict[str, Any]: ...

    def bench_feed(self, batch: int) -> dict[str, np.ndarray]: ...

    def describe(self) -> dict[str, Any]: ...


# ---- shared by the models' pipelines: GPU variants and running any variant -------------


def gpu_skip_reason(variant: str) -> str | None:
    """Why a variant bound to hardware cannot be built here (the GPU ones; openvino without BF16
    products), or None (any other variant: None)."""
    if variant == "openvino":
        from python_backends.generation.linear import cpu_features

        if not {"avx512_bf16", "amx_bf16"} & cpu_features():
            return "no AVX512-BF16 or AMX: OpenVINO would compute in FP32 here, where ONNX Runtime's INT8 serves"
        return None
    if variant == "trt_plan":
        from export import tensorrt_engine

        return tensorrt_engine.unavailable_reason()
    if variant == "ort_trt_fp16":
        import onnxruntime as ort

        if not variants.has_gpu():
            return "no NVIDIA GPU: ONNX Runtime's TensorRT provider runs on GPUs only"
        if "TensorrtExecutionProvider" not in ort.get_available_providers():
            return "this ONNX Runtime has no TensorRT provider (install onnxruntime-gpu: make venv GPU=1)"
    return None


def build_trt_plan(fp32: Path, dst: Path, profiles: dict[str, tuple]) -> None:
    """A serialized FP16 TensorRT engine; ``profiles``: input -> (min, opt, max) shapes."""
    from export import tensorrt_engine

    tensorrt_engine.build_engine(fp32, dst, {k: tensorrt_engine.Profile(*v) for k, v in profiles.items()}, fp16=True)


def variant_runner(variant: str, path: Path, output: str) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """feed -> one output of a variant: TensorRT engine, ONNX Runtime TensorRT FP16, or ONNX on CPU."""
    if variant == "trt_plan":
        from export.tensorrt_engine import EngineRunner

        engine = EngineRunner(path)
        return lambda feed: engine.run(feed)[output]
    if variant == "openvino":  # what the Python-based openvino backend runs
        from python_backends.onnx_engine.openvino_session import DEFAULT_PROPERTIES, OpenVINOSession

        ov_session = OpenVINOSession(path, dict(DEFAULT_PROPERTIES))
        return lambda feed: ov_session.run([output], feed)[0]
    import onnxruntime as ort

    if variant == "ort_trt_fp16":
        providers = [("TensorrtExecutionProvider", {"trt_fp16_enable": True}), "CUDAExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), providers=providers)
    if variant == "ort_trt_fp16" and session.get_providers()[0] != "TensorrtExecutionProvider":
        # ONNX Runtime lists TensorRT even when its libraries fail to load, then runs CUDA.
        raise RuntimeError(f"TensorRT provider did not load (session runs {session.get_providers()[0]})")
    return lambda feed: session.run([output], feed)[0]


@dataclass
class VariantOutcome:
    name: str
    status: str  # passed | failed | skipped | error | ungated (measured, never served)
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, float] = field(default_factory=dict)
    file: str | None = None
    size_bytes: int | None = None
    seconds: float = 0.0
    reused: bool = False


def _progress(model: str) -> Callable[[str], None]:
    return lambda message: log.info("%s: %s", model, message)


def run(
    pipeline: ModelPipeline,
    repo: Path,
    force: bool = False,
    speed: bool = True,
    only: tuple[str, ...] | None = None,
    bench_seconds: float = 1.0,
) -> dict[str, Any]:
    """Export, gate and report one model. Returns the report dict; raises nothing for gate misses
    (they are in the report with status "failed")."""
    say = _progress(pipeline.name)
    gates = variants.load_gates().get(pipeline.name, {})
    model_dir = repo / pipeline.name
    version_dir = model_dir / "1"
    names = ["fp32", *[v for v in pipeline.variants if only is None or v in only]]
    total = len(names) + (1 if speed else 0)

    say(f"[1/{total}] fp32: export")
    pipeline.export_fp32(repo, force)
    fp32_path = version_dir / variants.VARIANTS["fp32"].filename
    fp32_sha = sha256_file(fp32_path)
    previous = variants.read_manifest(repo, pipeline.name).get("variants", {})
    outcomes: dict[str, VariantOutcome] = {}

    params: dict[str, str] = getattr(pipeline, "config_parameters", lambda: {})()
    for step, name in enumerate(names, start=1):
        variant = variants.VARIANTS[name]
        gate = gates.get(name)
        if name != "fp32":
            say(f"[{step}/{total}] {name}: {variant.description}")
        reason = None if name == "fp32" else pipeline.skip_reason(name)
        if reason:
            say(f"{name}: skipped: {reason}")
            variants.remove_variant(model_dir, variant)
            outcomes[name] = VariantOutcome(name, "skipped", reason, gate=gate or {})
            continue
        if not gate:
            # No gate, no serving: a variant is only ever served after a measured check.
            say(f"{name}: ERROR: no gate for it in {variants.GATES_FILE.name}; not built")
            variants.remove_variant(model_dir, variant)
            outcomes[name] = VariantOutcome(name, "error", f"no [{pipeline.name}.{name}] gate in {variants.GATES_FILE.name}")
            continue
        path = version_dir / variant.filename
        old = previous.get(name, {})
        unchanged = (
            not force
            and old.get("status") in ("passed", "ungated")
            and old.get("source_sha256") == fp32_sha
            and old.get("builder_version") == pipeline.builder_version
            and old.get("gate") == gate
            and path.is_file()
            and old.get("file_sha256") == sha256_file(path)
        )
        if unchanged:
            say(f"{name}: up to date, {old['status']} before ({_fmt(old.get('metrics', {}))})")
            outcomes[name] = VariantOutcome(
                name,
                old["status"],
                old.get("reason", ""),
                metrics=old["metrics"],
                gate=gate,
                file=variant.filename,
                size_bytes=path.stat().st_size,
                reused=True,
            )
            if old["status"] == "passed":
                variants.write_variant_config(model_dir, variant, params)
            continue
        started = time.perf_counter()
        # Built under a candidate name and moved into place only once its gate passed: an
        # interrupted or failed build never replaces what the configs point at.
        built_here = variant.filename != variants.VARIANTS["fp32"].filename  # not FP32's file under another runtime
        candidate = path.with_name(path.name + ".candidate") if built_here else path
        try:
            if built_here:
                pipeline.build(name, version_dir, candidate)
            say(f"{name}: evaluating against the FP32 PyTorch reference")
            metrics = pipeline.evaluate(name, candidate)
        except Exception as exc:  # noqa: BLE001 - recorded and reported; the export then fails
            log.exception("%s: %s failed", pipeline.name, name)
            if built_here:
                candidate.unlink(missing_ok=True)
            variants.remove_variant(model_dir, variant)
            outcomes[name] = VariantOutcome(
                name, "error", f"{type(exc).__name__}: {exc}", gate=gate, seconds=time.perf_counter() - started
            )
            if name == "fp32":
                break
            continue
        failures = variants.check_gate(metrics, gate)
        ungated = getattr(pipeline, "ungated_reason", lambda _: None)(name)
        outcome = VariantOutcome(
            name,
            "failed" if failures else "passed",
            "; ".join(failures),
            metrics,
            gate,
            variant.filename,
            candidate.stat().st_size if candidate.is_file() else None,
            time.perf_counter() - started,
        )
        if ungated:
            # Built and measured for the report, but its gate cannot say anything here (e.g.
            # random weights): never served, and not a failure of the export.
            say(f"{name}: measured but NOT gated and NOT served: {ungated} ({_fmt(metrics)})")
            (model_dir / "configs" / f"{name}.pbtxt").unlink(missing_ok=True)
            if built_here:
                candidate.replace(path)
            outcome.status, outcome.reason = "ungated", ungated + (f" (gate would say: {outcome.reason})" if failures else "")
        elif failures:
            say(f"{name}: GATE FAILED: {outcome.reason}; variant removed")
            if built_here:
                candidate.unlink(missing_ok=True)
            variants.remove_variant(model_dir, variant)
        else:
            if built_here:
                candidate.replace(path)
            say(f"{name}: gate passed ({_fmt(metrics)})")
            variants.write_variant_config(model_dir, variant, params)
        outcomes[name] = outcome
        if name == "fp32" and outcome.status != "passed":
            say("fp32 missed its gate: nothing is derived from it, and nothing of this model is served")
            break

    # Variants not rebuilt in this run (--variant) stay only if built from this same FP32.
    for name, old in previous.items():
        if name in outcomes or name not in variants.VARIANTS:
            continue
        if old.get("source_sha256") == fp32_sha and old.get("status") in ("passed", "ungated", "skipped"):
            outcomes[name] = VariantOutcome(
                name,
                old["status"],
                old.get("reason", ""),
                old.get("metrics", {}),
                old.get("gate", {}),
                old.get("file"),
                reused=True,
            )
        else:
            say(f"{name}: built from an older FP32 model; removed (rebuild it with --variant {name})")
            variants.remove_variant(model_dir, variants.VARIANTS[name])

    passed = [n for n, o in outcomes.items() if o.status == "passed"]
    best = variants.write_best_configs(model_dir, passed, params)
    say(f"serving choice: cpu -> {best['cpu']}, gpu -> {best['gpu']}")

    manifest = {
        "model": pipeline.name,
        "best": best,
        "variants": {
            n: {
                "status": o.status,
                "reason": o.reason,
                "metrics": o.metrics,
                "gate": o.gate,
                "file": o.file,
                "file_sha256": sha256_file(version_dir / o.file)
                if o.status in ("passed", "ungated") and o.file and (version_dir / o.file).is_file()
                else None,
                "source_sha256": fp32_sha,
                "builder_version": pipeline.builder_version,
            }
            for n, o in outcomes.items()
        },
    }
    variants.write_manifest(repo, pipeline.name, manifest)

    speeds: dict[str, bench.Speed] = {}
    if speed:
        measured = [n for n, o in outcomes.items() if o.status in ("passed", "ungated")]
        runnable = {
            n: version_dir / variants.VARIANTS[n].filename
            for n in measured
            if variants.VARIANTS[n].filename.endswith(".onnx") and n != "ort_trt_fp16"
        }
        say(f"[{total}/{total}] in-process speed on CPU, side by side: {', '.join(runnable)}")
        speeds = bench.measure_side_by_side(
            runnable, pipeline.bench_feed, pipeline.bench_batches, seconds=bench_seconds, progress=say
        )

    report = build_report(pipeline, outcomes, speeds, best)
    if speed:  # a run without timing must not overwrite a full report
        write_report(pipeline.name, report)
    return report


def _fmt(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_num(v)}" for k, v in metrics.items() if not isinstance(v, (dict, list)))


def _num(value: Any) -> str:
    """Cosines and agreements near 1 need digits; other floats do not."""
    if isinstance(value, float):
        return f"{value:.6f}" if 0.9 <= value <= 1.0 else f"{value:.4g}"
    return str(value)


def _provider(variant: str, measured_on_cpu: bool) -> str:
    served = {"fp16": "CUDA", "ort_trt_fp16": "TensorRT (ONNX Runtime)", "trt_plan": "TensorRT"}.get(variant)
    if served is None:
        return "CPU (OpenVINO)" if variant == "openvino" else "CPU (ONNX Runtime)"
    return f"{served}; measured here on CPU" if measured_on_cpu else served


def build_report(
    pipeline: ModelPipeline, outcomes: dict[str, VariantOutcome], speeds: dict[str, bench.Speed], best: dict[str, str | None]
) -> dict[str, Any]:
    fp32_speed = speeds.get("fp32")
    rows = []
    for name, o in outcomes.items():
        row = {
            "variant": name,
            "description": variants.VARIANTS[name].description,
            "status": o.status,
            "reason": o.reason,
            "file": o.file,
            "size_mb": round(o.size_bytes / 1e6, 1) if o.size_bytes else None,
            "metrics": o.metrics,
            "gate": o.gate,
            "execution_provider": _provider(name, name in speeds),
        }
        if name in speeds:
            row["speed"] = speeds[name].as_dict()
            if fp32_speed:
                row["speedup_vs_fp32_b1"] = round(fp32_speed.latency_ms_b1 / speeds[name].latency_ms_b1, 2)
                row["speedup_vs_fp32_best"] = round(speeds[name].best_throughput / fp32_speed.best_throughput, 2)
        rows.append(row)
    return {
        "model": pipeline.name,
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_threads": bench.cpu_threads(),
        },
        "source": pipeline.describe(),
        "serving_choice": best,
        "variants": rows,
    }


def to_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"### {report['model']}",
        "",
        f"Generated {report['generated']} on {report['machine']['processor']}, "
        f"{report['machine']['cpu_threads']} CPU threads. Source: {report['source'].get('summary', '')}",
        "",
    ]
    lines += [
        "| variant | status | size MB | parity vs FP32 PyTorch | gate | execution provider | latency b1 (ms) "
        "| best batch: items/s | speed-up b1 / best |",
        "| --- | --- | ---: | --- | --- | --- | ---: | --- | --- |",
    ]
    for r in report["variants"]:
        metrics = ", ".join(f"{k} {_num(v)}" for k, v in r["metrics"].items() if not isinstance(v, (dict, list)))
        gate = ", ".join(f"{k} {v}" for k, v in r["gate"].items())
        status = r["status"] + (f" ({r['reason']})" if r["reason"] else "")
        speed = r.get("speed")
        latency = speed["latency_ms_b1"] if speed else ""
        best = f"{speed['best_batch']}: {speed['best_throughput_items_per_s']}" if speed else ""
        ratio = f"{r['speedup_vs_fp32_b1']}x / {r['speedup_vs_fp32_best']}x" if "speedup_vs_fp32_b1" in r else ""
        lines.append(
            f"| {r['variant']} | {status} | {r['size_mb'] or ''} | {metrics} | {gate} | {r['execution_provider'] or ''} "
            f"| {latency} | {best} | {ratio} |"
        )
    choice = report["serving_choice"]
    lines += ["", f"Served with PRECISION=auto: CPU -> `{choice['cpu']}`, GPU -> `{choice['gpu']}`.", ""]
    return "\n".join(lines)


def write_report(model: str, report: dict[str, Any]) -> tuple[Path, Path]:
    REPORTS.mkdir(exist_ok=True)
    json_path, md_path = REPORTS / f"{model}.json", REPORTS / f"{model}.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(to_markdown(report))
    log.info("%s: report written to %s and %s", model, md_path, json_path)
    return json_path, md_path
