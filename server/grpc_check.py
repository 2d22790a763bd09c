"""The gRPC front door's check of one ``ModelInferRequest``, before tritonserver allocates for it.

tritonserver 2.51 multiplies a gRPC input's declared dims in 64 bits: shape
``[1, 2^61 + 16]`` of INT64 wraps to exactly 128 bytes, its byte-size check passes, and the
python backend stub then dies building the array (``ValueError: array is too big``). A BYTES
input declaring ``[2^32 + 1, 1]`` is answered as one row. So every inference request on the
public gRPC port is checked here against the model's config (the same limits the HTTP check
uses, ``server.frontdoor.model_limits``), with Python's unbounded integers: name, datatype, rank,
every dim, the element count against the model's limit, and the data actually sent (raw bytes,
typed contents or the shared-memory byte size) against the declared shape. Only the header is
looked at; the tensor bytes are forwarded as they came.

A refusal is data (``Refusal``: the field, the rule, the message); the door turns it into
``INVALID_ARGUMENT`` (a unary call) or an error response on the stream (``ModelStreamInfer``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from contract.errors import INVALID, ErrorData
from contract.kserve import DATATYPE_SIZES, MAX_RANK, TYPED_FIELD, TYPED_FIELDS

_PREFIX = struct.Struct("<I")


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: ``field`` names where (``inputs[0] 'TEXT'.shape[0]``), ``rule``
    what it broke (a short code, e.g. ``batch``, ``elements``, ``data_size``), ``values`` the
    limit and what was sent where the rule has them."""

    field: str
    rule: str
    message: str
    values: Mapping[str, Any] = dataclass_field(default_factory=dict)

    @property
    def data(self) -> ErrorData:
        """The refusal as the error data every hop reads (contract/errors.py): ``invalid_value``,
        as the front door's HTTP check answers the same rules (400); ``values`` holds the rule."""
        return ErrorData(INVALID, self.field, {"rule": self.rule, **self.values}, self.message)


@dataclass(frozen=True)
class Limits:
    """What the door checks against: ``models`` from ``server.frontdoor.model_limits``;
    ``max_elements`` the global bound (the message limit: data that matches its shape cannot
    declare more)."""

    models: Mapping[str, dict]
    max_elements: int
    max_rank: int = MAX_RANK


def _param(params, key: str):
    """The value of an InferParameter map entry, or None."""
    if key not in params:
        return None
    p = params[key]
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def count_bytes_elements(data: bytes, field: str) -> int | Refusal:
    """The number of elements of a serialized BYTES tensor (4-byte little-endian length prefixes)."""
    pos, end, count = 0, len(data), 0
    while pos < end:
        if pos + 4 > end:
            return Refusal(field, "bytes_prefix", f"{field}: BYTES data ends inside a length prefix")
        (length,) = _PREFIX.unpack_from(data, pos)
        pos += 4 + length
        if pos > end:
            return Refusal(field, "bytes_prefix", f"{field}: BYTES element of {length} bytes runs past the end of the data")
        count += 1
    return count


def _typed_count(tensor) -> tuple[str, int] | None:
    """(field, count) of the typed contents the tensor carries, or None."""
    if not tensor.HasField("contents"):
        return None
    found = [(name, len(getattr(tensor.contents, name))) for name in TYPED_FIELDS]
    found = [(n, c) for n, c in found if c]
    if not found:
        return None
    if len(found) > 1:
        return ("several", sum(c for _, c in found))
    return found[0]


def check_input(tensor, i: int, raw: bytes | None, model: Mapping | None, limits: Limits) -> Refusal | None:
    """One input of a request; ``raw`` its raw_input_contents entry (None: typed or shared memory)."""
    field = f"inputs[{i}]"
    name = f"{field} '{tensor.name}'"
    datatype = tensor.datatype
    if datatype not in DATATYPE_SIZES:
        return Refusal(f"{name}.datatype", "datatype", f"{name}.datatype must be one of {', '.join(DATATYPE_SIZES)}")
    shape = list(tensor.shape)
    if len(shape) > limits.max_rank:
        return Refusal(f"{name}.shape", "rank", f"{name}.shape has {len(shape)} dimensions; at most {limits.max_rank}")
    for d, dim in enumerate(shape):
        if dim < 0:
            return Refusal(f"{name}.shape[{d}]", "dim", f"{name}.shape[{d}] is {dim}; dims must be non-negative")
    bound = limits.max_elements
    if model is not None:
        spec = model["inputs"].get(tensor.name)
        if spec is None:
            declared = ", ".join(sorted(model["inputs"])) or "none"
            return Refusal(f"{name}.name", "name", f"{name} is not an input of this model (its inputs: {declared})")
        if spec["datatype"] and spec["datatype"] != datatype:
            return Refusal(f"{name}.datatype", "datatype", f"{name}.datatype is {datatype}; model expects {spec['datatype']}")
        batched = model["max_batch_size"] > 0
        dims = list(spec["dims"])
        rank = len(dims) + (1 if batched else 0)
        if len(shape) != rank:
            return Refusal(
                f"{name}.shape", "rank", f"{name}.shape has {len(shape)} dimensions; model expects {rank}", {"expected": rank}
            )
        if batched and not 1 <= shape[0] <= model["max_batch_size"]:
            return Refusal(
                f"{name}.shape[0]",
                "batch",
                f"{name}.shape[0] (batch) must be between 1 and max_batch_size {model['max_batch_size']}",
                {"minimum": 1, "maximum": model["max_batch_size"], "got": shape[0]},
            )
        offset = 1 if batched else 0
        for d, want in enumerate(dims):
            if want >= 0 and shape[d + offset] != want:
                return Refusal(
                    f"{name}.shape[{d + offset}]",
                    "dim",
                    f"{name}.shape[{d + offset}] is {shape[d + offset]}; model expects {want}",
                )
        if 0 < spec["max_elements"] < bound:
            bound = spec["max_elements"]
    elements = 1
    for dim in shape:
        elements *= dim  # Python integers: no wrap-around
    if elements > bound:
        return Refusal(
            f"{name}.shape",
            "elements",
            f"{name}.shape declares {elements} elements; the limit is {bound}",
            {"maximum": bound, "got": elements},
        )
    size = DATATYPE_SIZES[datatype]
    region = _param(tensor.parameters, "shared_memory_region")
    typed = _typed_count(tensor)
    if region is not None:
        if raw is not None or typed is not None:
            return Refusal(name, "data", f"{name}: both data and shared_memory_region given")
        declared = _param(tensor.parameters, "shared_memory_byte_size")
        if size and declared is not None and declared != elements * size:
            return Refusal(
                f"{name}.parameters.shared_memory_byte_size",
                "data_size",
                f"{name}.parameters.shared_memory_byte_size is {declared}; shape {shape} of {datatype} "
                f"needs {elements * size} bytes",
            )
        return None
    if raw is not None:
        if typed is not None:
            return Refusal(name, "data", f"{name}: both raw_input_contents and typed contents given")
        if size:
            if len(raw) != elements * size:
                return Refusal(
                    f"raw_input_contents[{i}]",
                    "data_size",
                    f"raw_input_contents[{i}] ({name}) holds {len(raw)} bytes; shape {shape} of {datatype} "
                    f"needs {elements * size}",
                )
            return None
        count = count_bytes_elements(raw, f"raw_input_contents[{i}] ({name})")
        if isinstance(count, Refusal):
            return count
        if count != elements:
            return Refusal(
                f"raw_input_contents[{i}]",
                "data_size",
                f"raw_input_contents[{i}] ({name}) holds {count} BYTES elements; shape {shape} declares {elements}",
            )
        return None
    if typed is None:
        if elements:
            return Refusal(
                name, "data", f"{name}: no data (contents, raw_input_contents or shared memory) for {elements} elements"
            )
        return None
    contents_field, count = typed
    if contents_field == "several" or contents_field != TYPED_FIELD.get(datatype):
        want = TYPED_FIELD.get(datatype)
        where = f"contents.{want}" if want else "raw_input_contents"
        return Refusal(f"{name}.contents", "datatype", f"{name}: {datatype} data must be sent in {where}")
    if count != elements:
        return Refusal(
            f"{name}.contents.{contents_field}",
            "data_size",
            f"{name}.contents.{contents_field} holds {count} elements; shape {shape} declares {elements}",
        )
    return None


def check_request(request, limits: Limits, *, stream: bool) -> Refusal | None:
    """The first reason to refuse ``request`` (a ``ModelInferRequest``), or None. Unknown models
    get the global checks only (Triton then answers NOT_FOUND itself). ``stream``: it came on
    ``ModelStreamInfer`` (the only RPC a decoupled model serves)."""
    model = limits.models.get(request.model_name)
    if model is not None and model.get("decoupled") and not stream:
        return Refusal(
            "model_name",
            "decoupled",
            f"model {request.model_name} is decoupled (it streams its responses): call ModelStreamInfer, not ModelInfer",
        )
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        return Refusal(
            "raw_input_contents",
            "data",
            f"raw_input_contents has {len(raw)} entries; inputs has {len(request.inputs)} (one per input)",
        )
    seen = set()
    for i, tensor in enumerate(request.inputs):
        if tensor.name in seen:
            return Refusal(f"inputs[{i}].name", "name", f"inputs[{i}] '{tensor.name}' is given twice")
        seen.add(tensor.name)
        refusal = check_input(tensor, i, raw[i] if raw else None, model, limits)
        if refusal is not None:
            return refusal
    return None
