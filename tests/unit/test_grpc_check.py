"""server.grpc_check: the gRPC front door's header check, on real ModelInferRequest messages."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from server.frontdoor import model_limits
from server.grpc_check import Limits, check_request, count_bytes_elements
from server.layout import ROOT

LIMITS = Limits(models=model_limits(ROOT / "model_repository"), max_elements=64 << 20)
WRAP_INT64 = 2**61 + 16  # x 8 bytes = 2^64 + 128: wraps to 128 bytes in 64-bit arithmetic


def _request(model: str, *inputs) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, shape, raw in inputs:
        t = req.inputs.add(name=name, datatype=datatype)
        t.shape.extend(shape)
        if raw is not None:
            req.raw_input_contents.append(raw)
    return req


def _bytes(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def _encoder(shape, raw_len=None, datatype="INT64"):
    values = np.ones(int(np.prod(shape)) if raw_len is None else raw_len, np.int64).tobytes()
    return _request("text_encoder", ("input_ids", datatype, shape, values), ("attention_mask", datatype, shape, values))


def test_a_valid_request_passes():
    assert check_request(_encoder([2, 8]), LIMITS, stream=False) is None
    assert check_request(_request("text_embedding", ("TEXT", "BYTES", [2, 1], _bytes(b"a", b"bc"))), LIMITS, stream=False) is None


def test_the_wrapping_shape_of_the_issue_is_refused_naming_the_input_and_the_limit():
    refusal = check_request(_encoder([1, WRAP_INT64], raw_len=16), LIMITS, stream=False)
    assert refusal is not None and refusal.rule == "elements"
    assert "'input_ids'" in refusal.message and str(WRAP_INT64) in refusal.message and str(64 << 20) in refusal.message


SIZES = {"INT64": 8, "FP32": 4, "INT32": 4, "FP16": 2, "UINT8": 1, "BOOL": 1}
FIXED_SIZE_MODELS = sorted(m for m, spec in LIMITS.models.items() if any(s["datatype"] in SIZES for s in spec["inputs"].values()))


def test_the_repository_has_fixed_size_inputs_to_attack():
    assert {"text_encoder", "image_classifier"} <= set(FIXED_SIZE_MODELS)


@pytest.mark.parametrize("model", FIXED_SIZE_MODELS)
def test_every_fixed_size_input_of_every_model_refuses_a_byte_count_that_wraps(model):
    spec = LIMITS.models[model]
    sizes = SIZES
    fixed = [(n, s) for n, s in spec["inputs"].items() if s["datatype"] in sizes]
    for name, s in fixed:
        size = sizes[s["datatype"]]
        batched = spec["max_batch_size"] > 0
        # a last dim whose product with the element size is 2^64 + 16 bytes: wraps to 16
        dims = [1] * len(s["dims"])
        # (one-byte types cannot wrap with one int64 dim: the largest dim stands in)
        dims[-1] = min((2**64 + 16) // size, 2**63 - 1)
        shape = ([1] if batched else []) + dims
        req = _request(model, (name, s["datatype"], shape, b"\0" * 16))
        refusal = check_request(req, LIMITS, stream=spec["decoupled"])
        assert refusal is not None, (model, name)
        assert refusal.rule in ("elements", "dim", "rank"), refusal


def test_a_declared_batch_that_is_not_the_data_is_refused():
    # 2^32 + 1 rows declared, one string sent: tritonserver truncates the batch to 32 bits
    big = _request("text_embedding", ("TEXT", "BYTES", [2**32 + 1, 1], _bytes(b"hello")))
    assert check_request(big, LIMITS, stream=False).rule == "batch"
    # a batch within the limit, but more rows declared than sent
    short = _request("text_embedding", ("TEXT", "BYTES", [3, 1], _bytes(b"hello")))
    refusal = check_request(short, LIMITS, stream=False)
    assert refusal.rule == "data_size" and "holds 1 BYTES elements" in refusal.message
    fixed = _encoder([2, 8], raw_len=15)
    refusal = check_request(fixed, LIMITS, stream=False)
    assert refusal.rule == "data_size" and "holds 120 bytes" in refusal.message and "needs 128" in refusal.message


def test_typed_contents_must_match_the_shape_and_the_datatype():
    req = service_pb2.ModelInferRequest(model_name="text_embedding")
    t = req.inputs.add(name="TEXT", datatype="BYTES")
    t.shape.extend([2, 1])
    t.contents.bytes_contents.append(b"one")
    refusal = check_request(req, LIMITS, stream=False)
    assert refusal.rule == "data_size" and "bytes_contents holds 1 elements" in refusal.message
    t.contents.bytes_contents.append(b"two")
    assert check_request(req, LIMITS, stream=False) is None
    enc = service_pb2.ModelInferRequest(model_name="text_encoder")
    for name in ("input_ids", "attention_mask"):
        e = enc.inputs.add(name=name, datatype="INT64")
        e.shape.extend([1, 2])
        e.contents.fp32_contents.extend([1.0, 2.0])
    refusal = check_request(enc, LIMITS, stream=False)
    assert refusal.rule == "datatype" and "contents.int64_contents" in refusal.message


def test_junk_bytes_prefixes_are_refused():
    junk = struct.pack("<I", 2**31) + b"abc"
    refusal = check_request(_request("text_embedding", ("TEXT", "BYTES", [1, 1], junk)), LIMITS, stream=False)
    assert refusal.rule == "bytes_prefix" and "runs past the end" in refusal.message
    assert count_bytes_elements(b"\x01\x00", "x").rule == "bytes_prefix"
    assert count_bytes_elements(_bytes(b"", b"x", b"yz"), "x") == 3


@pytest.mark.parametrize(
    "case, rule",
    [
        ("wrong_datatype", "datatype"),
        ("unknown_input", "name"),
        ("rank", "rank"),
        ("negative_dim", "dim"),
        ("fixed_dim", "dim"),
        ("zero_batch", "batch"),
        ("duplicate", "name"),
        ("raw_count", "data"),
        ("no_data", "data"),
        ("unknown_datatype", "datatype"),
        ("too_many_dims", "rank"),
    ],
)
def test_each_malformed_header_gets_one_refusal_naming_the_field(case, rule):
    one = _bytes(b"x")
    img = np.zeros((1, 3, 224, 224), np.float32).tobytes()
    requests = {
        "wrong_datatype": _request("text_embedding", ("TEXT", "INT64", [1, 1], b"\0" * 8)),
        "unknown_input": _request("text_embedding", ("NOPE", "BYTES", [1, 1], one)),
        "rank": _request("text_embedding", ("TEXT", "BYTES", [1], one)),
        "negative_dim": _request("text_embedding", ("TEXT", "BYTES", [1, -1], one)),
        "fixed_dim": _request("image_classifier", ("pixel_values", "FP32", [1, 3, 224, 225], img)),
        "zero_batch": _request("text_embedding", ("TEXT", "BYTES", [0, 1], b"")),
        "duplicate": _request("text_embedding", ("TEXT", "BYTES", [1, 1], one), ("TEXT", "BYTES", [1, 1], one)),
        "raw_count": _request("text_embedding", ("TEXT", "BYTES", [1, 1], one), ("EXTRA", "BYTES", [1, 1], None)),
        "no_data": _request("text_embedding", ("TEXT", "BYTES", [1, 1], None)),
        "unknown_datatype": _request("text_embedding", ("TEXT", "STRING", [1, 1], one)),
        "too_many_dims": _request("unknown_model", ("x", "INT8", [1] * 17, b"\0")),
    }
    if case == "fixed_dim" and "pixel_values" not in LIMITS.models.get("image_classifier", {}).get("inputs", {}):
        pytest.skip("image_classifier's input is not pixel_values in this repository")
    refusal = check_request(requests[case], LIMITS, stream=False)
    assert refusal is not None and refusal.rule == rule, refusal
    assert refusal.field and refusal.field.split(".")[0].split("[")[0] in refusal.message


def test_unknown_models_get_the_global_checks_only():
    ok = _request("no_such_model", ("x", "INT64", [2, 3], b"\0" * 48))
    assert check_request(ok, LIMITS, stream=False) is None
    wrapped = _request("no_such_model", ("x", "INT64", [1, WRAP_INT64], b"\0" * 128))
    assert check_request(wrapped, LIMITS, stream=False).rule == "elements"


def test_a_decoupled_model_is_refused_on_model_infer_and_checked_on_the_stream():
    decoupled = [m for m, spec in LIMITS.models.items() if spec["decoupled"]]
    if not decoupled:
        pytest.skip("no decoupled model in this repository")
    model = decoupled[0]
    name = next(iter(LIMITS.models[model]["inputs"]))
    spec = LIMITS.models[model]["inputs"][name]
    shape = ([1] if LIMITS.models[model]["max_batch_size"] > 0 else []) + [max(d, 1) for d in spec["dims"]]
    req = _request(model, (name, spec["datatype"], shape, _bytes(b"hi")))
    assert check_request(req, LIMITS, stream=False).rule == "decoupled"
    assert check_request(req, LIMITS, stream=True) is None


def test_shared_memory_inputs_are_checked_on_their_declared_byte_size():
    req = service_pb2.ModelInferRequest(model_name="text_encoder")
    for name in ("input_ids", "attention_mask"):
        t = req.inputs.add(name=name, datatype="INT64")
        t.shape.extend([1, 4])
        t.parameters["shared_memory_region"].string_param = "region"
        t.parameters["shared_memory_byte_size"].int64_param = 32
    assert check_request(req, LIMITS, stream=False) is None
    req.inputs[1].parameters["shared_memory_byte_size"].int64_param = 16
    refusal = check_request(req, LIMITS, stream=False)
    assert refusal.rule == "data_size" and "needs 32 bytes" in refusal.message


@pytest.mark.parametrize("datatype, size", [("INT64", 8), ("FP32", 4), ("FP16", 2), ("UINT8", 1)])
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_the_fuzzers_wrapping_shapes_wrap_and_are_refused(datatype, size, rank):
    from tests.fuzz.cases import wrapping_shape

    shape = wrapping_shape(rank, 16, size)
    assert len(shape) == rank and all(0 < d < 2**63 for d in shape)
    elements = int(np.prod(np.array(shape, dtype=object)))
    if size > 2 or rank > 1:  # (one int64 dim cannot reach 2^63 + 16 elements)
        assert (elements * size) % 2**64 == 16 * size  # tritonserver's 64-bit check would pass it
    req = _request("unknown_model", ("x", datatype, shape, b"\0" * (16 * size)))
    assert check_request(req, LIMITS, stream=False).rule == "elements"
