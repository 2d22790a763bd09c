"""Other components' words, read in one place.

The project's own errors carry their code, field and values as data (:mod:`contract.errors`),
and code reads that data, never the words. A few components give only prose: tritonserver's own
errors on a gRPC stream (no status there) and its shutdown log, tritonclient's error for a body it cannot decode,
ONNX Runtime's status inside the native onnxruntime backend's message, Pillow's decoder errors.
tritonclient also drops what its gRPC exception was made from (the trailing metadata that
carries an error's data): where it keeps that is read here too. This module is where that prose
is read; ``tests/unit/test_prose.py`` makes each component produce its message where it runs
here and pins the wording (and the shape) each function reads.
"""

from __future__ import annotations

import re

# tritonserver 2.51's own words for a model it cannot reach now ("Request for unknown model",
# "... is not ready", "... unavailable"), in a stream error, which carries no status.
TRITON_UNAVAILABLE_WORDS = ("unknown model", "is not ready", "unavailable")
# Load-shedding rejections for transports that do not carry the status (a message read from a
# stream, an INTERNAL wrapping an UNAVAILABLE): tritonserver's dynamic batcher ("Exceeds maximum
# queue size"), its unavailable model, and the models' own words where their data was lost on
# the way (an error re-raised by a component that keeps only the message).
RETRY_WORDS = ("exceeds maximum queue size", "unavailable", "overloaded", "no capacity")
# ONNX Runtime's status for an input it cannot run (an id beyond the vocabulary), as ONNX
# Runtime's Python API ("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : ...") and the native
# onnxruntime backend ("onnx runtime error 2: ...") word it.
_ONNXRUNTIME_INVALID = re.compile(r"\bINVALID_ARGUMENT\b|onnx runtime error 2:")
# tritonserver's shutdown log line while it waits for models to unload ("Timeout 27: Found 2 live
# models and 0 in-flight non-inference requests").
_TRITON_LIVE_MODELS = re.compile(r"Found (\d+) live models and (\d+) in-flight")
# tritonclient.http's message when a response body is not Triton's JSON (a proxy's error page).
_TRITONCLIENT_UNDECODABLE = "an exception occurred in the client while decoding"


def triton_unavailable(message: str) -> bool:
    """tritonserver's own stream error says the model cannot be reached now (retry: 503)."""
    lowered = message.lower()
    return any(w in lowered for w in TRITON_UNAVAILABLE_WORDS)


def says_retry(message: str) -> bool:
    """A message without a status says the request was shed (try again, maybe elsewhere)."""
    lowered = message.lower()
    return any(w in lowered for w in RETRY_WORDS)


def onnxruntime_invalid_input(message: str) -> bool:
    """ONNX Runtime refused the request's input (INVALID_ARGUMENT), not a failure of its own."""
    return bool(_ONNXRUNTIME_INVALID.search(message))


def triton_live_models(log_lines: list[str]) -> int | None:
    """How many models tritonserver's shutdown still waits for, from its latest such log line,
    once no request is in flight; None when it has written none."""
    for line in reversed(log_lines):
        found = _TRITON_LIVE_MODELS.search(line)
        if found:
            return int(found.group(1)) if found.group(2) == "0" else None
    return None


def tritonclient_undecodable(message: str) -> bool:
    """tritonclient.http could not decode the body as Triton's error: not tritonserver's answer
    (a proxy whose upstream is down or restarting)."""
    return message.startswith(_TRITONCLIENT_UNDECODABLE)


def pillow_truncated(message: str) -> bool:
    """Pillow's decoder says the file ends early ("image file is truncated", "Truncated File Read")."""
    return "truncated" in message.lower()


def tritonclient_rpc_error(exc: BaseException) -> BaseException | None:
    """The gRPC error a tritonclient.grpc exception was made from, or None. tritonclient raises
    its InferenceServerException (details and status only) inside the ``except grpc.RpcError``
    block, ``from None``: the RpcError, with its trailing metadata, stays as ``__context__``."""
    context = exc.__context__
    if type(exc).__name__ == "InferenceServerException" and context is not None and hasattr(context, "trailing_metadata"):
        return context
    return None
