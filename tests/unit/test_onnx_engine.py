"""The Python-based onnxruntime backend's library: config -> session, batching, isolation."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from contract.errors import ConfigError, InputError
from contract.model_config import ModelConfig
from python_backends.onnx_engine.batching import run_batched
from python_backends.onnx_engine.session import check_io, open_session, plan_session, resolve_model_path


def _config(**extra):
    raw = {
        "name": "toy",
        "max_batch_size": 8,
        "input": [{"name": "ids", "data_type": "TYPE_INT64", "dims": ["-1"]}],
        "output": [{"name": "emb", "data_type": "TYPE_FP32", "dims": ["-1", "4"]}],
    }
    raw.update(extra)
    return ModelConfig(raw)


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory) -> Path:
    """ids [b, s] int64 -> emb [b, s, 4] float32, a Gather from a 10-row table (ids >= 10 fail)."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [10, 4], np.arange(40, dtype=np.float32).tolist())
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0)],
        "toy",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["b", "s", 4])],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("toy") / "1"
    path.mkdir()
    onnx.save(model, path / "model.onnx")
    return path / "model.onnx"


def test_cpu_plan_defaults_spinning_off(toy_model):
    plan = plan_session(_config(), toy_model, "CPU", 0, ["CPUExecutionProvider"])
    assert plan.providers == ["CPUExecutionProvider"]
    assert plan.config_entries["session.intra_op.allow_spinning"] == "0"
    assert plan.intra_op_threads == 0 and not plan.parallel


def test_native_parameter_names_are_honoured(toy_model):
    params = {
        "intra_op_thread_count": {"string_value": "2"},
        "inter_op_thread_count": {"string_value": "1"},
        "execution_mode": {"string_value": "1"},
        "enable_mem_arena": {"string_value": "0"},
        "session.intra_op.allow_spinning": {"string_value": "1"},
    }
    plan = plan_session(
        _config(parameters=params, optimization={"graph": {"level": 2}}), toy_model, "CPU", 0, ["CPUExecutionProvider"]
    )
    assert (plan.intra_op_threads, plan.inter_op_threads, plan.parallel) == (2, 1, True)
    assert plan.enable_mem_arena is False
    assert plan.graph_level == "ORT_DISABLE_ALL"
    assert plan.config_entries["session.intra_op.allow_spinning"] == "1"
    session = open_session(plan)
    assert session.get_inputs()[0].name == "ids"


def test_bad_execution_mode_fails_the_load(toy_model):
    with pytest.raises(ConfigError, match="'execution_mode' must be 0 or 1"):
        plan_session(_config(parameters={"execution_mode": {"string_value": "3"}}), toy_model, "CPU", 0, ["CPUExecutionProvider"])


def test_gpu_instance_uses_tensorrt_then_cuda(toy_model):
    accel = {
        "execution_accelerators": {
            "gpu_execution_accelerator": [
                {
                    "name": "tensorrt",
                    "parameters": {
                        "precision_mode": "FP16",
                        "max_workspace_size_bytes": "1073741824",
                        "trt_engine_cache_enable": "1",
                    },
                }
            ]
        }
    }
    available = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    plan = plan_session(_config(optimization=accel), toy_model, "GPU", 1, available)
    names = [p[0] if isinstance(p, tuple) else p for p in plan.providers]
    assert names == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    trt = plan.providers[0][1]
    assert trt["device_id"] == 1 and trt["trt_fp16_enable"] is True and trt["trt_int8_enable"] is False
    assert trt["trt_max_workspace_size"] == "1073741824" and trt["trt_engine_cache_enable"] == "1"
    # Without the TensorRT provider it falls back to CUDA (logged), never silently to CPU only.
    plan = plan_session(_config(optimization=accel), toy_model, "GPU", 0, available[1:])
    assert [p[0] if isinstance(p, tuple) else p for p in plan.providers] == ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_gpu_instance_without_cuda_provider_fails_clearly(toy_model):
    with pytest.raises(ConfigError, match="no CUDA provider.*onnxruntime-gpu"):
        plan_session(_config(), toy_model, "GPU", 0, ["CPUExecutionProvider"])


def test_check_io_catches_config_graph_mismatch(toy_model):
    session = open_session(plan_session(_config(), toy_model, "CPU", 0, ["CPUExecutionProvider"]))
    check_io(_config(), session)
    wrong_type = _config(output=[{"name": "emb", "data_type": "TYPE_FP16", "dims": ["-1", "4"]}])
    with pytest.raises(ConfigError, match="'emb' is TYPE_FP32 in the ONNX graph, TYPE_FP16 in config.pbtxt"):
        check_io(wrong_type, session)
    wrong_name = _config(input=[{"name": "input_ids", "data_type": "TYPE_INT64", "dims": ["-1"]}])
    with pytest.raises(ConfigError, match="'input_ids' is not in the ONNX graph"):
        check_io(wrong_name, session)


def test_missing_model_file(tmp_path):
    with pytest.raises(ConfigError, match="model.onnx not found.*make export"):
        resolve_model_path(_config(), tmp_path)


def test_run_batched_concatenates_by_shape_and_isolates_failures(toy_model):
    session = open_session(plan_session(_config(), toy_model, "CPU", 0, ["CPUExecutionProvider"]))
    calls = []

    def run(feed):
        calls.append(feed["ids"].shape)
        return {"emb": session.run(["emb"], feed)[0]}

    requests = [
        {"ids": np.array([[1, 2, 3]], dtype=np.int64)},
        {"ids": np.array([[4, 5, 6], [7, 8, 9]], dtype=np.int64)},
        {"ids": np.array([[1, 2]], dtype=np.int64)},  # other length: its own group
        {"ids": np.array([[1, 99, 3]], dtype=np.int64)},  # out of range: fails the batched run
        {},  # missing input
    ]
    out = run_batched(requests, ["ids"], run)
    assert isinstance(out[4].error, InputError) and "ids: input is missing" in str(out[4].error)
    assert out[3].error is not None and out[3].outputs is None
    assert isinstance(out[3].error, InputError) and "out of data bounds" in str(out[3].error)  # INVALID_ARG
    for i in (0, 1, 2):
        assert out[i].error is None
        np.testing.assert_array_equal(out[i].outputs["emb"], session.run(["emb"], requests[i])[0])
    # one batched run of 4 rows for the length-3 group (failed), then one run per request
    assert calls[0] == (4, 3)
    assert (1, 2) in calls and calls.count((1, 3)) == 2 and (2, 3) in calls


def test_batch_size_mismatch_between_inputs():
    out = run_batched([{"a": np.zeros((2, 3)), "b": np.zeros((1, 3))}], ["a", "b"], lambda feed: {})
    assert "batch size 1 differs" in str(out[0].error)
