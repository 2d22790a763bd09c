"""The KServe v2 inference protocol's tensor rules that every door checks: the datatypes with
their bytes per element, the gRPC contents field of each, and the rank limit. server/grpc_check.py
reads them, the front door's njs check gets them through its generated limits.js
(server/frontdoor.py), and the fuzzers draw from them (tests/fuzz/)."""

from __future__ import annotations

# Bytes per element of each fixed-size datatype (BYTES: length-prefixed, checked apart).
DATATYPE_SIZES = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "BF16": 2,
    "FP32": 4,
    "FP64": 8,
    "BYTES": 0,
}
# The InferTensorContents field that carries each datatype's typed values (FP16 and BF16 have
# none: raw_input_contents only).
TYPED_FIELD = {
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
TYPED_FIELDS = tuple(sorted(set(TYPED_FIELD.values())))
MAX_RANK = 16  # dimensions of a tensor's shape
# config.pbtxt's TYPE_* names as the KServe protocol spells them (TYPE_STRING is BYTES).
CONFIG_DATATYPES = {"TYPE_STRING": "BYTES", **{f"TYPE_{name}": name for name in DATATYPE_SIZES if name != "BYTES"}}
