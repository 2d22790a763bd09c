"""The gRPC front door (server/grpc_door.py) on the session's server: hostile gRPC requests get
INVALID_ARGUMENT naming the field, on ModelInfer and ModelStreamInfer, and afterwards every
python backend stub is the same live process and every model answers. Other RPCs pass through.

The first test is the attack of issue 23, which killed a ``text_encoder`` stub for good through
the public port before the door existed (tritonserver multiplies the declared dims in 64 bits).
"""

from __future__ import annotations

import json
import struct
import urllib.request

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from contract.errors import ERROR_METADATA, INVALID, MARK, data_from_json, error_data, parse_error
from ops.repository import GRPC_TOKEN_HEADER
from server.frontdoor import model_limits
from server.stubs import find_stubs

WRAP_INT64 = 2**61 + 16  # x 8 bytes wraps around 2^64 to exactly 128 bytes


@pytest.fixture(scope="module")
def door(triton):
    channel = grpc.insecure_channel(triton.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _bytes(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def _text_request(shape, raw: bytes, model="text_embedding", datatype="BYTES"):
    req = service_pb2.ModelInferRequest(model_name=model)
    t = req.inputs.add(name="TEXT", datatype=datatype)
    t.shape.extend(shape)
    req.raw_input_contents.append(raw)
    return req


def _wrapping_encoder_request():
    req = service_pb2.ModelInferRequest(model_name="text_encoder")
    for name in ("input_ids", "attention_mask"):
        t = req.inputs.add(name=name, datatype="INT64")
        t.shape.extend([1, WRAP_INT64])
        req.raw_input_contents.append(np.ones(16, np.int64).tobytes())
    return req


def _live_stubs(triton) -> dict[int, str]:
    return {s.pid: s.instance for s in find_stubs(triton.process.pid) if not s.zombie}


def _every_model_answers(door, times: int = 4) -> None:
    """Enough requests to each entry model that both instances of every two-instance step serve some."""
    for _ in range(times):
        answer = door.ModelInfer(_text_request([1, 1], _bytes(b"hello world")), timeout=60)
        assert answer.outputs and {o.name for o in answer.outputs} <= {"EMBEDDING", "NUM_TOKENS", "ENCODER_VERSION"}
        cached = door.ModelInfer(_text_request([1, 1], _bytes(b"another text"), model="text_embedding_cached"), timeout=60)
        assert cached.outputs


def test_the_wrapping_shape_is_refused_and_every_stub_lives(triton, door):
    before = _live_stubs(triton)
    assert any(name.startswith("text_encoder_") for name in before.values())
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as info:
            door.ModelInfer(_wrapping_encoder_request(), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'input_ids'" in info.value.details() and str(WRAP_INT64) in info.value.details()
    answers = list(door.ModelStreamInfer(iter([_wrapping_encoder_request()]), timeout=60))
    assert len(answers) == 1 and str(WRAP_INT64) in answers[0].error_message
    # The refusal carries its code, field and limit as data, as the models' own errors do: the
    # unary call's words as its details and its data as error-data trailing metadata; a stream's
    # error (no status, no metadata) after the words.
    assert MARK not in info.value.details()
    trailing = dict(info.value.trailing_metadata() or ())
    unary = data_from_json(trailing[ERROR_METADATA], info.value.details())
    assert unary is not None and unary.code == INVALID and unary.field == "inputs[0] 'input_ids'.shape"
    assert unary.values["rule"] == "elements" and unary.values["got"] == WRAP_INT64 and unary.values["maximum"] > 0
    assert error_data(info.value) == unary
    assert parse_error(answers[0].error_message) == unary
    _every_model_answers(door)
    assert _live_stubs(triton) == before, "a stub died or was replaced"
    with urllib.request.urlopen(f"http://{triton.http_url}/v2/health/ready", timeout=10) as r:
        assert r.status == 200


def test_a_models_error_goes_on_with_its_status_and_metadata_from_its_data(door):
    """tritonserver passes the model's words with the data after them: the door moves the data to
    where gRPC carries it, on a unary call; a stream's error keeps it after the words."""
    with pytest.raises(grpc.RpcError) as info:
        door.ModelInfer(_text_request([2, 1], _bytes(b"hello", b"")), timeout=60)
    details = info.value.details()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and MARK not in details, details
    data = data_from_json(dict(info.value.trailing_metadata() or ())[ERROR_METADATA], details)
    assert data is not None and data.code == INVALID and data.field == "TEXT[1]", (details, data)
    answers = list(door.ModelStreamInfer(iter([_text_request([2, 1], _bytes(b"hello", b""))]), timeout=60))
    streamed = parse_error(answers[0].error_message)
    assert streamed is not None and (streamed.code, streamed.field) == (data.code, data.field), answers[0].error_message


def test_a_declared_shape_that_is_not_the_data_is_refused(door):
    # The second defect: 2^32 + 1 rows declared, one string sent, used to answer [1, 384].
    for shape in ([2**32 + 1, 1], [2305843009213693953, 1], [3, 1]):
        with pytest.raises(grpc.RpcError) as info:
            door.ModelInfer(_text_request(shape, _bytes(b"hello")), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, shape
        assert "'TEXT'" in info.value.details()


@pytest.mark.parametrize("case", ["junk_prefix", "wrong_datatype", "unknown_input", "typed_count"])
def test_malformed_requests_are_invalid_argument_naming_the_field(door, case):
    if case == "junk_prefix":
        req = _text_request([1, 1], struct.pack("<I", 1 << 30) + b"abc")
    elif case == "wrong_datatype":
        req = _text_request([1, 1], b"\0" * 8, datatype="INT64")
    elif case == "unknown_input":
        req = _text_request([1, 1], _bytes(b"x"))
        req.inputs[0].name = "NOT_AN_INPUT"
    else:
        req = service_pb2.ModelInferRequest(model_name="text_embedding")
        t = req.inputs.add(name="TEXT", datatype="BYTES")
        t.shape.extend([4, 1])
        t.contents.bytes_contents.append(b"one")
    with pytest.raises(grpc.RpcError) as info:
        door.ModelInfer(req, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "TEXT" in info.value.details() or "NOT_AN_INPUT" in info.value.details()


def test_every_fixed_size_input_of_every_loaded_model_refuses_a_wrapping_byte_count(triton, door):
    loaded = {
        m.name
        for m in door.RepositoryIndex(
            service_pb2.RepositoryIndexRequest(ready=True),
            timeout=30,
            metadata=[(GRPC_TOKEN_HEADER, triton.options.repository_token)],
        ).models
    }
    limits = model_limits(triton.options.model_repository)
    sizes = {"INT64": 8, "INT32": 4, "FP32": 4, "FP16": 2, "UINT8": 1, "BOOL": 1}
    attacked = 0
    before = _live_stubs(triton)
    for model in sorted(loaded & set(limits)):
        spec = limits[model]
        for name, s in spec["inputs"].items():
            if s["datatype"] not in sizes:
                continue
            size = sizes[s["datatype"]]
            dims = [1] * len(s["dims"])
            dims[-1] = min((2**64 + 16) // size, 2**63 - 1)
            req = service_pb2.ModelInferRequest(model_name=model)
            t = req.inputs.add(name=name, datatype=s["datatype"])
            t.shape.extend(([1] if spec["max_batch_size"] > 0 else []) + dims)
            req.raw_input_contents.append(b"\0" * 16)
            if spec["decoupled"]:
                answers = list(door.ModelStreamInfer(iter([req]), timeout=60))
                assert answers and answers[0].error_message, (model, name)
            else:
                with pytest.raises(grpc.RpcError) as info:
                    door.ModelInfer(req, timeout=60)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (model, name, info.value.details())
            attacked += 1
    assert attacked >= 3  # text_encoder's two inputs, image_classifier's pixels, generation's flags
    _every_model_answers(door)
    assert _live_stubs(triton) == before


def test_a_stream_goes_on_after_a_refused_request(door):
    bad = _text_request([2**32 + 1, 1], _bytes(b"x"))
    bad.id = "bad-one"
    good = _text_request([1, 1], _bytes(b"a good text"))
    good.id = "good-one"
    answers = list(door.ModelStreamInfer(iter([bad, good, bad]), timeout=60))
    assert len(answers) == 3
    errors = [a for a in answers if a.error_message]
    assert len(errors) == 2 and all(a.infer_response.id == "bad-one" for a in errors)
    ok = [a for a in answers if not a.error_message]
    assert ok[0].infer_response.id == "good-one" and ok[0].infer_response.outputs


def test_model_infer_of_a_decoupled_model_is_invalid_argument(triton, door):
    if "text_generation" not in triton.options.models:
        pytest.skip("text_generation is not loaded")
    req = service_pb2.ModelInferRequest(model_name="text_generation")
    t = req.inputs.add(name="text_input", datatype="BYTES")
    t.shape.extend([1])
    req.raw_input_contents.append(_bytes(b"hello"))
    with pytest.raises(grpc.RpcError) as info:
        door.ModelInfer(req, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ModelStreamInfer" in info.value.details()


def test_other_rpcs_pass_through_with_metadata_and_status(triton, door):
    assert door.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live
    assert door.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
    assert door.ModelReady(service_pb2.ModelReadyRequest(name="text_embedding"), timeout=10).ready
    meta = door.ModelMetadata(service_pb2.ModelMetadataRequest(name="text_embedding"), timeout=10)
    assert [i.name for i in meta.inputs] == ["TEXT", "TRUNCATE", "TRUNCATION_DIRECTION"]
    with pytest.raises(grpc.RpcError) as info:
        door.ModelMetadata(service_pb2.ModelMetadataRequest(name="no_such_model"), timeout=10)
    assert info.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT)
    # Metadata goes on (the repository token's refusal and acceptance through the door are in
    # test_rollout.py, whose server has a token).
    index = door.RepositoryIndex(
        service_pb2.RepositoryIndexRequest(ready=True),
        timeout=10,
        metadata=[(GRPC_TOKEN_HEADER, triton.options.repository_token)],
    )
    assert "text_embedding" in {m.name for m in index.models}


def test_http_binary_tensors_with_a_wrapping_shape_are_refused(triton):
    header = json.dumps(
        {
            "inputs": [
                {"name": n, "datatype": "INT64", "shape": [1, WRAP_INT64], "parameters": {"binary_data_size": 128}}
                for n in ("input_ids", "attention_mask")
            ]
        }
    ).encode()
    body = header + np.ones(32, np.int64).tobytes()
    request = urllib.request.Request(
        f"http://{triton.http_url}/v2/models/text_encoder/infer",
        data=body,
        method="POST",
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    try:
        urllib.request.urlopen(request, timeout=30)
        status, answer = 200, b""
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, exc.read()
    assert status == 400 and b"input_ids" in answer, (status, answer[:300])


def test_a_door_that_exits_is_started_again_within_a_second_or_two(triton):
    import os
    import signal
    import time

    old = triton.grpc_door.process
    os.kill(old.pid, signal.SIGKILL)
    old.wait()
    deadline = time.monotonic() + 10
    while True:
        channel = grpc.insecure_channel(triton.grpc_url)
        try:
            live = service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(service_pb2.ServerLiveRequest(), timeout=2).live
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "no gRPC door 10 s after the last one was killed"
            time.sleep(0.2)
        finally:
            channel.close()
    assert live and triton.grpc_door.process.pid != old.pid
    # The new door checks as the old one did.
    channel = grpc.insecure_channel(triton.grpc_url)
    try:
        with pytest.raises(grpc.RpcError) as info:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(_wrapping_encoder_request(), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
