"""Hostile inference requests through the front door (HTTP, binary HTTP, gRPC raw and typed,
gRPC streaming): each is refused with 4xx / INVALID_ARGUMENT naming the field, none is a 5xx,
and afterwards the server is live and answers a normal request correctly.

Without the front door, the first request below aborts tritonserver 2.51 (std::bad_alloc) and
the BYTES ones with a batch of 2^40 are answered (the batch-size check truncates to 32 bits).
"""

from __future__ import annotations

import concurrent.futures
import json
import struct
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from contract.errors import INVALID, MARK, data_from_body
from tests.integration.conftest import unload_and_wait

HUGE = 1 << 40  # 1099511627776
MODEL = "text_embedding"


def _post(url: str, body: bytes, headers: dict | None = None, path: str = f"/v2/models/{MODEL}/infer"):
    req = urllib.request.Request(f"http://{url}{path}", data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _json(inputs) -> bytes:
    return json.dumps({"inputs": inputs}).encode()


def _text(shape, datatype="BYTES", data=("a",)):
    return [{"name": "TEXT", "shape": shape, "datatype": datatype, "data": list(data) if isinstance(data, tuple) else data}]


def _binary(header: dict, payload: bytes, length_lie: int = 0):
    head = json.dumps(header).encode()
    return head + payload, {
        "Inference-Header-Content-Length": str(len(head) + length_lie),
        "Content-Type": "application/octet-stream",
    }


ONE = struct.pack("<I", 1) + b"a"

JSON_CASES = {
    # (body, the field the error must name)
    "int64_huge_shape_crashes_triton": (_json(_text([HUGE, 1], "INT64", (1,))), "datatype"),
    "bytes_huge_batch_overflows": (_json(_text([HUGE, 1])), "shape[0]"),
    "bytes_batch_2_32_plus_1": (_json(_text([(1 << 32) + 1, 1])), "shape[0]"),
    "null_shape": (_json(_text(None)), "shape"),
    "shape_of_strings": (_json(_text(["1", 1])), "shape[0]"),
    "negative_shape": (_json(_text([-1, 1])), "shape[0]"),
    "unknown_datatype": (_json(_text([1, 1], "FOO")), "datatype"),
    "wrong_datatype": (_json(_text([1, 1], "FP32", (1.0,))), "datatype"),
    "data_object": (_json(_text([1, 1], data={"a": 1})), "data"),
    "data_number_for_bytes": (_json(_text([1, 1], data=(1,))), "data"),
    "shape_bigger_than_data": (_json(_text([3, 1])), "data"),
    "data_bigger_than_shape": (_json(_text([1, 1], data=("a", "b"))), "data"),
    "huge_inner_dim": (_json(_text([1, HUGE])), "shape"),
    "inputs_not_array": (json.dumps({"inputs": {"TEXT": 1}}).encode(), "inputs"),
    "not_json": (b"{not json", "JSON"),
    # A model the repository does not hold: the global bound and the data count still apply.
    "unknown_model_huge_int64": (_json([{"name": "X", "shape": [HUGE], "datatype": "INT64", "data": [1]}]), "shape"),
}


def _with(parameters=None, outputs=None) -> bytes:
    body = {"inputs": _text([1, 1])}
    if parameters is not None:
        body["parameters"] = parameters
    if outputs is not None:
        body["outputs"] = outputs
    return json.dumps(body).encode()


# Found by tests.fuzz: parameters tritonserver 2.51 parses with a fixed JSON type are a 500 there
# ("Unable to parse 'priority': attempt to access JSON non-unsigned-integer as unsigned-integer").
JSON_CASES.update(
    {
        # A lone surrogate escape: tritonserver's JSON parser answers 500 ("The surrogate pair in
        # string is invalid").
        "lone_surrogate_in_data": (_json(_text([1, 1], data=("a\udcff",))), "'data'"),
        "lone_surrogate_in_a_name": (_json([{"name": "\ud800", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]}]), "'name'"),
        "lone_surrogate_in_a_key": (
            b'{"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["a"], "\\udcff": 1}]}',
            "a key",
        ),
        "priority_negative": (_with({"priority": -1}), "priority"),
        "priority_string": (_with({"priority": "interactive"}), "priority"),
        "priority_over_2_64": (_with({"priority": 1 << 64}), "priority"),
        "timeout_float": (_with({"timeout": 1.5}), "timeout"),
        "sequence_id_negative": (_with({"sequence_id": -1}), "sequence_id"),
        "sequence_start_number": (_with({"sequence_start": 1}), "sequence_start"),
        "binary_data_output_string": (_with({"binary_data_output": "x"}), "binary_data_output"),
        "output_binary_data_number": (_with(outputs=[{"name": "EMBEDDING", "parameters": {"binary_data": 1}}]), "binary_data"),
        "output_classification_negative": (
            _with(outputs=[{"name": "EMBEDDING", "parameters": {"classification": -1}}]),
            "classification",
        ),
        "output_shared_memory_region_number": (
            _with(outputs=[{"name": "EMBEDDING", "parameters": {"shared_memory_region": 1}}]),
            "shared_memory_region",
        ),
    }
)


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_malformed_json_request_is_refused_with_400_naming_the_field(triton, case):
    body, field = JSON_CASES[case]
    path = "/v2/models/no_such_model/infer" if case.startswith("unknown_model") else f"/v2/models/{MODEL}/infer"
    status, answer = _post(triton.http_url, body, path=path)
    assert status == 400, (status, answer[:300])
    assert field in json.loads(answer)["error"], answer


@pytest.mark.parametrize("case", ["bytes_huge_batch_overflows", "wrong_datatype", "data_bigger_than_shape", "inputs_not_array"])
def test_the_front_doors_refusal_carries_its_code_and_field_as_data(triton, case):
    """As the models' errors and the gRPC door's refusals do (contract/errors.py): the body's own keys."""
    body, field = JSON_CASES[case]
    status, answer = _post(triton.http_url, body)
    data = data_from_body(json.loads(answer))
    assert data is not None and MARK not in data.message, answer
    assert (data.code, data.values, data.http_status) == (INVALID, {"status": 400}, status), answer
    assert data.field is not None and field in data.field and field in data.message, answer


def test_a_models_error_through_the_front_door_carries_its_data_as_the_bodys_keys(triton):
    """tritonserver passes the model's words with the data after them; the front door moves the data
    into the body's keys (deploy/frontdoor/infer_check.js: errorBody) and leaves the words alone."""
    status, answer = _post(triton.http_url, _json(_text([2, 1], data=("hello", ""))))
    body = json.loads(answer)
    assert status == 400 and MARK not in body["error"] and body["error"].endswith("TEXT[1]: text is empty"), answer
    data = data_from_body(body)
    assert data is not None and (data.code, data.field, data.http_status) == (INVALID, "TEXT[1]", status), answer


BINARY_CASES = {
    "bytes_huge_batch": (
        _binary(
            {"inputs": [{"name": "TEXT", "shape": [HUGE, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(ONE)}}]},
            ONE,
        ),
        "shape[0]",
    ),
    "size_runs_past_body": (
        _binary(
            {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": 100}}]}, ONE
        ),
        "binary_data_size",
    ),
    "bytes_count_mismatch": (
        _binary(
            {"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(ONE)}}]},
            ONE,
        ),
        "elements",
    ),
    "prefix_past_end": (
        _binary(
            {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": 5}}]},
            struct.pack("<I", 99) + b"a",
        ),
        "runs past",
    ),
    "int64_huge": (
        _binary(
            {"inputs": [{"name": "X", "shape": [HUGE], "datatype": "INT64", "parameters": {"binary_data_size": 8}}]}, b"\0" * 8
        ),
        "elements",
    ),
    "header_length_past_body": (_binary({"inputs": []}, b"", length_lie=1000), "Inference-Header-Content-Length"),
    "trailing_bytes": (
        _binary(
            {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(ONE)}}]},
            ONE + b"xx",
        ),
        "body length",
    ),
}


@pytest.mark.parametrize("case", sorted(BINARY_CASES))
def test_malformed_binary_request_is_refused_with_400(triton, case):
    (body, headers), field = BINARY_CASES[case]
    status, answer = _post(triton.http_url, body, headers)
    assert status == 400, (status, answer[:300])
    assert field in json.loads(answer)["error"], answer


def test_compressed_and_oversized_bodies_are_refused(triton):
    status, answer = _post(triton.http_url, b"\x1f\x8b", {"Content-Encoding": "gzip"})
    assert status == 415 and b"Content-Encoding" in answer
    big = _json(_text([1, 1], data=("x" * (triton.options.max_body_bytes + 10),)))
    status, answer = _post(triton.http_url, big)
    assert status == 413, answer[:200]


def test_valid_typed_parameters_still_pass(triton):
    body = _with(
        {"priority": 0, "timeout": 0, "sequence_id": "abc", "binary_data_output": False},
        [{"name": "EMBEDDING", "parameters": {"binary_data": False}}],
    )
    status, answer = _post(triton.http_url, body)
    assert status == 200, answer[:300]


GENERATION = "text_generation"
GENERATE_CASES = {
    # (path, body, the field the error must name); each was a 5xx (or 501) from tritonserver 2.51.
    "infer_on_a_decoupled_model": (
        "infer",
        _json([{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]),
        "generate_stream",
    ),
    "nul_in_a_key": ("generate", json.dumps({"text_input": "hi", "a\u0000b": 1}).encode(), "NUL"),
    "nul_in_a_parameter_name": ("generate", json.dumps({"text_input": "hi", "parameters": {"x\u0000": 1}}).encode(), "NUL"),
    "priority_negative": ("generate", json.dumps({"text_input": "hi", "parameters": {"priority": -1}}).encode(), "priority"),
    "lone_surrogate_names_its_key": ("generate", b'{"text_input": "a\\udcff"}', "text_input"),
    # The model's own refusal (INVALID_ARG); it named no field for an empty key.
    "empty_sampling_parameter_name": (
        "generate",
        json.dumps({"text_input": "hi", "sampling_parameters": '{"": 1}'}).encode(),
        "'': unknown sampling parameter",
    ),
}


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_generation_endpoints_refuse_what_tritonserver_would_fail_on(triton, case):
    if GENERATION not in triton.options.models:
        pytest.skip(f"{GENERATION} is not served by this session's server")
    path, body, field = GENERATE_CASES[case]
    status, answer = _post(triton.http_url, body, path=f"/v2/models/{GENERATION}/{path}")
    assert status == 400, (status, answer[:300])
    assert field in json.loads(answer)["error"], answer


def _grpc_request(shape, typed: bool, datatype="BYTES", model=MODEL):
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="TEXT", datatype=datatype, shape=shape)
    if typed:
        tensor.contents.bytes_contents.append(b"a")
    else:
        request.raw_input_contents.append(ONE)
    return request


# Each gRPC case runs through the gRPC front door (server/grpc_door.py, the public port), which
# refuses it naming the shape, and on tritonserver's own internal port, where the models' own
# checks (python_backends/shim.py check_shape) must refuse it too: defence in depth.
WHERE = {"door": "(batch) must be between 1 and max_batch_size", "direct": "dimensions"}


@pytest.fixture(scope="module", params=sorted(WHERE))
def grpc_stub(request, triton):
    channel = grpc.insecure_channel(triton.grpc_url if request.param == "door" else triton.triton_grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    stub.where, stub.refusal = request.param, WHERE[request.param]
    yield stub
    channel.close()


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
@pytest.mark.parametrize("model", ["text_embedding_cached", "text_tokenizer"])
def test_grpc_huge_batch_is_invalid_argument(grpc_stub, typed, model):
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.ModelInfer(_grpc_request([HUGE, 1], typed, model=model), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "TEXT" in info.value.details() and grpc_stub.refusal in info.value.details()


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
def test_grpc_huge_batch_to_the_ensemble_is_refused_by_the_door_and_computes_only_the_rows_sent_direct(grpc_stub, typed):
    request = _grpc_request([HUGE, 1], typed)
    if grpc_stub.where == "door":
        # The door checks the ensemble's own config (max_batch_size 64, server/frontdoor.model_limits).
        with pytest.raises(grpc.RpcError) as info:
            grpc_stub.ModelInfer(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "TEXT" in info.value.details() and grpc_stub.refusal in info.value.details()
        return
    # Known limit (docs/security.md): tritonserver's batch check truncates 2^40 to 32 bits, and the
    # ensemble hands its steps a well-formed one-row request, so no model can see the 2^40; what
    # matters is that nothing beyond the data sent is computed: one row, one vector.
    answer = grpc_stub.ModelInfer(request, timeout=60)
    embedding = next(i for i, o in enumerate(answer.outputs) if o.name == "EMBEDDING")
    assert len(answer.raw_output_contents[embedding]) == 384 * 4


def test_grpc_int64_huge_shape_is_invalid_argument(grpc_stub):
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="TEXT", datatype="INT64", shape=[HUGE, 1]).contents.int64_contents.append(1)
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_stream_huge_batch_is_an_error_response(grpc_stub):
    requests = [_grpc_request([HUGE, 1], typed, model="text_tokenizer") for typed in (False, True)]
    answers = list(grpc_stub.ModelStreamInfer(iter(requests), timeout=60))
    assert len(answers) == 2
    assert all(grpc_stub.refusal in a.error_message for a in answers), [a.error_message for a in answers]


@pytest.fixture(scope="module")
def loaded_router(http_client):
    """text_encoder_router is on the request path only while a rollout runs
    (docs/versions-and-rollout.md): loaded at the first test that asks for it, unloaded after the
    module (a load and an unload cost about 4 s, and four tests ask)."""
    http_client.load_model("text_encoder_router")
    try:
        yield "text_encoder_router"
    finally:
        unload_and_wait(http_client, "text_encoder_router")


@pytest.fixture
def encoder_model(request):
    """The parametrized model, ready (text_encoder_router: loaded_router)."""
    return request.getfixturevalue("loaded_router") if request.param == "text_encoder_router" else request.param


@pytest.mark.parametrize("encoder_model", ["text_encoder", "text_encoder_router"], indirect=True)
def test_encoder_refuses_truncated_batch_over_grpc(grpc_stub, encoder_model):
    model = encoder_model
    request = service_pb2.ModelInferRequest(model_name=model)
    for name in ("input_ids", "attention_mask"):
        request.inputs.add(name=name, datatype="INT64", shape=[HUGE, 16])
        request.raw_input_contents.append(np.ones(16, np.int64).tobytes())
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.ModelInfer(request, timeout=60)
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,), info.value.details()


@pytest.mark.parametrize("encoder_model", ["text_encoder", "text_encoder_router"], indirect=True)
def test_an_empty_sequence_is_invalid_argument_naming_the_input(triton, grpc_stub, encoder_model):
    # Found by tests.fuzz: a [1, 0] input_ids / attention_mask failed inside the encoder (HTTP 500;
    # through the router 503).
    model = encoder_model
    inputs = [{"name": n, "shape": [1, 0], "datatype": "INT64", "data": []} for n in ("input_ids", "attention_mask")]
    status, answer = _post(triton.http_url, _json(inputs), path=f"/v2/models/{model}/infer")
    assert status == 400 and "input_ids" in json.loads(answer)["error"], (status, answer[:300])
    request = service_pb2.ModelInferRequest(model_name=model)
    for name in ("input_ids", "attention_mask"):
        request.inputs.add(name=name, datatype="INT64", shape=[1, 0])
        request.raw_input_contents.append(b"")
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids" in info.value.details()


def _embed_ok(url: str, text="hello world"):
    status, answer = _post(url, _json(_text([1, 1], data=(text,))))
    assert status == 200, answer[:300]
    out = next(o for o in json.loads(answer)["outputs"] if o["name"] == "EMBEDDING")
    vector = np.array(out["data"], np.float32).reshape(out["shape"])
    assert vector.shape == (1, 384)
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-3
    return vector


def test_server_live_and_correct_after_hostile_requests_and_good_ones_answered_alongside(triton, http_client):
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"hello world"]], dtype=object))
    reference = http_client.infer(MODEL, [tensor]).as_numpy("EMBEDDING")  # binary path, tritonclient
    before = _embed_ok(triton.http_url)
    assert float(np.dot(reference[0], before[0])) > 0.9999
    bad = [body for body, _ in JSON_CASES.values()]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        hostile = [pool.submit(_post, triton.http_url, body) for body in bad * 3]
        good = [pool.submit(_embed_ok, triton.http_url) for _ in range(6)]
        statuses = [f.result()[0] for f in hostile]
        vectors = [f.result() for f in good]
    assert all(400 <= s < 500 for s in statuses), statuses
    for vector in vectors:
        assert float(np.dot(vector[0], before[0])) > 0.9999
    with urllib.request.urlopen(f"http://{triton.http_url}/v2/health/live", timeout=10) as r:
        assert r.status == 200
    assert triton.process.poll() is None, "tritonserver died"


# Fuzzing: arbitrary JSON-ish values in each field of an otherwise plausible request.
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 64), max_value=1 << 64)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=12,
)
_shapes = st.lists(st.integers(min_value=-2, max_value=1 << 62) | st.sampled_from([HUGE, 1 << 32, 0, 1, 2]), max_size=4)
_inputs = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["TEXT", "X", ""]) | _json_values,
        "shape": _shapes | _json_values,
        "datatype": st.sampled_from(["BYTES", "INT64", "FP32", "BOOL", "UINT8", "FOO"]) | _json_values,
        "data": st.lists(st.text(max_size=4) | st.integers(), max_size=4) | _json_values,
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    inputs=st.lists(_inputs, min_size=0, max_size=2) | _json_values,
    model=st.sampled_from([MODEL, "text_tokenizer", "text_encoder", "image_classification"]),
)
def test_fuzzed_http_requests_get_no_5xx(triton, inputs, model):
    status, answer = _post(triton.http_url, json.dumps({"inputs": inputs}).encode(), path=f"/v2/models/{model}/infer")
    assert status < 500, (status, answer[:300])
    assert triton.process.poll() is None, "tritonserver died"


def test_live_after_fuzzing(triton):
    _embed_ok(triton.http_url)
