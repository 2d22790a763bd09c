"""The image_classification (EfficientNet-Lite0) and image_classification_resnet50 model folders
agree with each other and with the library's load-time checks (parsed from config.pbtxt the way
Triton hands them to the models)."""

import re

import pytest
from google.protobuf import json_format, text_format

from contract.model_config import ModelConfig
from python_backends.image.preprocess import PreprocessOptions
from server.layout import ROOT

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
REPO = ROOT / "model_repository"
STEPS = ("image_preprocess", "image_classifier", "image_postprocess")
# ensemble -> its steps; image_postprocess (softmax, top k, labels) is shared.
ENSEMBLES = {
    "image_classification": STEPS,
    "image_classification_resnet50": ("image_preprocess_resnet50", "image_classifier_resnet50", "image_postprocess"),
}


def load(name: str) -> ModelConfig:
    message = text_format.Parse((REPO / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return ModelConfig(json_format.MessageToDict(message, preserving_proto_field_name=True))


@pytest.mark.parametrize("ensemble_name", sorted(ENSEMBLES))
def test_ensemble_wires_the_steps_in_order(ensemble_name):
    text = (REPO / ensemble_name / "config.pbtxt").read_text()
    assert re.findall(r'model_name:\s*"([^"]+)"', text) == list(ENSEMBLES[ensemble_name])
    ensemble = load(ensemble_name)
    assert ensemble.require("input", "IMAGE", "TYPE_STRING", (1,))


def test_the_two_ensembles_have_one_interface():
    a, b = load("image_classification"), load("image_classification_resnet50")
    assert a.raw["input"] == b.raw["input"] and a.raw["output"] == b.raw["output"]
    assert a.max_batch_size == b.max_batch_size


def test_each_preprocessing_step_has_its_weights_recipe():
    lite = PreprocessOptions.from_config(load("image_preprocess"))
    resnet = PreprocessOptions.from_config(load("image_preprocess_resnet50"))
    assert (lite.resize_mode, lite.interpolation) == ("crop_then_resize", "bicubic")
    assert resnet == PreprocessOptions()  # torchvision's recipe, the library's default
    assert lite.mean != resnet.mean and lite.std != resnet.std
    assert (REPO / "image_preprocess_resnet50" / "1" / "model.py").read_text() == (
        REPO / "image_preprocess" / "1" / "model.py"
    ).read_text()


@pytest.mark.parametrize("ensemble_name", sorted(ENSEMBLES))
def test_shapes_and_dtypes_chain(ensemble_name):
    ensemble, pre, cnn, post = (load(n) for n in (ensemble_name, *ENSEMBLES[ensemble_name]))
    assert pre.input("IMAGE") == ensemble.input("IMAGE")
    assert pre.output("pixel_values") == cnn.input("pixel_values")
    options = PreprocessOptions.from_config(pre)
    assert (options.crop, options.resize, options.max_megapixels) == (224, 256, 40.0)
    assert cnn.output("logits") == post.input("logits") and post.input("logits").dims == (1000,)
    k = post.param_int("top_k", 5)
    assert k == 5
    for name, dtype in (("LABEL", "TYPE_STRING"), ("CLASS_INDEX", "TYPE_INT64"), ("SCORE", "TYPE_FP32")):
        assert post.require("output", name, dtype, (k,)) == ensemble.output(name)


@pytest.mark.parametrize("ensemble_name", sorted(ENSEMBLES))
def test_batching_priorities_and_instances(ensemble_name):
    ensemble = load(ensemble_name)
    steps = ENSEMBLES[ensemble_name]
    for name in steps:
        config = load(name)
        # Triton refuses an ensemble whose steps take smaller batches than it does.
        assert config.max_batch_size >= ensemble.max_batch_size, name
        batching = config.raw["dynamic_batching"]
        # No priority levels or queue policy: they stall tritonserver 2.51's batcher (docs/performance.md).
        assert "priority_levels" not in batching and "default_queue_policy" not in batching, name
    assert load(steps[0]).raw["instance_group"][0]["count"] == 2
    assert load(steps[1]).raw["backend"] == "onnxruntime"
    assert "optimization" not in load(steps[1]).raw  # variants add TensorRT (export/variants.py)
