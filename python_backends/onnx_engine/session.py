"""ONNX Runtime sessions built from a Triton model configuration.

The local Python-based ``onnxruntime`` backend reads the same config.pbtxt as Triton's
native C++ ONNX Runtime backend in NVIDIA's container, with the native backend's
parameter names, so one model repository serves both:

* ``parameters``: ``intra_op_thread_count``, ``inter_op_thread_count``, ``execution_mode``
  (0 sequential / 1 parallel), ``enable_mem_arena``, ``enable_mem_pattern``, and any
  ``session.*`` key as an ONNX Runtime session config entry. ``session.intra_op.allow_spinning``
  defaults to "0" here: on small CPUs a spinning intra-op pool starves the server's own
  threads (p99 went from 8 ms to 510 ms at concurrency 1 on 2 cores).
* ``optimization.graph.level`` with the native mapping (-1 basic, 1 extended, 2 disabled).
* ``optimization.execution_accelerators.gpu_execution_accelerator``: ``tensorrt`` (with
  ``precision_mode``, ``max_workspace_size_bytes``, ``trt_*`` keys) and ``cuda``, used on GPU
  instances when this ONNX Runtime build has those providers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import ConfigError
from contract.model_config import ModelConfig

log = logging.getLogger(__name__)

ORT_TO_TRITON = {
    "tensor(float)": "TYPE_FP32",
    "tensor(float16)": "TYPE_FP16",
    "tensor(double)": "TYPE_FP64",
    "tensor(int64)": "TYPE_INT64",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int8)": "TYPE_INT8",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(bool)": "TYPE_BOOL",
    "tensor(string)": "TYPE_STRING",
}

_GRAPH_LEVELS = {-1: "ORT_ENABLE_BASIC", 1: "ORT_ENABLE_EXTENDED", 2: "ORT_DISABLE_ALL"}

# Native backend parameter -> ONNX Runtime TensorRT provider option.
_TRT_OPTION_NAMES = {"max_workspace_size_bytes": "trt_max_workspace_size"}


@dataclass
class SessionPlan:
    """Everything needed to open a session; built without touching ONNX Runtime's state."""

    model_path: Path
    providers: list[Any]
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    parallel: bool = False
    graph_level: str = "ORT_ENABLE_ALL"
    enable_mem_arena: bool | None = None
    enable_mem_pattern: bool | None = None
    config_entries: dict[str, str] = field(default_factory=dict)


def resolve_model_path(config: ModelConfig, version_dir: Path) -> Path:
    filename = config.raw.get("default_model_filename") or "model.onnx"
    path = version_dir / filename
    if not path.exists():
        raise ConfigError(f"model {config.name!r}: {path} not found (run `make export`)")
    return path


def _trt_options(params: dict[str, Any], device_id: int) -> dict[str, Any]:
    opts: dict[str, Any] = {"device_id": device_id}
    for key, value in params.items():
        if key == "precision_mode":
            mode = str(value).upper()
            if mode not in ("FP32", "FP16", "INT8"):
                raise ConfigError(f"tensorrt precision_mode must be FP32, FP16 or INT8, got {value!r}")
            opts["trt_fp16_enable"] = mode in ("FP16", "INT8")
            opts["trt_int8_enable"] = mode == "INT8"
        else:
            opts[_TRT_OPTION_NAMES.get(key, key if key.startswith("trt_") else f"trt_{key}")] = value
    return opts


def plan_session(
    config: ModelConfig,
    model_path: Path,
    instance_kind: str,
    device_id: int,
    available_providers: list[str],
) -> SessionPlan:
    """Translate config.pbtxt into ONNX Runtime options. ``instance_kind`` is "CPU" or "GPU"."""
    providers: list[Any] = []
    if instance_kind.upper() == "GPU":
        if "CUDAExecutionProvider" not in available_providers:
            raise ConfigError(
                f"model {config.name!r}: GPU instance requested but this ONNX Runtime has no CUDA provider "
                f"(available: {', '.join(available_providers)}); install the gpu extra (onnxruntime-gpu)"
            )
        for accel in config.execution_accelerators("gpu"):
            name = accel["name"].lower()
            if name == "tensorrt":
                if "TensorrtExecutionProvider" in available_providers:
                    providers.append(("TensorrtExecutionProvider", _trt_options(accel["parameters"], device_id)))
                else:
                    log.warning("model %s: tensorrt accelerator requested but not in this ONNX Runtime; using CUDA", config.name)
            elif name == "cuda":
                pass  # CUDA is always added below; its parameters go to the CUDA provider
            else:
                raise ConfigError(f"model {config.name!r}: unknown gpu_execution_accelerator {accel['name']!r}")
        cuda_opts: dict[str, Any] = {"device_id": device_id}
        for accel in config.execution_accelerators("gpu"):
            if accel["name"].lower() == "cuda":
                cuda_opts.update(accel["parameters"])
        providers.append(("CUDAExecutionProvider", cuda_opts))
    for accel in config.execution_accelerators("cpu"):
        if accel["name"].lower() == "openvino" and "OpenVINOExecutionProvider" in available_providers:
            providers.append("OpenVINOExecutionProvider")
    providers.append("CPUExecutionProvider")

    execution_mode = config.param_int("execution_mode", 0)
    if execution_mode not in (0, 1):
        raise ConfigError(f"model {config.name!r}: parameter 'execution_mode' must be 0 or 1, got {execution_mode}")
    level = config.graph_optimization_level()
    entries = {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}
    entries.update(config.params_with_prefix("session."))
    arena = config.param("enable_mem_arena")
    pattern = config.param("enable_mem_pattern")
    return SessionPlan(
        model_path=model_path,
        providers=providers,
        intra_op_threads=config.param_int("intra_op_thread_count", 0, minimum=0),
        inter_op_threads=config.param_int("inter_op_thread_count", 0, minimum=0),
        parallel=execution_mode == 1,
        graph_level=_GRAPH_LEVELS.get(level, "ORT_ENABLE_ALL") if level is not None else "ORT_ENABLE_ALL",
        enable_mem_arena=None if arena is None else config.param_bool("enable_mem_arena", True),
        enable_mem_pattern=None if pattern is None else config.param_bool("enable_mem_pattern", True),
        config_entries=entries,
    )


def open_session(plan: SessionPlan):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = plan.intra_op_threads
    options.inter_op_num_threads = plan.inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL if plan.parallel else ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, plan.graph_level)
    if plan.enable_mem_arena is not None:
        options.enable_cpu_mem_arena = plan.enable_mem_arena
    if plan.enable_mem_pattern is not None:
        options.enable_mem_pattern = plan.enable_mem_pattern
    for key, value in plan.config_entries.items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(str(plan.model_path), sess_options=options, providers=plan.providers)


def check_io(config: ModelConfig, session) -> None:
    """Fail the load when config.pbtxt and the ONNX graph disagree on names or dtypes."""
    graph_inputs = {i.name: i for i in session.get_inputs()}
    graph_outputs = {o.name: o for o in session.get_outputs()}
    for kind, specs, graph in (("input", config.inputs, graph_inputs), ("output", config.outputs, graph_outputs)):
        for spec in specs:
            node = graph.get(spec.name)
            if node is None:
                raise ConfigError(
                    f"model {config.name!r}: config {kind} {spec.name!r} is not in the ONNX graph "
                    f"(graph {kind}s: {', '.join(graph) or 'none'})"
                )
            graph_type = ORT_TO_TRITON.get(node.type, node.type)
            if graph_type != spec.data_type:
                raise ConfigError(
                    f"model {config.name!r}: {kind} {spec.name!r} is {graph_type} in the ONNX graph, "
                    f"{spec.data_type} in config.pbtxt"
                )
    missing = [name for name in graph_inputs if name not in {s.name for s in config.inputs}]
    if missing:
        raise ConfigError(f"model {config.name!r}: ONNX graph inputs missing from config.pbtxt: {', '.join(missing)}")
