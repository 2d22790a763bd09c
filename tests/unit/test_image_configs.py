"""The image_classification model folders agree with each other and with the library's
load-time checks (parsed from config.pbtxt the way Triton hands them to the models)."""

import re

import pytest
from google.protobuf import json_format, text_format

from python_backends.config import ModelConfig
from python_backends.image.preprocess import PreprocessOptions
from server.layout import ROOT

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
REPO = ROOT / "model_repository"
STEPS = ("image_preprocess", "image_classifier", "image_postprocess")


def load(name: str) -> ModelConfig:
    message = text_format.Parse((REPO / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return ModelConfig(json_format.MessageToDict(message, preserving_proto_field_name=True))


def test_ensemble_wires_the_steps_in_order():
    text = (REPO / "image_classification" / "config.pbtxt").read_text()
    assert re.findall(r'model_name:\s*"([^"]+)"', text) == list(STEPS)
    ensemble = load("image_classification")
    assert ensemble.require("input", "IMAGE", "TYPE_STRING", (1,))


def test_shapes_and_dtypes_chain():
    ensemble, pre, cnn, post = (load(n) for n in ("image_classification", *STEPS))
    assert pre.input("IMAGE") == ensemble.input("IMAGE")
    assert pre.output("pixel_values") == cnn.input("pixel_values")
    options = PreprocessOptions.from_config(pre)
    assert (options.crop, options.resize, options.max_megapixels) == (224, 256, 40.0)
    assert cnn.output("logits") == post.input("logits") and post.input("logits").dims == (1000,)
    k = post.param_int("top_k", 5)
    assert k == 5
    for name, dtype in (("LABEL", "TYPE_STRING"), ("CLASS_INDEX", "TYPE_INT64"), ("SCORE", "TYPE_FP32")):
        assert post.require("output", name, dtype, (k,)) == ensemble.output(name)


def test_batching_priorities_and_instances():
    ensemble = load("image_classification")
    for name in STEPS:
        config = load(name)
        # Triton refuses an ensemble whose steps take smaller batches than it does.
        assert config.max_batch_size >= ensemble.max_batch_size, name
        batching = config.raw["dynamic_batching"]
        # No priority levels or queue policy: they stall tritonserver 2.51's batcher (docs/performance.md).
        assert "priority_levels" not in batching and "default_queue_policy" not in batching, name
    assert load("image_preprocess").raw["instance_group"][0]["count"] == 2
    assert load("image_classifier").raw["backend"] == "onnxruntime"
    assert "optimization" not in load("image_classifier").raw  # variants add TensorRT (export/variants.py)
