"""text_encoder's ragged batching in its configs: the CPU configs (served by this project's
Python-based onnxruntime backend) keep allow_ragged_batch and the token budget; the GPU
variants, served by NVIDIA's native backends that would concatenate ragged inputs flat, drop
both and batch by equal shape."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from contract.model_config import ModelConfig
from export import variants
from python_backends.onnx_engine.batching import budget_from_config
from server.layout import ROOT

BASE = (ROOT / "model_repository" / "text_encoder" / "config.pbtxt").read_text()


def parse(text: str):
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def as_model_config(config) -> ModelConfig:
    """The JSON form Triton hands a Python model, from a parsed config."""
    from google.protobuf.json_format import MessageToDict

    return ModelConfig(MessageToDict(config, preserving_proto_field_name=True))


def test_the_served_config_batches_ragged_under_a_token_budget():
    config = parse(BASE)
    assert all(i.allow_ragged_batch for i in config.input)
    budget = budget_from_config(as_model_config(config))
    assert budget is not None and budget.max_tokens == int(config.parameters["max_batch_tokens"].string_value)
    assert budget.length_input == "attention_mask"
    assert budget.max_padding == int(config.parameters["max_row_padding"].string_value)


@pytest.mark.parametrize("name", ["fp32", "cpu_opt", "int8"])
def test_cpu_variants_keep_ragged_batching(name):
    config = parse(variants.variant_config(BASE, variants.VARIANTS[name]))
    assert all(i.allow_ragged_batch for i in config.input)
    assert "max_batch_tokens" in config.parameters


@pytest.mark.parametrize("name", variants.GPU_VARIANTS)
def test_gpu_variants_drop_ragged_batching_and_its_parameters(name):
    text = variants.variant_config(BASE, variants.VARIANTS[name])
    config = parse(text)
    assert not any(i.allow_ragged_batch for i in config.input)
    assert not {"max_batch_tokens", "max_batch_rows", "max_row_padding", "ragged_length_input"} & set(config.parameters)
    assert "allow_ragged_batch dropped" in text
    # the Python-based backend loads it as a plain shape-grouped model
    assert budget_from_config(as_model_config(config)) is None
    # what is left of the config is untouched: same inputs, batching, instances, warmup
    base = parse(BASE)
    assert [(i.name, list(i.dims)) for i in config.input] == [(i.name, list(i.dims)) for i in base.input]
    assert config.dynamic_batching == base.dynamic_batching
    assert len(config.model_warmup) > len(base.model_warmup)  # plus the GPU warmup of every bucket


def test_drop_ragged_leaves_a_config_without_it_alone():
    text = 'name: "m"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
    assert variants.drop_ragged(text) == text
