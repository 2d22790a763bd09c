"""Serialized TensorRT engines (``platform: "tensorrt_plan"``) built with the TensorRT Python API.

Needs an NVIDIA GPU, the ``tensorrt`` Python package and a CUDA-enabled PyTorch (used only to
hold device buffers when checking the engine's parity). Where any is missing,
``unavailable_reason()`` says which, and the export skips this variant with that reason.

An engine is specific to the GPU model and TensorRT version that built it: build it on the
machine (or the same GPU type and container release) that serves it. NVIDIA's 24.10
container ships TensorRT 10.5 (``variants.SERVING_TENSORRT``); requirements-gpu.txt pins the
same, and any other installed TensorRT is refused here (11.x also lacks the FP16 builder flag
this code uses). The version that built a plan is recorded in variants.json.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    """Shapes of one input for TensorRT's optimization profile (min, opt, max)."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def unavailable_reason() -> str | None:
    """Why no engine can be built here, or None when it can."""
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU (nvidia-smi not found)"
    from export.variants import SERVING_TENSORRT, installed_tensorrt, same_tensorrt

    built_by = installed_tensorrt()
    if built_by is None:
        return (
            f"the tensorrt Python package is not installed (TensorRT {SERVING_TENSORRT}: "
            f"pip install -r requirements-gpu.txt, or use NVIDIA's container)"
        )
    if not same_tensorrt(built_by, SERVING_TENSORRT):
        return (
            f"tensorrt {built_by} is installed, but the serving TensorRT is {SERVING_TENSORRT} (NVIDIA's "
            f"24.10 container), which could not load its engine: pip install -r requirements-gpu.txt"
        )
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch has no CUDA device (a CPU-only build, or no driver)"
    return None


def build_engine(
    onnx_path: Path, plan_path: Path, profiles: Mapping[str, Profile], fp16: bool = True, workspace_bytes: int = 1 << 30
) -> None:
    """Parse the ONNX graph, build an engine for the given dynamic shapes, serialize it."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if fp16:
        if not builder.platform_has_fast_fp16:
            log.warning("this GPU has no fast FP16; building FP16 anyway")
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if tensor.name not in profiles:
            raise ValueError(f"no optimization profile for input {tensor.name!r}")
        p = profiles[tensor.name]
        profile.set_shape(tensor.name, p.min, p.opt, p.max)
    config.add_optimization_profile(profile)
    log.info("building TensorRT engine from %s (FP16=%s); this takes minutes", onnx_path.name, fp16)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT engine build failed (see the TensorRT log above)")
    tmp = plan_path.with_suffix(".plan.tmp")
    tmp.write_bytes(bytes(serialized))
    tmp.replace(plan_path)


class EngineRunner:
    """Runs a serialized engine on the GPU with PyTorch CUDA tensors as buffers."""

    _TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "INT64": "int64", "INT32": "int32", "BOOL": "bool"}

    def __init__(self, plan_path: Path):
        import tensorrt as trt
        import torch

        self._trt, self._torch = trt, torch
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"could not deserialize {plan_path} (built by another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        trt, torch = self._trt, self._torch
        buffers = {}
        for name in self.names:
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                tensor = torch.from_numpy(np.ascontiguousarray(feeds[name])).cuda()
                self.context.set_input_shape(name, tuple(tensor.shape))
                buffers[name] = tensor
        for name in self.names:
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
                shape = tuple(self.context.get_tensor_shape(name))
                dtype = getattr(torch, self._TORCH_DTYPES[self.engine.get_tensor_dtype(name).name])
                buffers[name] = torch.empty(shape, dtype=dtype, device="cuda")
        for name, tensor in buffers.items():
            self.context.set_tensor_address(name, tensor.data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return {
            name: buffers[name].float().cpu().numpy()
            for name in self.names
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT
        }
