"""Fuzz every served model's endpoints and the Python steps' decoding functions; count outcomes.

Three parts, one run (``make fuzz``; docs/fuzzing.md):

1. **Endpoints, property-based (hypothesis).** For every model the server serves (the entry
   points and each ensemble step: all are reachable on the public ports), requests built from
   the model's own config (``GET /v2/models/<m>/config``) with mutations drawn on top: shapes
   (negative, zero, 2^32 + 1, 2^40, 2^63, wrong rank, not integers, mismatched with the data),
   datatypes (wrong, unknown, not a string), binary junk, huge / empty / odd-Unicode strings
   (lone surrogates, NUL, RTL marks, combining marks, 4-byte emoji), batch sizes that differ
   across inputs, missing, extra and renamed inputs, bogus request parameters (Triton's
   priority, timeout, sequence_*, binary_data_output; routing_key, encoder_version,
   priority_class; the generation model's sampling parameters), bogus outputs, and malformed
   bodies. Sent over HTTP JSON, HTTP binary-tensor extension, HTTP generate (decoupled
   models), gRPC typed contents, gRPC raw_input_contents and gRPC streaming, through the front
   door (the public ports).
2. **The OpenAI gateway**: the schemathesis fuzz of tests/integration/test_openai_gateway_hostile.py,
   run against a gateway in front of the same server; its counts join the table.
3. **Decoding functions, coverage-guided (atheris)**: perf/fuzz/targets.py, each target in
   its own process.

Oracles: every HTTP answer is a 2xx or a 4xx whose message names the field a mutation
touched (gRPC: OK or a client-error code, the same naming); zero 5xx (gRPC INTERNAL,
UNKNOWN, UNIMPLEMENTED, DATA_LOSS or a non-transport UNAVAILABLE); zero dropped connections
(no answer); zero crashed python stubs (the PIDs of tritonserver's children before and after)
and tritonserver alive; afterwards every model answers a known-good request exactly as it
did before the run. The counts per endpoint and outcome are printed and written to
perf/results/fuzz-<stamp>/ (counts.json, findings.json with the first failing cases).

    python -m perf.fuzz                         # 10,000 endpoint cases + gateway + atheris
    python -m perf.fuzz --cases 600 --gateway-examples 0 --atheris-runs 300
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import io
import json
import os
import re
import secrets
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from contract.errors import parse_error
from contract.kserve import DATATYPE_SIZES
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.paths import ROOT

HUGE = 1 << 40

# KServe datatype -> numpy dtype and the gRPC typed-contents field.
NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
CONTENTS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
CONFIG_TYPES = {"TYPE_STRING": "BYTES", **{f"TYPE_{k}": k for k in NUMPY if k != "BYTES"}}

ODD_STRINGS = [
    "\u202eevil\u202c",
    "e\u0301\u0301\u0301",
    "\U0001f600\U0001f9d1\u200d\U0001f680",
    "a\x00b",
    "\x00",
    "\ufeff",
    "\u0000" * 3,
    "\U0010ffff",
    "\ud800",
    "x\udfffy",
    "\u200b",
    "Ω≈ç√∫",
    "\r\n\t",
    "🙂" * 50,
]
JUNK_BYTES = [
    b"\xff\xfe\x00",
    b"\x00" * 16,
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff" + b"\x00" * 40,
    b"GIF89a",
    b"RIFF\x00\x00\x00\x00WEBP",
    b"BM\x00\x00",
]
BAD_DIMS = [-1, -(1 << 40), 0, (1 << 32) + 1, HUGE, (1 << 63) - 1, 1 << 63, 1 << 64]
# Request parameters and bogus values for them; the message must name the parameter.
PARAMETERS = [
    "priority",
    "timeout",
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "binary_data_output",
    "routing_key",
    "encoder_version",
    "priority_class",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "logit_bias",
    "logprobs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "stream",
    "triton_x",
]
BOGUS_VALUES = [
    -1,
    -(1 << 63),
    1 << 64,
    1.5,
    -0.0,
    1e308,
    "x",
    "",
    "\ud800",
    "interactive",
    "bulk",
    "🙂",
    True,
    False,
    None,
    [],
    [1, "a"],
    {"a": 1},
    {"49152": 5},
    {"1": 1e300},
    "9" * 40,
    0,
]
GRPC_SERVER_ERRORS = {"INTERNAL", "UNKNOWN", "UNIMPLEMENTED", "DATA_LOSS"}
GRPC_TRANSPORT = (
    "failed to connect",
    "socket closed",
    "connection reset",
    "connect failed",
    "stream removed",
    "broken pipe",
    "goaway",
    "end of tcp stream",
    "recvmsg",
)


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    dims: tuple
    optional: bool = False


@dataclass(frozen=True)
class ModelSpec:
    name: str
    max_batch_size: int
    inputs: tuple
    outputs: tuple
    decoupled: bool = False

    @classmethod
    def from_config(cls, config: dict) -> ModelSpec:
        def dims(t):
            return tuple(int(d) for d in t.get("dims", []))

        inputs = tuple(
            InputSpec(t["name"], CONFIG_TYPES.get(t["data_type"], t["data_type"]), dims(t), bool(t.get("optional", False)))
            for t in config.get("input", [])
        )
        outputs = tuple(t["name"] for t in config.get("output", []))
        decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        return cls(config["name"], int(config.get("max_batch_size", 0)), inputs, outputs, decoupled)


# ---- valid values, per input, from the config -------------------------------------------


def _tiny_jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.arange(48 * 40 * 3) % 251).astype(np.uint8).reshape(40, 48, 3)).save(buf, "JPEG")
    return buf.getvalue()


TEXTS = ["hello world", "The server keeps answering good requests.", "Ça va? Привет! 你好 🙂", "a"]
_JPEG: list[bytes] = []


def valid_values(spec: InputSpec, rows: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """Well-formed values for one input (without the batch axis when rows == 0)."""
    dims = [seq if d < 0 else d for d in spec.dims]
    shape = ([rows] if rows else []) + dims
    count = int(np.prod(shape)) if shape else 1
    if spec.datatype == "BYTES":
        if spec.name == "IMAGE":
            if not _JPEG:
                _JPEG.append(_tiny_jpeg())
            flat = [_JPEG[0]] * count
        elif spec.name == "sampling_parameters":
            flat = [b'{"max_tokens": 1, "temperature": 0}'] * count
        else:
            flat = [TEXTS[int(rng.integers(len(TEXTS)))].encode() for _ in range(count)]
        out = np.empty(count, dtype=object)
        out[:] = flat
        return out.reshape(shape)
    if spec.datatype == "BOOL":
        return np.zeros(shape, dtype=bool)
    if spec.name == "input_ids":
        ids = rng.integers(1000, 5000, size=shape).astype(np.int64)
        if ids.ndim == 2 and ids.shape[1]:
            ids[:, 0], ids[:, -1] = 101, 102
        return ids
    if spec.name == "attention_mask":
        return np.ones(shape, dtype=np.int64)
    return (
        rng.standard_normal(shape).astype(NUMPY[spec.datatype])
        if spec.datatype.startswith("FP")
        else np.ones(shape, dtype=NUMPY.get(spec.datatype, np.int64))
    )


# ---- the abstract request and its mutations ---------------------------------------------

NOJUNK = object()


@dataclass
class Tensor:
    name: Any
    datatype: Any
    shape: Any
    values: np.ndarray  # every Tensor is built with its values (base_request, the "extra" mutation)
    junk: Any = NOJUNK  # replaces the data as sent (a JSON value, or bytes for binary and gRPC)


@dataclass
class Request:
    model: ModelSpec
    inputs: list[Tensor]
    parameters: dict = field(default_factory=dict)
    outputs: list | None = None
    names: set = field(default_factory=set)  # what an error message may name
    mutations: list = field(default_factory=list)
    body_damage: tuple | None = None  # (offset fraction, bytes) spliced into the encoded body
    header_lie: int = 0  # added to Inference-Header-Content-Length

    def describe(self) -> dict:
        return {
            "model": self.model.name,
            "mutations": self.mutations,
            "inputs": [
                {
                    "name": _short(t.name),
                    "datatype": _short(t.datatype),
                    "shape": _short(t.shape),
                    "junk": _short(t.junk) if t.junk is not NOJUNK else None,
                }
                for t in self.inputs
            ],
            "parameters": {k: _short(v) for k, v in self.parameters.items()},
            "outputs": _short(self.outputs),
        }


def _short(value, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


def base_request(model: ModelSpec, rows: int, seq: int, rng: np.random.Generator) -> Request:
    inputs = []
    for spec in model.inputs:
        if spec.optional and spec.name not in ("sampling_parameters",):
            continue
        values = valid_values(spec, rows if model.max_batch_size else 0, seq, rng)
        inputs.append(Tensor(spec.name, spec.datatype, list(values.shape), values))
    params = {"max_tokens": 1, "temperature": 0} if model.decoupled else {}
    return Request(model, inputs, params)


# Bytes per element of the fixed-size datatypes (for shapes whose byte count wraps around 2^64).
ITEM_SIZES = {name: size for name, size in DATATYPE_SIZES.items() if size}


def wrapping_shape(rank: int, elements: int, item_size: int) -> list[int]:
    """A shape of ``rank`` (at least 1) whose element count times ``item_size`` is the byte size of
    ``elements`` elements modulo 2^64: tritonserver 2.51's 64-bit byte-size check passes it (the
    attack that killed a stub through the gRPC port). Every dim fits an int64."""
    target = elements + (1 << 64) // item_size  # x item_size == elements x item_size (mod 2^64)
    dims = [1] * max(rank, 1)
    if target < (1 << 63):
        dims[-1] = target
    elif len(dims) >= 2 and (factor := next((f for f in range(2, 1 << 16) if target % f == 0 and target // f < (1 << 63)), 0)):
        dims[-2], dims[-1] = factor, target // factor
    else:  # one-byte types on rank 1 (or no small factor): the largest dim stands in
        dims[-1] = (1 << 63) - 1
    return dims


def mutation_kinds(model: ModelSpec) -> list[str]:
    kinds = ["shape", "datatype", "data", "count", "missing", "extra", "rename", "parameter", "output", "body", "wrap"]
    if len(model.inputs) > 1 and model.max_batch_size:
        kinds.append("batch_mismatch")
    if any(s.datatype == "BYTES" for s in model.inputs):
        kinds += ["strings", "strings", "junk_bytes"]
    return kinds


def mutate(req: Request, kind: str, draw: Callable, st) -> None:
    """Apply one mutation (hypothesis ``draw`` and its strategies ``st``); record what it touched."""
    req.mutations.append(kind)
    if not req.inputs and kind not in ("extra", "parameter", "output", "body"):
        kind = "extra"
    t = req.inputs[draw(st.integers(0, len(req.inputs) - 1))] if req.inputs else None
    if t is not None and kind not in ("parameter", "output", "body", "extra"):
        req.names.add(str(t.name))
    # t is None only without inputs, where every kind is one of the request's own (extra above).
    if kind == "shape" and t is not None:
        choice = draw(st.integers(0, 6))
        shape = list(t.shape) if isinstance(t.shape, list) else [1]
        if choice == 0 and shape:
            shape[draw(st.integers(0, len(shape) - 1))] = draw(st.sampled_from(BAD_DIMS))
        elif choice == 1:
            shape = shape + [1]
        elif choice == 2:
            shape = shape[:-1]
        elif choice == 3:
            shape = draw(st.sampled_from([None, "1", [None], ["1", 1], [1.5, 1], {"a": 1}, [True, 1], [[1]], []]))
        elif choice == 4:
            shape = [draw(st.integers(-(1 << 70), 1 << 70)) for _ in range(draw(st.integers(0, 20)))]
        elif choice == 5 and shape:
            shape[0] = draw(st.sampled_from([0, 65, 1000, (1 << 32) + 1, HUGE]))
        else:
            shape = [d + draw(st.integers(1, 3)) for d in shape if isinstance(d, int)]
        t.shape = shape
        req.names.update({"shape", "dimension", "batch"})
    elif kind == "wrap" and t is not None:
        # Keep the data; declare a shape whose byte count wraps around 2^64 to the data's size.
        size = ITEM_SIZES.get(t.datatype if isinstance(t.datatype, str) else "", 0) or draw(st.sampled_from([1, 2, 4, 8]))
        sent = int(t.values.size) if t.values is not None else 1
        rank = len(t.shape) if isinstance(t.shape, list) and t.shape else 2
        t.shape = wrapping_shape(rank, sent, size)
        req.names.update({"shape", "dimension", "batch", "elements"})
    elif kind == "datatype" and t is not None:
        t.datatype = draw(
            st.sampled_from(
                [
                    "BYTES",
                    "INT64",
                    "INT32",
                    "FP32",
                    "FP16",
                    "BF16",
                    "BOOL",
                    "UINT8",
                    "UINT64",
                    "FP64",
                    "FOO",
                    "",
                    "int64",
                    None,
                    7,
                    ["BYTES"],
                    "STRING",
                ]
            )
        )
        req.names.update({"datatype", "data type", "type"})
    elif kind == "data" and t is not None and t.values is not None:
        dt_ = t.datatype if isinstance(t.datatype, str) else "BYTES"
        flat = t.values.reshape(-1).copy() if t.values.size else t.values.reshape(-1)
        if dt_ == "BYTES" or t.values.dtype == object:
            t.junk = draw(
                st.sampled_from(
                    [[1] * flat.size, [None] * flat.size, [[1, 2]], {"a": 1}, "text", [True] * flat.size, [1.5] * flat.size]
                )
            )
        elif flat.size:
            i = draw(st.integers(0, flat.size - 1))
            if np.issubdtype(flat.dtype, np.integer):
                flat[i] = draw(st.sampled_from([-1, 49152 * 10, 10**7, np.iinfo(flat.dtype).max, np.iinfo(flat.dtype).min]))
            elif np.issubdtype(flat.dtype, np.floating):
                flat[i] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e30, -0.0]))
            t.values = flat.reshape(t.values.shape)
        req.names.update({"data", "value", "inputs", "json"})  # NaN and Infinity are not JSON
    elif kind == "count" and t is not None:
        n = draw(st.integers(0, 3))
        if t.values is not None and t.values.size:
            flat = t.values.reshape(-1)
            t.values = flat[: max(0, flat.size - 1 - n)] if draw(st.booleans()) else np.concatenate([flat] * (n + 2))
        req.names.update({"data", "elements", "shape", "size", "byte"})
    elif kind == "missing" and t is not None:
        req.inputs.remove(t)
        req.names.update({"missing", "input"})
    elif kind == "extra":
        name = draw(st.sampled_from(["EXTRA", "TEXT", "input_ids", "text_input", "IMAGE", "x" * 300]))
        req.inputs.append(
            Tensor(
                name,
                "BYTES",
                [1, 1] if req.model.max_batch_size else [1],
                np.array([[b"extra"]] if req.model.max_batch_size else [b"extra"], dtype=object),
            )
        )
        req.names.update({name[:40], "input", "duplicate"})
    elif kind == "rename" and t is not None:
        t.name = draw(st.sampled_from(["", "text", "TEXT ", "\ud800", "🙂", "a\x00b", 5, None, "x" * 1000]))
        req.names.update({"name", "input", str(t.name)[:40], json.dumps(str(t.name))[1:-1][:40]})
    elif kind == "batch_mismatch" and t is not None:
        other = draw(st.integers(1, 3))
        if t.values is not None and isinstance(t.shape, list) and t.shape:
            t.values = np.concatenate([t.values[:1]] * (t.shape[0] + other))
            t.shape = list(t.values.shape)
        req.names.update({"batch", "shape"} | {s.name for s in req.model.inputs})
    elif kind == "strings" and t is not None and t.values is not None:
        flat = t.values.reshape(-1).copy()
        if flat.dtype == object and flat.size:
            s = draw(st.sampled_from(ODD_STRINGS + ["", " ", "x" * 70000, "x" * 1_000_000]) | st.text(max_size=30))
            flat[draw(st.integers(0, flat.size - 1))] = s.encode("utf-8", "surrogatepass")
            t.values = flat.reshape(t.values.shape)
        req.names.update({"text", "utf-8", "bytes", "empty", "whitespace", "image", "data"})
    elif kind == "junk_bytes" and t is not None and t.values is not None:
        flat = t.values.reshape(-1).copy()
        if flat.dtype == object and flat.size:
            junk = draw(st.sampled_from(JUNK_BYTES) | st.binary(max_size=64))
            flat[draw(st.integers(0, flat.size - 1))] = junk
            t.values = flat.reshape(t.values.shape)
        req.names.update({"utf-8", "text", "image", "jpeg", "png", "empty", "whitespace", "bytes"})
    elif kind == "parameter":
        name = draw(st.sampled_from(PARAMETERS))
        req.parameters[name] = draw(st.sampled_from(BOGUS_VALUES))
        req.names.add(name)
        if name.startswith("triton_"):
            req.names.add("'triton_'")  # tritonserver names the reserved prefix
    elif kind == "output":
        name = draw(st.sampled_from([*req.model.outputs, "NOPE", ""]))
        params = draw(
            st.sampled_from(
                [
                    None,
                    {"binary_data": 1},
                    {"binary_data": "x"},
                    {"classification": -1},
                    {"classification": "x"},
                    {"classification": 2},
                    {"shared_memory_region": 1},
                    {"shared_memory_region": "nope"},
                    {"binary_data": True},
                ]
            )
        )
        out = {"name": name}
        if params is not None:
            out["parameters"] = params
            req.names.update(params)
        req.outputs = [*(req.outputs or []), out]
        req.names.update({name, "output"} - {""})
    elif kind == "body":
        req.body_damage = (
            draw(st.floats(0, 1)),
            draw(st.sampled_from([b"", b"{", b"\x00", b"\xff", b'"', b"]]"]) | st.binary(max_size=8)),
        )
        req.header_lie = draw(st.sampled_from([0, 1, -1, 7, 1 << 20]))
        req.names.update(
            {
                "json",
                "body",
                "inference-header-content-length",
                "binary_data_size",
                "length",
                "header",
                "parse",
                "elements",
                "data",
                "parameter '",
                "unknown sampling parameter",
            }
        )  # these two name the damaged key
    else:
        req.mutations[-1] = f"{kind}(no-op)"


def requests_strategy(model: ModelSpec, max_mutations: int = 3):
    from hypothesis import strategies as st

    kinds = mutation_kinds(model)

    @st.composite
    def build(draw):
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        # One row where a row is big (an image's pixels: 150,528 floats, megabytes of JSON).
        big = any(int(np.prod([d for d in s.dims if d > 0] or [1])) > 10_000 for s in model.inputs)
        rows = 1 if big else draw(st.integers(1, 3))
        seq = draw(st.sampled_from([1, 3, 8, 16]))
        req = base_request(model, rows, seq, rng)
        for _ in range(draw(st.integers(0 if draw(st.integers(0, 9)) == 0 else 1, max_mutations))):
            mutate(req, draw(st.sampled_from(kinds)), draw, st)
        return req

    return build()


# ---- encodings ---------------------------------------------------------------------------


def _json_data(t: Tensor):
    if t.junk is not NOJUNK:
        return t.junk
    flat = t.values.reshape(-1)
    if flat.dtype == object:
        return [v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else v for v in flat]
    return [v.item() if hasattr(v, "item") else v for v in flat]


def _json_default(value):
    return str(value)


def _damage(body: bytes, req: Request) -> bytes:
    if req.body_damage is None:
        return body
    where, junk = req.body_damage
    cut = int(where * len(body))
    return body[:cut] + junk + body[cut + (1 if junk else len(body)) :]


def encode_json(req: Request) -> bytes:
    body: dict = {
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": t.shape, "data": _json_data(t)} for t in req.inputs]
    }
    if req.parameters:
        body["parameters"] = req.parameters
    if req.outputs is not None:
        body["outputs"] = req.outputs
    return _damage(json.dumps(body, default=_json_default).encode("utf-8", "surrogatepass"), req)


def tensor_bytes(t: Tensor) -> bytes:
    if isinstance(t.junk, (bytes, bytearray)):
        return bytes(t.junk)
    if t.values is None:
        return b""
    flat = t.values.reshape(-1)
    if flat.dtype == object or t.junk is not NOJUNK:
        parts = []
        for v in flat if t.junk is NOJUNK else t.junk if isinstance(t.junk, list) else [t.junk]:
            raw = v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogatepass")
            parts.append(struct.pack("<I", len(raw)) + raw)
        return b"".join(parts)
    return flat.tobytes()


def encode_binary(req: Request) -> tuple[bytes, dict]:
    sections = [tensor_bytes(t) for t in req.inputs]
    header: dict = {
        "inputs": [
            {"name": t.name, "datatype": t.datatype, "shape": t.shape, "parameters": {"binary_data_size": len(s)}}
            for t, s in zip(req.inputs, sections)
        ]
    }
    if req.parameters:
        header["parameters"] = req.parameters
    if req.outputs is not None:
        header["outputs"] = req.outputs
    head = json.dumps(header, default=_json_default).encode("utf-8", "surrogatepass")
    body = _damage(head + b"".join(sections), req)
    return body, {
        "Inference-Header-Content-Length": str(max(0, len(head) + req.header_lie)),
        "Content-Type": "application/octet-stream",
    }


def encode_generate(req: Request) -> bytes:
    body: dict = {}
    for t in req.inputs:
        data = _json_data(t)
        body[str(t.name)] = data[0] if isinstance(data, list) and len(data) == 1 else data
    if req.parameters:
        body["parameters"] = req.parameters
    return _damage(json.dumps(body, default=_json_default).encode("utf-8", "surrogatepass"), req)


def _proto_str(value) -> str:
    """A protobuf string field holds UTF-8 only: lone surrogates become U+FFFD on the way."""
    return str(value).encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _grpc_parameter(message, name: str, value) -> None:
    p = message.parameters[_proto_str(name)]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        p.int64_param = value
    elif isinstance(value, int) and 0 <= value < (1 << 64):
        p.uint64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = _proto_str(value if isinstance(value, str) else json.dumps(value, default=_json_default))


def encode_grpc(req: Request, raw: bool):
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name=req.model.name)
    for name, value in req.parameters.items():
        try:
            _grpc_parameter(message, name, value)
        except (TypeError, ValueError):
            message.parameters[_proto_str(name)].string_param = "x"
    for t in req.inputs:
        tensor = message.inputs.add()
        tensor.name = _proto_str(t.name)
        tensor.datatype = _proto_str(t.datatype)
        shape = t.shape if isinstance(t.shape, list) else []
        tensor.shape.extend(
            int(d) % (1 << 63)
            if isinstance(d, int) and not -(1 << 63) <= d < (1 << 63)
            else int(d)
            if isinstance(d, (int, float))
            else 0
            for d in shape
        )
        if raw:
            message.raw_input_contents.append(tensor_bytes(t))
            continue
        kind = CONTENTS.get(tensor.datatype, "bytes_contents")
        if t.junk is not NOJUNK or t.values is None:
            tensor.contents.bytes_contents.append(tensor_bytes(t))
            continue
        flat = t.values.reshape(-1)
        if kind == "bytes_contents":
            getattr(tensor.contents, kind).extend(v if isinstance(v, bytes) else str(v).encode() for v in flat)
        elif flat.dtype == object:
            tensor.contents.bytes_contents.extend(v if isinstance(v, bytes) else str(v).encode() for v in flat)
        else:
            try:
                getattr(tensor.contents, kind).extend(flat.tolist())
            except (TypeError, ValueError):
                tensor.contents.bytes_contents.append(flat.tobytes())
    for out in req.outputs or ():
        o = message.outputs.add()
        o.name = _proto_str(out.get("name", ""))
    return message


# ---- outcomes ----------------------------------------------------------------------------


@dataclass
class Tally:
    counts: dict = field(default_factory=dict)  # endpoint -> Counter(outcome)
    findings: list = field(default_factory=list)

    def add(self, endpoint: str, outcome: str, req: Request | None = None, detail: str = "") -> None:
        self.counts.setdefault(endpoint, Counter())[outcome] += 1
        self.counts[endpoint]["cases"] += 1
        bad = outcome.startswith(("5xx", "dropped", "unnamed")) or outcome.replace("grpc:", "") in GRPC_SERVER_ERRORS | {
            "UNAVAILABLE"
        }
        if bad and len(self.findings) < 200:
            self.findings.append(
                {"endpoint": endpoint, "outcome": outcome, "detail": detail[:400], "request": req.describe() if req else None}
            )

    def total(self) -> int:
        return sum(c["cases"] for c in self.counts.values())

    def bad(self) -> Counter:
        out: Counter = Counter()
        for c in self.counts.values():
            for k, v in c.items():
                if (
                    k.startswith("5xx")
                    or k == "dropped"
                    or k == "unnamed"
                    or k.replace("grpc:", "") in GRPC_SERVER_ERRORS | {"UNAVAILABLE"}
                ):
                    out[k] += v
        return out


def names_a_field(message: str, req: Request) -> bool:
    low = message.lower()
    spaced = low.replace(" ", "_")
    if "call modelstreaminfer" in low:  # ModelInfer of a decoupled model: the refusal names the RPC to use
        return True
    if req.body_damage is not None and re.search(r"'[^']+'", message):
        # the body's bytes were damaged (a name among them, say 'TEXT' -> 'TEvT'): the refusal
        # names what the server received, which is not one of the names the case built
        return True
    return any(str(n).lower()[:40] in low or str(n).lower()[:40] in spaced if n else "''" in low for n in req.names)


def classify_http(endpoint: str, status: int, body: bytes, req: Request, tally: Tally) -> None:
    if 200 <= status < 300:
        tally.add(endpoint, "2xx", req)
        return
    try:
        message = json.loads(body).get("error", "")
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace")
    if status >= 500:
        tally.add(endpoint, f"5xx:{status}", req, message)
    elif req.names and not names_a_field(message, req):
        tally.add(endpoint, "unnamed", req, f"{status} {message}")
    else:
        tally.add(endpoint, f"4xx:{status}", req)


class HTTP:
    """One keep-alive connection; a request that gets no answer is a dropped connection."""

    def __init__(self, url: str, timeout: float = 120):
        self.host, port = url.rsplit(":", 1)
        self.port, self.timeout = int(port), timeout
        self.conn: http.client.HTTPConnection | None = None
        self.reconnects = 0  # kept-alive connections found closed and sent again (reported)
        self.error = ""

    def post(self, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes] | None:
        """(status, body), or None when no answer came (``self.error`` says why)."""
        self.error = ""
        for attempt in (0, 1):
            reused = self.conn is not None
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
                r = self.conn.getresponse()
                data = r.read()
                if r.getheader("Connection", "").lower() == "close":
                    self.close()
                return r.status, data
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                self.error = f"{type(exc).__name__}: {exc}"
                # A kept-alive connection the server had closed is sent again once, on a fresh one
                # (as HTTP clients do); a request that gets no answer on a fresh connection is dropped.
                if attempt == 1 or not reused or isinstance(exc, TimeoutError):
                    return None
                self.reconnects += 1
        return None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# gRPC ModelInfer to a decoupled model: tritonserver answers UNIMPLEMENTED naming the policy
# (the right code: that RPC does not serve such models; clients must stream). nginx cannot see
# the model name inside gRPC, so it stays; counted on its own (docs/security.md).
DECOUPLED_REFUSAL = "doesn't support models with decoupled transaction policy"


def grpc_outcome(exc) -> str:
    code = exc.code().name
    if code == "UNIMPLEMENTED" and DECOUPLED_REFUSAL in (exc.details() or ""):
        return "grpc:UNIMPLEMENTED(decoupled)"
    if code == "UNAVAILABLE" and any(s in (exc.details() or "").lower() for s in GRPC_TRANSPORT):
        return "dropped"
    return f"grpc:{code}"


def _utf8(value) -> bool:
    try:
        value.decode("utf-8") if isinstance(value, bytes) else str(value).encode("utf-8")
        return True
    except UnicodeError:
        return False


def send_case(endpoint: str, req: Request, http_conn: HTTP, stub, tally: Tally) -> None:
    import grpc

    model = req.model.name
    if endpoint.startswith("http") and endpoint != "http_binary":
        # JSON carries text only: an input of non-UTF-8 bytes (an image) is refused by name.
        req.names.update(
            str(t.name)
            for t in req.inputs
            if t.junk is NOJUNK
            and t.values is not None
            and t.values.dtype == object
            and not all(_utf8(v) for v in t.values.reshape(-1))
        )
    if any(_utf8(n) is False for n in req.names):
        req.names.add("a key")  # an unprintable name (a lone surrogate) is called a key
    if (
        endpoint.startswith("http")
        and endpoint != "http_binary"
        and any(t.values is not None and t.values.dtype == object for t in req.inputs)
    ):
        req.names.add("'data'")
    if req.model.decoupled and endpoint == "http_json":
        req.names.add("decoupled")
    if endpoint == "http_json":
        answer = http_conn.post(f"/v2/models/{model}/infer", encode_json(req))
    elif endpoint == "http_binary":
        body, headers = encode_binary(req)
        answer = http_conn.post(f"/v2/models/{model}/infer", body, headers)
    elif endpoint in ("http_generate", "http_generate_stream"):
        path = "generate_stream" if endpoint.endswith("stream") else "generate"
        answer = http_conn.post(f"/v2/models/{model}/{path}", encode_generate(req))
        if answer is not None and endpoint.endswith("stream") and answer[0] == 200:
            # Server-sent events: an error mid-stream arrives as an event under status 200.
            events = [
                json.loads(line[5:])
                for line in answer[1].decode("utf-8", "replace").splitlines()
                if line.startswith("data:") and line[5:].strip()
            ]
            errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
            if errors:
                answer = (
                    400 if all("internal" not in e.lower() for e in errors) else 500,
                    json.dumps({"error": errors[0]}).encode(),
                )
    else:
        raw = endpoint.endswith("raw")
        message = encode_grpc(req, raw)
        try:
            if endpoint.startswith("grpc_stream"):
                responses = list(stub.ModelStreamInfer(iter([message]), timeout=120))
                errors = [r.error_message for r in responses if r.error_message]
                if errors:
                    message_text = errors[0]
                    data = parse_error(message_text)  # the model's error as data; Triton's own have none
                    if data.code == "internal" if data is not None else "internal error" in message_text.lower():
                        tally.add(endpoint, "grpc:INTERNAL", req, message_text)
                    elif req.names and not names_a_field(message_text, req):
                        tally.add(endpoint, "unnamed", req, message_text)
                    else:
                        tally.add(endpoint, "grpc:stream-error", req)
                else:
                    tally.add(endpoint, "grpc:OK", req)
            else:
                stub.ModelInfer(message, timeout=120)
                tally.add(endpoint, "grpc:OK", req)
        except grpc.RpcError as exc:
            outcome = grpc_outcome(exc)
            details = exc.details() or ""
            if (
                outcome in ("dropped", "grpc:UNAVAILABLE", "grpc:UNIMPLEMENTED(decoupled)")
                or outcome.replace("grpc:", "") in GRPC_SERVER_ERRORS
            ):
                tally.add(endpoint, outcome, req, details)
            elif req.names and not names_a_field(details, req):
                tally.add(endpoint, "unnamed", req, f"{outcome} {details}")
            else:
                tally.add(endpoint, outcome, req)
        return
    if http_conn.reconnects:
        tally.counts.setdefault(endpoint, Counter())["reconnected"] += http_conn.reconnects
        http_conn.reconnects = 0
    if answer is None:
        tally.add(endpoint, "dropped", req, f"no answer ({http_conn.error})")
    else:
        classify_http(endpoint, answer[0], answer[1], req, tally)


def endpoints_for(model: ModelSpec) -> list[str]:
    grpc_eps = ["grpc_typed", "grpc_raw"]
    if model.decoupled:
        return ["http_generate", "http_generate_stream", "http_json", "grpc_stream_typed", "grpc_stream_raw", *grpc_eps]
    return ["http_json", "http_binary", *grpc_eps, "grpc_stream_raw", "http_generate"]


# Each model's share of the cases: the generation model and the image models cost the most
# per valid request (a token, a ResNet-50 pass), so they get fewer cases.
WEIGHTS = {
    "text_generation": 0.5,
    "image_classification": 0.5,
    "image_classifier": 0.25,
    "image_preprocess": 0.6,
    "image_postprocess": 0.6,
}


def plan(models: Sequence[ModelSpec], cases: int) -> list[tuple[ModelSpec, str, int]]:
    """(model, endpoint, cases) for every model and endpoint, adding up to ``cases``."""
    pairs = [(m, ep, WEIGHTS.get(m.name, 1.0)) for m in models for ep in endpoints_for(m)]
    total = sum(w for _, _, w in pairs)
    out = [(m, ep, max(5, int(cases * w / total))) for m, ep, w in pairs]
    short = cases - sum(n for *_, n in out)
    for i in range(max(0, short)):
        m, ep, n = out[i % len(out)]
        out[i % len(out)] = (m, ep, n + 1)
    return out


def fuzz_endpoint(model: ModelSpec, endpoint: str, n: int, seed: int, conn: HTTP, stub, tally: Tally) -> None:
    """``n`` hypothesis cases of ``model`` on ``endpoint``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    @with_seed(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(req=requests_strategy(model))
    def one(req):
        send_case(endpoint, req, conn, stub, tally)

    one()


def run_endpoint_fuzz(
    http_url: str, grpc_url: str, models: Sequence[ModelSpec], cases: int, seed: int, say: Callable[[str], None], tally: Tally
) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.insecure_channel(
        grpc_url, options=[("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
    )
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    conn = HTTP(http_url)
    try:
        for model, endpoint, n in plan(models, cases):
            started = time.monotonic()
            fuzz_endpoint(model, endpoint, n, seed, conn, stub, tally)
            say(f"  {model.name:34} {endpoint:20} {n:5} cases in {time.monotonic() - started:5.1f} s")
    finally:
        conn.close()
        channel.close()


# ---- the server's health: stub processes, liveness, known-good answers -------------------


def child_processes(pid: int) -> dict[int, str]:
    """{pid: command} of the processes whose parent is ``pid`` (the python backend stubs)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except (OSError, ValueError):
            continue
    return out


def known_good(http_url: str, model: ModelSpec) -> dict:
    """A valid request's answer: {output: list} (rounded), to compare before and after."""
    rng = np.random.default_rng(7)
    req = base_request(model, 1, 8, rng)
    for t in req.inputs:
        if t.values is not None and t.values.dtype == object and t.name not in ("IMAGE", "sampling_parameters"):
            t.values = np.full(t.values.shape, b"hello world", dtype=object)
    conn = HTTP(http_url)
    try:
        if model.decoupled:
            req.parameters = {"max_tokens": 4, "temperature": 0}
            answer = conn.post(f"/v2/models/{model.name}/generate", encode_generate(req))
        else:
            body, headers = encode_binary(req)  # JSON cannot carry an image's bytes
            answer = conn.post(f"/v2/models/{model.name}/infer", body, headers)
    finally:
        conn.close()
    if answer is None or answer[0] != 200:
        return {"error": answer and answer[1][:300].decode("utf-8", "replace")}
    data = json.loads(answer[1])
    if model.decoupled:
        return {"text_output": data.get("text_output")}
    return {
        o["name"]: np.round(np.asarray(o["data"], dtype=float if o["datatype"] != "BYTES" else object), 4).tolist()
        if o["datatype"] != "BYTES"
        else o["data"]
        for o in data.get("outputs", [])
    }


def same_answer(a: dict, b: dict) -> bool:
    if "error" in a or "error" in b or set(a) != set(b):
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, list) and x and not isinstance(np.asarray(x, dtype=object).reshape(-1)[0], str):
            if not np.allclose(np.asarray(x, float), np.asarray(y, float), atol=2e-3):
                return False
        elif x != y:
            return False
    return True


def served_models(http_url: str, names: Sequence[str]) -> list[ModelSpec]:
    import urllib.request

    out = []
    for name in names:
        try:
            with urllib.request.urlopen(f"http://{http_url}/v2/models/{name}/config", timeout=10) as r:
                out.append(ModelSpec.from_config(json.loads(r.read())))
        except OSError:
            continue
    return out


def repository_models(triton_http_url: str, token: str | None) -> list[str]:
    import urllib.request

    req = urllib.request.Request(
        f"http://{triton_http_url}/v2/repository/index",
        data=b"{}",
        method="POST",
        headers={"triton-repository-token": token or ""},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return sorted(m["name"] for m in json.loads(r.read()) if m.get("state") == "READY")


# ---- the gateway (the schemathesis fuzz of the hostile tests) ----------------------------


def gateway_fuzz(triton_grpc_url: str, examples: int, workdir: Path, say: Callable[[str], None], tally: Tally) -> None:
    """Run tests/integration/test_openai_gateway_hostile.py's schemathesis fuzz against a fresh
    gateway in front of this server; its counts go into ``tally`` as endpoint ``gateway``."""
    from server.gateway import GatewayOptions, GatewayProcess
    from server.process import free_port

    sys.path.insert(0, str(ROOT))
    from tests.integration import test_openai_gateway_hostile as hostile
    from tests.integration.conftest import GATEWAY_TEST_KEY

    hostile.FUZZ_EXAMPLES = examples
    options = GatewayOptions(
        triton_grpc_url=triton_grpc_url,
        port=free_port(),
        workdir=workdir,
        api_key_file=workdir / "gateway-api-key",
        extra_args=["--rate-limit", "0", "--max-tokens-cap", "8", "--no-request-log"],
        env={"GATEWAY_API_KEYS": GATEWAY_TEST_KEY},
        drain_timeout=5,
    )
    gw = GatewayProcess(options).start()
    out = io.StringIO()
    started = time.monotonic()
    try:
        gw.wait_ready(timeout=60)
        failure = ""
        with contextlib.redirect_stdout(out):
            try:
                hostile.test_schemathesis_fuzz_of_the_openapi_schema_finds_no_5xx(gw)
            except AssertionError as exc:
                failure = str(exc)[:400]
    finally:
        gw.stop()
    text = out.getvalue()
    m = re.search(r"statuses (\{[^}]*\})", text)
    statuses = {int(k): int(v) for k, v in re.findall(r"(\d+): (\d+)", m.group(1))} if m else {}
    counts = tally.counts.setdefault("gateway (schemathesis)", Counter())
    for status, n in statuses.items():
        counts["2xx" if status < 300 else f"4xx:{status}" if status < 500 else f"5xx:{status}"] += n
        counts["cases"] += n
    if failure:
        tally.findings.append({"endpoint": "gateway (schemathesis)", "outcome": "failed", "detail": failure})
        counts["failed"] += 1
    say(
        f"  gateway (schemathesis) {counts['cases']:5} cases in {time.monotonic() - started:5.1f} s"
        + (f"; FAILED: {failure[:200]}" if failure else "")
    )


# ---- atheris ------------------------------------------------------------------------------

# perf/fuzz/targets.py's targets (not imported here: its import instruments python_backends).
ATHERIS_TARGETS = ("text", "image", "generation", "sampling", "routing", "shapes")


def atheris_fuzz(
    runs: int,
    workdir: Path,
    say: Callable[[str], None],
    tally: Tally,
    targets: Sequence[str] = ATHERIS_TARGETS,
    max_time: int = 300,
    parallel: int = 2,
) -> None:
    """Each target in its own process (``parallel`` at a time), ``runs`` runs or ``max_time`` s."""
    pending = list(targets)
    running: list[tuple[str, subprocess.Popen, float, Path]] = []
    while pending or running:
        while pending and len(running) < parallel:
            target = pending.pop(0)
            corpus = workdir / f"corpus-{target}"
            corpus.mkdir(parents=True, exist_ok=True)
            log_path = workdir / f"atheris-{target}.log"
            cmd = [
                sys.executable,
                "-m",
                "perf.fuzz.targets",
                target,
                f"-runs={runs}",
                "-len_control=0",
                "-max_len=4096",
                "-timeout=60",
                f"-max_total_time={max_time}",
                f"-artifact_prefix={workdir}/crash-{target}-",
                str(corpus),
            ]
            with log_path.open("w") as log_file:
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
            running.append((target, proc, time.monotonic(), log_path))
        for item in list(running):
            target, proc, started, log_path = item
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if time.monotonic() - started > max_time + 120:
                    proc.kill()
                    proc.wait()
                else:
                    continue
            running.remove(item)
            _count_atheris(target, proc.returncode, log_path.read_text(errors="replace"), time.monotonic() - started, say, tally)


def _count_atheris(target: str, code: int, log: str, took: float, say, tally: Tally) -> None:
    m = re.search(r"Done (\d+) runs", log)
    ran = int(m.group(1)) if m else 0
    cov = re.findall(r"cov: (\d+)", log)
    endpoint = f"atheris:{target}"
    counts = tally.counts.setdefault(endpoint, Counter())
    counts["cases"] += ran
    counts["ok"] += ran
    if code != 0:
        counts["crash"] += 1
        tail = log[log.find("Traceback") :][:1500] if "Traceback" in log else log[-1500:]
        tally.findings.append({"endpoint": endpoint, "outcome": "crash", "detail": tail})
    say(
        f"  atheris {target:14} {ran:6} runs in {took:5.1f} s, coverage {cov[-1] if cov else '?'}"
        + ("" if code == 0 else f"; CRASH (exit {code})")
    )


# ---- report -------------------------------------------------------------------------------


def table(tally: Tally) -> str:
    rows = [
        "| endpoint | cases | 2xx / OK | 4xx / client errors | 5xx / server errors | unnamed | dropped |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for endpoint, c in sorted(tally.counts.items()):
        ok = c["2xx"] + c["grpc:OK"] + c["ok"]
        client = {
            k: v
            for k, v in c.items()
            if k.startswith("4xx")
            or (k.startswith("grpc:") and k != "grpc:OK" and k.replace("grpc:", "") not in GRPC_SERVER_ERRORS | {"UNAVAILABLE"})
        }
        server = sum(
            v
            for k, v in c.items()
            if k.startswith("5xx") or k.replace("grpc:", "") in GRPC_SERVER_ERRORS | {"UNAVAILABLE"} or k in ("crash", "failed")
        )
        client_text = ", ".join(f"{k.replace('grpc:', '').replace('4xx:', '')} {v}" for k, v in sorted(client.items()))
        rows.append(f"| {endpoint} | {c['cases']} | {ok} | {client_text or '-'} | {server} | {c['unnamed']} | {c['dropped']} |")
    return "\n".join(rows)


@dataclass
class Health:
    alive: bool
    stubs_before: dict
    stubs_after: dict
    answers_ok: dict
    log_lines: list

    @property
    def crashed_stubs(self) -> list:
        return sorted(set(self.stubs_before) - set(self.stubs_after))


def run(args: argparse.Namespace) -> int:
    from server.process import ServerError, ServerOptions, TritonServer

    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", flush=True)

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or DEFAULT_RESULTS / f"fuzz-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="perf-fuzz-"))
    token = secrets.token_urlsafe(16)
    tally = Tally()
    server = TritonServer(
        ServerOptions.with_free_ports(
            workdir=workdir / "triton", repository_token=token, **({"models": args.models} if args.models else {})
        )
    )
    say(f"perf.fuzz: starting tritonserver behind the front door ({', '.join(server.options.models)})")
    server.start()
    try:
        try:
            server.wait_ready(timeout=400)
        except ServerError as exc:
            say(f"{exc}\n{exc.log_tail}")
            return 1
        health = fuzz_server(
            server.http_url,
            server.grpc_url,
            server.process.pid,
            repository_models(server.triton_http_url, token),
            args,
            say,
            tally,
            log_path=server.log_path,
        )
        if args.gateway_examples > 0:
            gateway_fuzz(server.triton_grpc_url, args.gateway_examples, workdir / "gateway", say, tally)
        alive_after_all = server.process.poll() is None
    finally:
        server.stop()
    if args.atheris_runs > 0:
        atheris_fuzz(args.atheris_runs, workdir / "atheris", say, tally, max_time=args.atheris_max_time)
    return report(tally, health, alive_after_all, out_dir, args, say, time.monotonic() - started)


def fuzz_server(
    http_url: str, grpc_url: str, pid: int, model_names: Sequence[str], args, say, tally: Tally, log_path: Path | None = None
) -> Health:
    """The endpoint fuzz against a running server (front door at ``http_url``/``grpc_url``,
    tritonserver's ``pid``), with the health checks around it."""
    models = served_models(http_url, model_names)
    say(f"perf.fuzz: {len(models)} models reachable: {', '.join(m.name for m in models)}")
    before = {m.name: known_good(http_url, m) for m in models}
    stubs = child_processes(pid)
    log_start = log_path.stat().st_size if log_path and log_path.is_file() else 0
    run_endpoint_fuzz(http_url, grpc_url, models, args.cases, args.seed, say, tally)
    after = {m.name: known_good(http_url, m) for m in models}
    alive = Path(f"/proc/{pid}").exists()
    lines = []
    if log_path and log_path.is_file():
        with log_path.open("rb") as f:
            f.seek(log_start)
            lines = [
                ln
                for ln in f.read().decode("utf-8", "replace").splitlines()
                if re.search(r"segfault|Stub process .* not healthy|Signal \(|core dumped|bad_alloc", ln)
            ]
    return Health(
        alive,
        stubs,
        child_processes(pid),
        {m: same_answer(before[m], after[m]) and "error" not in before[m] for m in before},
        lines[:20],
    )


def report(tally: Tally, health: Health, alive_after_all: bool, out_dir: Path, args, say, took: float) -> int:
    bad = tally.bad()
    crashes = sum(c["crash"] for c in tally.counts.values())
    failed_gateway = sum(c["failed"] for c in tally.counts.values())
    summary = [
        "# Fuzz run",
        "",
        (
            f"- {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, {took:.0f} s; command: "
            f"`python -m perf.fuzz {' '.join(args.argv)}`"
        ),
        (
            f"- {tally.total()} cases in all; endpoint cases through the front door: "
            f"{sum(c['cases'] for k, c in tally.counts.items() if not k.startswith(('atheris', 'gateway')))}"
        ),
        (
            f"- server errors (5xx / gRPC INTERNAL, UNKNOWN, UNIMPLEMENTED, UNAVAILABLE): "
            f"{sum(v for k, v in bad.items() if k not in ('dropped', 'unnamed'))}; refusals not naming the field: "
            f"{bad['unnamed']}; dropped connections: {bad['dropped']} (kept-alive connections found closed "
            f"and sent again: {sum(c['reconnected'] for c in tally.counts.values())}); atheris crashes: {crashes}"
        ),
        (
            f"- python stubs before {len(health.stubs_before)}, crashed during the run "
            f"{len(health.crashed_stubs)}; tritonserver alive after the endpoint fuzz: {health.alive}, after the "
            f"gateway fuzz: {alive_after_all}; crash lines in its log: {len(health.log_lines)}"
        ),
        (f"- known-good answer unchanged after the run: {', '.join(f'{m} {ok}' for m, ok in sorted(health.answers_ok.items()))}"),
        "",
        table(tally),
        "",
    ]
    text = "\n".join(summary)
    (out_dir / "summary.md").write_text(text)
    (out_dir / "counts.json").write_text(json.dumps({k: dict(v) for k, v in tally.counts.items()}, indent=1))
    (out_dir / "findings.json").write_text(
        json.dumps(
            {"findings": tally.findings, "log": health.log_lines, "crashed_stubs": health.crashed_stubs}, indent=1, default=str
        )
    )
    print("\n" + text, flush=True)
    for f in tally.findings[:10]:
        print(f"  finding: {f['endpoint']} {f['outcome']}: {f['detail'][:300]}\n    {json.dumps(f.get('request'))[:400]}")
    say(f"perf.fuzz: results in {out_dir.relative_to(ROOT) if out_dir.is_relative_to(ROOT) else out_dir}")
    ok = (
        not bad
        and not crashes
        and not failed_gateway
        and health.alive
        and alive_after_all
        and not health.crashed_stubs
        and not health.log_lines
        and all(health.answers_ok.values())
    )
    return 0 if ok else 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.fuzz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", type=int, default=10_000, help="endpoint cases over all models (default 10000)")
    p.add_argument(
        "--gateway-examples",
        type=int,
        default=100,
        help="schemathesis examples per gateway operation and mode (0: skip the gateway)",
    )
    p.add_argument("--atheris-runs", type=int, default=2000, help="atheris runs per decoding target (0: skip)")
    p.add_argument("--atheris-max-time", type=int, default=120, help="seconds per atheris target at most")
    p.add_argument(
        "--models",
        type=lambda s: [m for m in s.split(",") if m],
        default=None,
        help="entry models to load (default: the launcher's; their steps are fuzzed too)",
    )
    p.add_argument("--seed", type=int, default=13, help="hypothesis seed (default 13)")
    p.add_argument("--out-dir", type=Path, default=None, help="default perf/results/fuzz-<UTC stamp>")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
