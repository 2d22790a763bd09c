"""Where caching is configured: text_embedding_cached mirrors text_embedding's interface, and
Triton's response cache is on only where it cannot serve a stale result."""

import pytest
from google.protobuf import json_format, text_format

from contract.model_config import ModelConfig
from python_backends.cache.settings import CacheSettings
from server.layout import ROOT

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
REPO = ROOT / "model_repository"


def parse(name: str):
    return text_format.Parse((REPO / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def load(name: str) -> ModelConfig:
    return ModelConfig(json_format.MessageToDict(parse(name), preserving_proto_field_name=True))


def test_cached_model_has_the_ensembles_interface_and_batch_size():
    cached, ensemble = load("text_embedding_cached"), load("text_embedding")
    assert cached.input("TEXT") == ensemble.input("TEXT")
    assert cached.output("EMBEDDING") == ensemble.output("EMBEDDING")
    assert cached.max_batch_size == ensemble.max_batch_size  # a batch's misses fit one BLS request
    assert cached.param("target_model") == "text_embedding" and cached.param("encoder_model") == "text_encoder"
    assert cached.param("load_with") == cached.param("target_model")  # the launcher loads the BLS target
    assert cached.param_int("max_text_bytes", 0) == load("text_tokenizer").param_int("max_text_bytes", 0)


def test_shipped_defaults_work_out_of_the_box_with_l2_off():
    s = CacheSettings.from_config(load("text_embedding_cached"), {})
    assert s.l2_redis_url == "" and s.l1_max_bytes == 64 << 20 and s.l1_ttl_s == 3600 and s.l2_timeout_s == 0.05


@pytest.mark.parametrize(
    "name, enabled",
    [
        ("text_tokenizer", True),
        ("image_preprocess", True),
        # Triton keys on name, version and inputs only: after a text_encoder hot swap the ensemble's
        # entries (and a same-version variant swap of the encoder's) would be stale.
        ("text_embedding", False),
        ("text_encoder", False),
        ("text_embedding_cached", False),
        ("image_classification", False),
        ("image_classifier", False),
    ],
)
def test_response_cache_only_where_correct(name, enabled):
    assert parse(name).response_cache.enable is enabled
