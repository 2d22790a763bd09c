"""OpenVINO's CPU plugin behind the interface the Python-based backends run ONNX Runtime through.

The local Python-based ``openvino`` backend reads the same config.pbtxt as Triton's native
OpenVINO backend in NVIDIA's container, with its parameter names: ``INFERENCE_NUM_THREADS``,
``NUM_STREAMS``, ``PERFORMANCE_HINT`` and any other key in upper case passed to
``compile_model`` as an OpenVINO property (``default_model_filename`` names the ONNX or IR file).
On CPUs with AVX512-BF16 or AMX the plugin computes in BF16 by default (``INFERENCE_PRECISION_HINT``
f32 keeps FP32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from contract.errors import ConfigError
from contract.model_config import ModelConfig

OV_TO_TRITON = {
    "f32": "TYPE_FP32",
    "f16": "TYPE_FP16",
    "f64": "TYPE_FP64",
    "i64": "TYPE_INT64",
    "i32": "TYPE_INT32",
    "i8": "TYPE_INT8",
    "u8": "TYPE_UINT8",
    "boolean": "TYPE_BOOL",
}
# Pinning off: the plugin pins each instance's threads to the first cores, so two 1-thread
# instances share one core and serve what one does (docs/performance.md#encoders-on-openvino).
DEFAULT_PROPERTIES = {"NUM_STREAMS": "1", "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": "NO"}


def properties_from_config(config: ModelConfig) -> dict[str, str]:
    """The OpenVINO properties of config.pbtxt's upper-case parameters, over the defaults (one
    stream, latency hint: a Triton instance runs one request batch at a time; threads not pinned:
    instances and the server's own threads share the cores)."""
    props = dict(DEFAULT_PROPERTIES)
    for key in config.raw.get("parameters", {}):
        if key.isupper():
            value = config.param(key)
            if value is not None:
                props[key] = value
    threads = props.get("INFERENCE_NUM_THREADS")
    if threads is not None and not (threads.isdigit() and int(threads) >= 0):
        raise ConfigError(f"model {config.name!r}: parameter INFERENCE_NUM_THREADS must be an integer >= 0, got {threads!r}")
    return props


class OpenVINOSession:
    """A compiled model and one infer request; ``run(output_names, feed)`` as ONNX Runtime's."""

    def __init__(self, model_path: Path, properties: dict[str, str]):
        import openvino as ov

        core = ov.Core()
        try:
            self.compiled = core.compile_model(str(model_path), "CPU", properties)
        except RuntimeError as exc:
            raise ConfigError(f"OpenVINO could not compile {model_path.name}: {exc}") from exc
        self._request = self.compiled.create_infer_request()
        self.inputs = {p.get_any_name(): p.get_element_type().get_type_name() for p in self.compiled.inputs}
        self.outputs = {p.get_any_name(): p.get_element_type().get_type_name() for p in self.compiled.outputs}
        self.properties = properties

    def run(self, output_names: list[str] | None, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The named outputs (None: all), copied out of the request's buffers."""
        results = self._request.infer(feed, share_inputs=True)
        by_name = {port.get_any_name(): value for port, value in results.items()}
        return [np.array(by_name[name], copy=True) for name in (output_names or list(self.outputs))]

    def describe(self) -> str:
        precision = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        threads = self.compiled.get_property("INFERENCE_NUM_THREADS")
        return f"OpenVINO CPU, {precision} products, {threads} threads"


def check_io(config: ModelConfig, session: OpenVINOSession) -> None:
    """Fail the load when config.pbtxt and the model disagree on names or types."""
    for kind, specs, graph in (("input", config.inputs, session.inputs), ("output", config.outputs, session.outputs)):
        for spec in specs:
            element: Any = graph.get(spec.name)
            if element is None:
                raise ConfigError(
                    f"model {config.name!r}: config {kind} {spec.name!r} is not in the model "
                    f"(its {kind}s: {', '.join(graph) or 'none'})"
                )
            graph_type = OV_TO_TRITON.get(element, element)
            if graph_type != spec.data_type:
                raise ConfigError(
                    f"model {config.name!r}: {kind} {spec.name!r} is {graph_type} in the model, {spec.data_type} in config.pbtxt"
                )
    missing = [name for name in session.inputs if name not in {s.name for s in config.inputs}]
    if missing:
        raise ConfigError(f"model {config.name!r}: model inputs missing from config.pbtxt: {', '.join(missing)}")
