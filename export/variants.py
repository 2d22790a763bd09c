"""Precision variants of a served model, their gates, their Triton configs, and which one to serve.

Every variant of a model lives in the same version folder under its own file name. Which one
Triton serves is chosen by ONE setting: Triton's ``--model-config-name=<variant>`` makes each
model use ``<model>/configs/<variant>.pbtxt`` when it exists and its ``config.pbtxt`` (FP32)
otherwise. Those variant configs are generated here from ``config.pbtxt`` (the one source of
truth) for the variants that passed their gate, so a variant that failed can never be served.

``make serve PRECISION=auto`` (the default) picks per hardware: ``cpu`` or ``gpu``, configs
the export writes as copies of each model's best variant that passed its gate there (INT8
on a CPU; the TensorRT engine, else FP16, on a GPU). In NVIDIA's container the same setting
is docker-compose's ``PRECISION`` variable.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from python_backends.files import sha256_file

log = logging.getLogger(__name__)

GATES_FILE = Path(__file__).resolve().parent / "gates.toml"
MANIFEST = "variants.json"


@dataclass(frozen=True)
class Variant:
    name: str
    filename: str  # in the version folder
    device: str  # "cpu", "gpu" or "any": where it is meant to be served
    description: str


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("fp32", "model.onnx", "any", "ONNX export of the PyTorch graph, FP32"),
        Variant("cpu_opt", "model.opt.onnx", "cpu", "ONNX Runtime graph fusions for CPU, FP32"),
        Variant("int8", "model.int8.onnx", "cpu", "INT8 quantized for CPU"),
        Variant(
            "openvino", "model.onnx", "cpu", "the FP32 ONNX file on OpenVINO's CPU plugin, BF16 products (AVX512-BF16 / AMX CPUs)"
        ),
        Variant("fp16", "model.fp16.onnx", "gpu", "FP16 ONNX (FP32 inputs/outputs) for GPUs"),
        Variant("ort_trt_fp16", "model.onnx", "gpu", "FP32 ONNX run by ONNX Runtime's TensorRT provider in FP16"),
        Variant("trt_plan", "model.plan", "gpu", "serialized TensorRT engine, FP16 (platform tensorrt_plan)"),
    )
}

# Precision variants of the generation model (export/generation_gate.py): the same weights
# multiplied in another precision, chosen by configs/<name>.pbtxt like the variants above. The
# llama_* ones run on llama.cpp (python_backends/generation/llama_cpp_runtime.LLAMA_PRECISIONS,
# not imported here: that module loads torch).
LLAMA_VARIANTS = ("llama_q4_0", "llama_q4_1", "llama_q8_0", "llama_bf16", "llama_f16")
# The ov_* ones run on OpenVINO (python_backends/generation/openvino_runtime.OV_PRECISIONS).
OV_VARIANTS = ("ov_f16", "ov_int4_f16")
GENERATION_VARIANTS = ("fp16_fp32", "bf16", "int4_bf16", *LLAMA_VARIANTS, *OV_VARIANTS)
# What PRECISION may name: auto, a hardware's best, or one variant (the launchers' --precision).
PRECISION_CHOICES = ("auto", "cpu", "gpu", *VARIANTS, *GENERATION_VARIANTS)

# What PRECISION=auto serves, best first, per hardware.
AUTO_ORDER = {"cpu": ("int8", "cpu_opt", "fp32"), "gpu": ("trt_plan", "fp16", "ort_trt_fp16", "fp32")}
# Per model where served figures say otherwise. The openvino variant is built only on CPUs with BF16
# products (export/pipeline.py); there it serves EfficientNet-Lite0 as fast as INT8 one image at a
# time and 1.23x at 8, closer to FP32, and text_encoder 0.92x INT8 on short texts, so only the
# classifier prefers it (docs/image-pipeline.md, docs/performance.md#encoders-on-openvino).
AUTO_ORDER_BY_MODEL = {"image_classifier": {"cpu": ("openvino", *AUTO_ORDER["cpu"])}}

# The TensorRT of the server that loads trt_plan variants: NVIDIA's 24.10 container (the
# tritonserver 2.51 release this project runs) ships TensorRT 10.5. A serialized engine
# deserializes only under the TensorRT release that built it (major.minor.patch), so a plan
# built by any other one is never chosen nor served; requirements-gpu.txt pins the same.
SERVING_TENSORRT = "10.5.0"


def same_tensorrt(built: str | None, serving: str = SERVING_TENSORRT) -> bool:
    """Whether a plan built by TensorRT ``built`` deserializes under ``serving``."""
    return built is not None and built.split(".")[:3] == serving.split(".")[:3]


def installed_tensorrt() -> str | None:
    """The version of the tensorrt Python package here (what builds plans), or None."""
    try:
        import tensorrt
    except ImportError:
        return None
    return str(tensorrt.__version__)


def plan_tensorrt(model_dir: Path, version: str = "1") -> str | None:
    """The TensorRT that built ``model_dir``'s plan: the manifest's record when the file is the
    one it describes, else the installed TensorRT (a plan newer than the manifest was just built
    by it in this export run), else None (unknown)."""
    plan = model_dir / version / VARIANTS["trt_plan"].filename
    if not plan.is_file():
        return None
    entry = read_manifest(model_dir.parent, model_dir.name).get("variants", {}).get("trt_plan", {})
    if entry.get("tensorrt_version") and entry.get("file_sha256") == sha256_file(plan):
        return entry["tensorrt_version"]
    return installed_tensorrt()


def tensorrt_mismatch(model: str, built: str | None, serving: str = SERVING_TENSORRT) -> str | None:
    """Why a plan built by TensorRT ``built`` cannot be served, or None when it can."""
    if same_tensorrt(built, serving):
        return None
    if built is None:
        return (
            f"{model}: its trt_plan records no TensorRT version; the serving TensorRT is {serving}: "
            f"rebuild it with TensorRT {serving} (`make export` after `make venv GPU=1`)"
        )
    return (
        f"{model}: its trt_plan was built by TensorRT {built}, but the serving TensorRT is {serving} "
        f"(NVIDIA's 24.10 container): the engine would not deserialize; rebuild it with TensorRT {serving} "
        f"(requirements-gpu.txt) or serve another variant"
    )


def load_gates(path: Path = GATES_FILE) -> dict[str, dict[str, dict[str, float]]]:
    # Python 3.11's: the export's, never NVIDIA's container (3.10), whose launcher imports this module
    import tomllib

    with path.open("rb") as f:
        return tomllib.load(f)


def check_gate(metrics: dict[str, Any], gate: dict[str, float]) -> list[str]:
    """The gate's failures as readable lines (empty list = passed)."""
    failures = []
    for key, limit in gate.items():
        if key.startswith("min_"):
            metric = key[len("min_") :]
            value = metrics.get(metric)
            if value is None or not value >= limit:
                failures.append(f"{metric} = {_short(value)} < {limit}")
        elif key.startswith("max_"):
            metric = key[len("max_") :]
            value = metrics.get(metric)
            if value is None or not value <= limit:
                failures.append(f"{metric} = {_short(value)} > {limit}")
        else:
            raise ValueError(f"gate key {key!r} must start with min_ or max_ ({GATES_FILE.name})")
    return failures


def _short(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def has_gpu() -> bool:
    """An NVIDIA GPU this machine can use (nvidia-smi lists one)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


# ---- manifests -------------------------------------------------------------------------


def manifest_path(repo: Path, model: str) -> Path:
    return repo / model / MANIFEST


def read_manifest(repo: Path, model: str) -> dict[str, Any]:
    path = manifest_path(repo, model)
    if not path.is_file():
        return {"model": model, "variants": {}}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {"model": model, "variants": {}}


def write_manifest(repo: Path, model: str, manifest: dict[str, Any]) -> None:
    """Write variants.json; a trt_plan entry gets the TensorRT version that built its file."""
    plan = manifest.get("variants", {}).get("trt_plan")
    if plan and plan.get("file_sha256") and "tensorrt_version" not in plan:
        plan["tensorrt_version"] = plan_tensorrt(repo / model)
        reason = tensorrt_mismatch(model, plan["tensorrt_version"])
        if reason:
            plan["not_served"] = reason
    path = manifest_path(repo, model)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def passed_variants(repo: Path, model: str) -> list[str]:
    variants = read_manifest(repo, model).get("variants", {})
    return [name for name, entry in variants.items() if entry.get("status") == "passed"]


def resolve_precision(
    repo: Path, models: list[str], precision: str, gpu: bool | None = None, loadable: tuple[str, ...] | None = None
) -> tuple[str | None, dict[str, str]]:
    """Map PRECISION to Triton's --model-config-name and the variant each model then serves.

    ``auto`` means ``cpu`` or ``gpu`` by the hardware: configs/cpu.pbtxt and configs/gpu.pbtxt
    are written by the export as copies of each model's best variant that passed its gate
    there, so every model serves its own best. A named variant is served by the models that
    have it; the others serve config.pbtxt (FP32). ``loadable``: the variants this server
    can load (the local server has no TensorRT backend: no trt_plan); when the hardware's
    best is not among them, the best loadable variant's own config is used instead.
    Returns (config name or None, {model: variant}).
    """
    if precision == "auto":
        hardware = "gpu" if (has_gpu() if gpu is None else gpu) else "cpu"
        precision = hardware
        if loadable is not None:
            # The generation variants are the python backend's own: every server loads them.
            loadable = (*loadable, *GENERATION_VARIANTS)
            bests = {read_manifest(repo, m).get("best", {}).get(hardware) for m in models}
            if any(b is not None and b not in loadable for b in bests):
                precision = next((v for v in AUTO_ORDER[hardware] if v in loadable), "fp32")
    if precision not in VARIANTS and precision not in AUTO_ORDER and precision not in GENERATION_VARIANTS:
        raise ValueError(
            f"PRECISION must be auto, cpu, gpu or one of {', '.join((*VARIANTS, *GENERATION_VARIANTS))}; got {precision!r}"
        )
    served = {}
    for m in models:
        manifest = read_manifest(repo, m)
        config = repo / m / "configs" / f"{precision}.pbtxt"
        if precision in AUTO_ORDER:
            served[m] = (manifest.get("best", {}).get(precision) or "fp32") if config.is_file() else "fp32"
        else:
            served[m] = precision if config.is_file() else "fp32"
        if served[m] == "trt_plan":
            # Refused here rather than by the server: a plan of another TensorRT fails to
            # deserialize at load, and a container restarted on failure then loops.
            reason = tensorrt_mismatch(m, manifest.get("variants", {}).get("trt_plan", {}).get("tensorrt_version"))
            if reason:
                raise ValueError(reason)
    return precision, served


def best_variant(passed: list[str], hardware: str, model: str = "") -> str | None:
    order = AUTO_ORDER_BY_MODEL.get(model, {}).get(hardware, AUTO_ORDER[hardware])
    return next((v for v in order if v in passed), None)


def write_best_configs(model_dir: Path, passed: list[str], params: dict[str, str] | None = None) -> dict[str, str | None]:
    """configs/cpu.pbtxt and configs/gpu.pbtxt: the best passed variant per hardware (none
    when not even FP32 passed)."""
    best: dict[str, str | None] = {}
    (model_dir / "configs").mkdir(exist_ok=True)
    if "trt_plan" in passed:
        reason = tensorrt_mismatch(model_dir.name, plan_tensorrt(model_dir))
        if reason:  # never chosen, and configs/trt_plan.pbtxt goes: nothing can serve it
            log.warning("%s", reason)
            passed = [v for v in passed if v != "trt_plan"]
            (model_dir / "configs" / "trt_plan.pbtxt").unlink(missing_ok=True)
    for hardware in AUTO_ORDER:
        name = best_variant(passed, hardware, model_dir.name)
        best[hardware] = name
        target = model_dir / "configs" / f"{hardware}.pbtxt"
        if name is None:
            target.unlink(missing_ok=True)
            continue
        text = variant_config((model_dir / "config.pbtxt").read_text(), VARIANTS[name], params)
        header = f"# GENERATED by `python -m export`: best variant for a {hardware.upper()} that passed its gate = {name}\n"
        target.write_text(header + text)
    return best


# ---- variant configs -------------------------------------------------------------------

_ORT_ONLY_PARAMS = re.compile(
    r'^\s*parameters\s*\{\s*key:\s*"(intra_op_thread_count|inter_op_thread_count|execution_mode|'
    r'enable_mem_arena|enable_mem_pattern|session\.[^"]*)".*\}\s*$'
)
# Sequence lengths the tokenizer pads to (python_backends.text.tokenization.DEFAULT_BUCKETS):
# the values a variable-length input dimension ([-1] in a config) takes in this repository.
SEQUENCE_BUCKETS = (16, 32, 64, 128, 256)
GPU_VARIANTS = tuple(v.name for v in VARIANTS.values() if v.device == "gpu")


@dataclass(frozen=True)
class ModelInput:
    name: str
    data_type: str
    dims: tuple[int, ...]  # without the batch dimension; -1 = a sequence length


def config_inputs(base: str) -> tuple[int, list[ModelInput], list[int]]:
    """(max_batch_size, inputs, preferred batch sizes) of a config.pbtxt text."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(base, model_config_pb2.ModelConfig())
    inputs = [ModelInput(i.name, model_config_pb2.DataType.Name(i.data_type), tuple(i.dims)) for i in config.input]
    return config.max_batch_size, inputs, list(config.dynamic_batching.preferred_batch_size)


def _shape(batch: int, dims: tuple[int, ...], length: int) -> str:
    return "x".join(str(d) for d in (batch, *(length if d == -1 else d for d in dims)))


def trt_profile_shapes(base: str) -> dict[str, str]:
    """ONNX Runtime TensorRT provider options for ONE optimization profile over every shape the
    model is sent: batch 1..max_batch_size, each variable dimension over every sequence bucket.
    Without them the provider builds an engine for the first shape it sees and rebuilds, inside
    a request, for every larger one."""
    max_batch, inputs, preferred = config_inputs(base)
    opt_batch = preferred[0] if preferred else max_batch
    median = SEQUENCE_BUCKETS[len(SEQUENCE_BUCKETS) // 2]
    shapes = {"min": (1, SEQUENCE_BUCKETS[0]), "opt": (opt_batch, median), "max": (max_batch, SEQUENCE_BUCKETS[-1])}
    return {
        f"trt_profile_{kind}_shapes": ",".join(f"{i.name}:{_shape(b, i.dims, n)}" for i in inputs)
        for kind, (b, n) in shapes.items()
    }


def gpu_warmup(base: str) -> str:
    """``model_warmup`` entries for a GPU variant: every sequence bucket (or the one fixed
    shape) at batch 1 and at max_batch_size, so engines, kernels and memory pools are ready
    before the first request (zero data: only shapes matter here)."""
    max_batch, inputs, _ = config_inputs(base)
    lengths = SEQUENCE_BUCKETS if any(-1 in i.dims for i in inputs) else (None,)
    entries = []
    for length in lengths:
        for batch in sorted({1, max_batch}):
            feeds = "".join(
                f'    inputs {{ key: "{i.name}" value: {{ data_type: {i.data_type} '
                f"dims: [ {', '.join(str(length if d == -1 else d) for d in i.dims)} ] zero_data: true }} }}\n"
                for i in inputs
            )
            label = f"gpu_{length}_batch_{batch}" if length else f"gpu_batch_{batch}"
            entries.append(f'  {{\n    name: "{label}"\n    batch_size: {batch}\n    count: 1\n{feeds}  }}')
    return (
        "# GENERATED: warm every shape on the GPU before serving (export/variants.py gpu_warmup)\n"
        "model_warmup [\n" + ",\n".join(entries) + "\n]\n"
    )


def _trt_accelerator(base: str) -> str:
    profile = "".join(f'        parameters {{ key: "{k}" value: "{v}" }}\n' for k, v in trt_profile_shapes(base).items())
    return f"""optimization {{
  execution_accelerators {{
    # ONNX Runtime's TensorRT provider in FP16; CUDA runs what TensorRT can't.
    gpu_execution_accelerator: [
      {{
        name: "tensorrt"
        parameters {{ key: "precision_mode" value: "FP16" }}
        parameters {{ key: "max_workspace_size_bytes" value: "1073741824" }}
        parameters {{ key: "trt_engine_cache_enable" value: "1" }}
        # relative: under the server's working directory (a volume in docker-compose.yml)
        parameters {{ key: "trt_engine_cache_path" value: "trt_cache" }}
        # One profile over batch 1..max_batch_size and every sequence bucket: one engine,
        # built at load (warmup) instead of inside a request
{profile}      }}
    ]
  }}
}}
"""


# Parameters of the Python-based backend's ragged path (python_backends.onnx_engine.batching).
_RAGGED_PARAMS = re.compile(
    r'^\s*parameters\s*\{\s*key:\s*"(max_batch_tokens|max_batch_rows|max_row_padding|ragged_length_input)".*\}\s*$'
)


def drop_ragged(body: str) -> str:
    """A config text without ``allow_ragged_batch`` and the ragged path's parameters (with the
    comment lines right above them). NVIDIA's native ONNX Runtime and TensorRT backends would
    concatenate ragged inputs of a model that does not take them flat into one tensor, so GPU
    variants batch requests of equal shape only: the tokenizer's sequence buckets."""
    if not re.search(r"allow_ragged_batch:\s*true", body):
        return body
    lines = re.sub(r"\s*allow_ragged_batch:\s*true", "", body).splitlines()
    out: list[str] = []
    for line in lines:
        if _RAGGED_PARAMS.match(line):
            while out and out[-1].lstrip().startswith("#"):
                out.pop()
            continue
        out.append(line)
    note = (
        "# GENERATED: allow_ragged_batch dropped: the native GPU backends would concatenate ragged\n"
        "# inputs flat; requests batch by equal shape (the tokenizer pads to sequence buckets).\n"
    )
    text = "\n".join(out) + "\n"
    return re.sub(r"^input \[", note + "input [", text, count=1, flags=re.MULTILINE)


def _parameter_lines(params: dict[str, str] | None) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in (params or {}).items())


def variant_config(base: str, variant: Variant, params: dict[str, str] | None = None) -> str:
    """The config.pbtxt text for a variant, derived from the FP32 config.pbtxt text.

    ``params`` become extra ``parameters`` entries (e.g. where the weights came from, so the
    served config says it).
    """
    if re.search(r"^\s*default_model_filename\s*:", base, re.M):
        raise ValueError("config.pbtxt must not set default_model_filename: variants set it")
    header = (
        f"# GENERATED by `python -m export` from ../config.pbtxt for variant {variant.name!r}\n"
        f"# ({variant.description}). Edit config.pbtxt instead; served with\n"
        f"# tritonserver --model-config-name={variant.name} (PRECISION={variant.name}).\n"
    )
    body = base
    extra = (f'default_model_filename: "{variant.filename}"\n' if variant.name != "fp32" else "") + _parameter_lines(params)
    if variant.name == "ort_trt_fp16":
        if re.search(r"^\s*optimization\s*\{", base, re.M):
            raise ValueError("config.pbtxt must not declare optimization{}: the ort_trt_fp16 variant adds it")
        extra += _trt_accelerator(base)
    elif variant.name == "trt_plan":
        body, n = re.subn(r'^backend:\s*"onnxruntime"\s*$', 'platform: "tensorrt_plan"', body, flags=re.M)
        if n != 1:
            raise ValueError('a trt_plan variant needs a config.pbtxt with backend: "onnxruntime"')
        body = "\n".join(line for line in body.splitlines() if not _ORT_ONLY_PARAMS.match(line)) + "\n"
    elif variant.name == "openvino":
        body, n = re.subn(r'^backend:\s*"onnxruntime"\s*$', 'backend: "openvino"', body, flags=re.M)
        if n != 1:
            raise ValueError('an openvino variant needs a config.pbtxt with backend: "onnxruntime"')
        threads = re.search(r'key:\s*"intra_op_thread_count"\s*value:\s*\{\s*string_value:\s*"(\d+)"', body)
        body = "\n".join(line for line in body.splitlines() if not _ORT_ONLY_PARAMS.match(line)) + "\n"
        # ONNX Runtime's intra-op threads per instance become OpenVINO's inference threads.
        extra += _parameter_lines({"INFERENCE_NUM_THREADS": threads.group(1) if threads else "0"})
    if variant.name in GPU_VARIANTS:
        body = drop_ragged(body)
        extra += gpu_warmup(base)
    return header + body.rstrip("\n") + "\n\n" + extra


def write_variant_config(model_dir: Path, variant: Variant, params: dict[str, str] | None = None) -> Path:
    """Write configs/<variant>.pbtxt (for fp32 too: config.pbtxt plus the model's parameters)."""
    target = model_dir / "configs" / f"{variant.name}.pbtxt"
    target.parent.mkdir(exist_ok=True)
    target.write_text(variant_config((model_dir / "config.pbtxt").read_text(), variant, params))
    return target


def remove_variant(model_dir: Path, variant: Variant, version: str = "1") -> None:
    """Delete a variant's files and config (a variant that failed its gate).

    For fp32 that is the model itself: config.pbtxt then fails to load, loudly, rather than
    serve a model that missed its gate.
    """
    if variant.name == "fp32" or variant.filename != VARIANTS["fp32"].filename:  # not FP32's file under another runtime
        (model_dir / version / variant.filename).unlink(missing_ok=True)
    (model_dir / "configs" / f"{variant.name}.pbtxt").unlink(missing_ok=True)
    if variant.name == "fp32":
        for hardware in AUTO_ORDER:
            (model_dir / "configs" / f"{hardware}.pbtxt").unlink(missing_ok=True)
