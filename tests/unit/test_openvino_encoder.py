"""The encoders' openvino variant: the Python-based openvino backend's session over the exported
FP32 ONNX file (python_backends/onnx_engine/openvino_session.py) and the config the export derives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from contract.errors import ConfigError
from contract.model_config import ModelConfig
from export import variants
from python_backends.onnx_engine.openvino_session import DEFAULT_PROPERTIES, OpenVINOSession, check_io, properties_from_config

REPO = Path(__file__).resolve().parents[2] / "model_repository"
ENCODER = REPO / "text_encoder" / "1" / "model.onnx"


def _config(text: str) -> ModelConfig:
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    parsed = text_format.Parse(text, model_config_pb2.ModelConfig())
    return ModelConfig(json.loads(json_format.MessageToJson(parsed, preserving_proto_field_name=True)))


def test_the_openvino_config_swaps_the_backend_and_turns_ort_threads_into_openvino_threads():
    base = (REPO / "text_encoder" / "config.pbtxt").read_text()
    text = variants.variant_config(base, variants.VARIANTS["openvino"])
    assert 'backend: "openvino"' in text and 'backend: "onnxruntime"' not in text
    assert 'default_model_filename: "model.onnx"' in text
    assert "intra_op_thread_count" not in text and "session.intra_op" not in text
    config = _config(text)
    assert properties_from_config(config) == {**DEFAULT_PROPERTIES, "INFERENCE_NUM_THREADS": "1"}
    bad = text.replace(
        'key: "INFERENCE_NUM_THREADS" value: { string_value: "1"', 'key: "INFERENCE_NUM_THREADS" value: { string_value: "two"'
    )
    with pytest.raises(ConfigError, match="INFERENCE_NUM_THREADS must be an integer"):
        properties_from_config(_config(bad))
    # FP32's file is shared: removing a failed openvino variant keeps model.onnx.
    assert variants.VARIANTS["openvino"].filename == variants.VARIANTS["fp32"].filename


@pytest.mark.skipif(not ENCODER.is_file(), reason="text_encoder is not exported (python -m export)")
def test_the_session_runs_the_onnx_file_as_onnx_runtime_does_and_checks_the_config():
    import onnxruntime as ort

    session = OpenVINOSession(ENCODER, {**DEFAULT_PROPERTIES, "INFERENCE_NUM_THREADS": "1"})
    # Not pinned: the plugin's default under the latency hint pins every instance's threads to the
    # first cores, where two 1-thread instances served as one.
    assert session.compiled.get_property("ENABLE_CPU_PINNING") is False
    config = _config((REPO / "text_encoder" / "config.pbtxt").read_text())
    check_io(config, session)
    rng = np.random.default_rng(0)
    for batch, length in ((1, 16), (8, 37), (3, 128)):  # dynamic shapes, one compiled model
        feed = {
            "input_ids": rng.integers(1000, 20000, (batch, length), dtype=np.int64),
            "attention_mask": np.ones((batch, length), np.int64),
        }
        feed["attention_mask"][0, length // 2 :] = 0
        got = session.run(["sentence_embedding"], feed)[0]
        want = ort.InferenceSession(str(ENCODER), providers=["CPUExecutionProvider"]).run(["sentence_embedding"], feed)[0]
        cosine = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
        assert got.shape == (batch, 384) and float(cosine.min()) > 0.999
    renamed = _config((REPO / "text_encoder" / "config.pbtxt").read_text().replace('"sentence_embedding"', '"embedding"', 1))
    with pytest.raises(ConfigError, match="'embedding' is not in the model"):
        check_io(renamed, session)
