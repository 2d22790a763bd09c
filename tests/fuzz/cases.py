"""The fuzzer's endpoint cases: each model's inputs from its config, valid values, the abstract request,
its mutations and the hypothesis strategy that draws them."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from contract.kserve import CONFIG_DATATYPES, DATATYPE_SIZES

HUGE = 1 << 40

# KServe datatype -> numpy dtype, for contract/kserve.py's datatypes (numpy has no BF16).
NUMPY = {
    name: np.dtype(name.lower().replace("fp", "float")).type for name in DATATYPE_SIZES if name not in ("BOOL", "BF16", "BYTES")
} | {"BOOL": np.bool_, "BYTES": np.object_}

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
            InputSpec(t["name"], CONFIG_DATATYPES.get(t["data_type"], t["data_type"]), dims(t), bool(t.get("optional", False)))
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
        # every datatype of the protocol (contract/kserve.py) and names, values and types that are none
        t.datatype = draw(st.sampled_from([*DATATYPE_SIZES, "FOO", "", "int64", None, 7, ["BYTES"], "STRING"]))
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
