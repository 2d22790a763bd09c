"""The fuzzer's wire encodings of a case: HTTP JSON, HTTP binary tensors, HTTP generate and gRPC
(typed contents or raw_input_contents)."""

from __future__ import annotations

import json
import struct

from contract.kserve import TYPED_FIELD
from tests.fuzz.cases import NOJUNK, Request, Tensor

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
        kind = TYPED_FIELD.get(tensor.datatype, "bytes_contents")
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
