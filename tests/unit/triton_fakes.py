"""A stand-in for ``triton_python_backend_utils`` (only importable inside Triton's stub): enough of
its API to drive the model.py shims and python_backends' shim helpers in unit tests."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


class TritonError:
    INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = "INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED"

    def __init__(self, message, code=INTERNAL):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def shape(self):
        return list(self._array.shape)


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.output_tensors, self._error = list(output_tensors), error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def output(self, name):
        return next(t.as_numpy() for t in self.output_tensors if t.name() == name)


class Request:
    """A request as execute() receives it."""

    def __init__(self, request_id="", parameters=None, **inputs):
        self.inputs = [Tensor(name, array) for name, array in inputs.items()]
        self._id, self._parameters = request_id, json.dumps(parameters or {})

    def request_id(self):
        return self._id

    def parameters(self):
        return self._parameters


class Metric:
    def __init__(self, labels, buckets=None):
        self.labels, self.value, self.observed = dict(labels), 0.0, []

    def increment(self, n):
        self.value += n

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
        metric = Metric(labels, buckets)
        self.metrics.append(metric)
        return metric


class Logger:
    lines: list = []

    @classmethod
    def log_info(cls, m):
        cls.lines.append(("info", m))

    log_warn = log_error = log_verbose = log_info


def make_pb_utils(bls=None, ready=lambda model, version: True):
    """A fresh fake module. ``bls(request) -> InferenceResponse`` answers InferenceRequest.exec and
    async_exec; ``ready(model, version)`` is is_model_ready."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TritonError, pb.TritonModelException, pb.Tensor = TritonError, TritonModelException, Tensor
    pb.InferenceResponse, pb.MetricFamily, pb.Logger = InferenceResponse, MetricFamily, Logger
    pb.sent = []  # every BLS request, in order

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names, model_version=-1, parameters=None):
            self.model_name, self.model_version, self.parameters = model_name, model_version, parameters or {}
            self.inputs = {t.name(): t.as_numpy() for t in inputs}
            self.requested_output_names = requested_output_names

        def exec(self):
            pb.sent.append(self)
            return pb.bls(self)

        async def async_exec(self):
            return self.exec()

    pb.InferenceRequest, pb.bls = InferenceRequest, bls
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.is_model_ready = lambda model, version="": pb.ready(model, version)
    pb.ready = ready
    pb.get_input_tensor_by_name = lambda request, name: next((t for t in request.inputs if t.name() == name), None)
    pb.get_output_tensor_by_name = lambda response, name: next((t for t in response.output_tensors if t.name() == name), None)
    return pb


def load_shim(model: str, pb, monkeypatch):
    """model_repository/<model>/1/model.py imported with ``pb`` as triton_python_backend_utils."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    path = ROOT / "model_repository" / model / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"shim_under_test_{model}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


def tensor(name, dims, data_type):
    return {"name": name, "data_type": data_type, "dims": [str(d) for d in dims]}


def model_config(name, inputs, outputs, max_batch_size=64, parameters=None, instances=2) -> str:
    """The JSON Triton hands a Python model as args["model_config"]."""
    return json.dumps(
        {
            "name": name,
            "max_batch_size": max_batch_size,
            "input": inputs,
            "output": outputs,
            "instance_group": [{"count": instances, "kind": "KIND_CPU"}],
            "parameters": {k: {"string_value": v} for k, v in (parameters or {}).items()},
        }
    )


def encoder_repository(root: Path, versions=(1,)) -> Path:
    """A model repository with a text_encoder whose versions hold a (fake) model.onnx."""
    encoder = root / "text_encoder"
    encoder.mkdir(parents=True)
    (encoder / "config.pbtxt").write_text('name: "text_encoder"\nbackend: "onnxruntime"\n')
    for v in versions:
        (encoder / str(v)).mkdir()
        (encoder / str(v) / "model.onnx").write_bytes(f"weights {v}".encode())
    # The tokenizer step's limit, which the cached entry reads (python_backends/cache/entry.py).
    (root / "text_tokenizer").mkdir(exist_ok=True)
    (root / "text_tokenizer" / "config.pbtxt").write_text(
        'name: "text_tokenizer"\nparameters { key: "max_sequence_length" value: { string_value: "256" } }\n'
    )
    return root


@pytest.fixture
def triton_logging():
    """Undo what shim.install_logging does to the ``python_backends`` logger (a handler writing to
    the fake Logger, no propagation), so later tests' caplog still sees the library's records."""
    import logging

    root = logging.getLogger("python_backends")
    saved = (list(root.handlers), root.propagate, root.level)
    Logger.lines.clear()
    yield Logger.lines
    root.handlers[:], root.propagate = saved[0], saved[1]
    root.setLevel(saved[2])
