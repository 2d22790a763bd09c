"""Generation streams that outlive a replica: what the gRPC door keeps of each continuable request
on a ``ModelStreamInfer`` stream, and the request that continues it elsewhere.

A model is continuable when it is decoupled and its config declares the inputs ``return_token_ids``
(BOOL) and ``prefix_token_ids`` (INT32 ``[-1]``), which come with its output ``token_ids`` (text_generation:
docs/generation.md#streams-that-outlive-a-replica). The door asks every such request for its token
ids (a request parameter, so the client's tensors go on as they came), keeps the ids of the
responses it forwards (and takes them out again where the client did not ask for them), and when
the replica serving the stream is lost it sends each request still in flight again, the ids the
client got as ``prefix_token_ids``: the model continues the answer after them, token for token.

No asyncio and no gRPC channel here: the door (server/grpc_door.py) owns the calls; this module
only reads and writes the protobuf messages, so it is unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from contract.streams import ASK_INPUT, PREFIX_INPUT, continuable

IDS_OUTPUT = "token_ids"
# Outputs of answers that a prefix cannot continue: several choices, log-probabilities to realign.
NOT_CONTINUABLE_OUTPUTS = ("index", "logprobs")
FINAL = "triton_final_response"


def continuable_models(limits: Mapping[str, dict]) -> frozenset[str]:
    """The decoupled models whose config declares the continuation inputs (``limits``:
    ``server.frontdoor.model_limits``, which reads every config.pbtxt)."""
    return frozenset(
        name
        for name, spec in limits.items()
        if continuable(bool(spec.get("decoupled")), {k: v.get("datatype", "") for k, v in spec.get("inputs", {}).items()})
    )


def _input_index(request, name: str) -> int | None:
    for i, tensor in enumerate(request.inputs):
        if tensor.name == name:
            return i
    return None


def _input_values(request, index: int, dtype: str) -> np.ndarray:
    """One input's values, from the raw contents when the request uses them, else its contents."""
    if len(request.raw_input_contents):
        return np.frombuffer(request.raw_input_contents[index], dtype=dtype)
    contents = request.inputs[index].contents
    return np.asarray(contents.bool_contents if dtype == "?" else contents.int_contents, dtype=dtype)


def _output_ids(response, index: int) -> list[int]:
    if len(response.raw_output_contents):
        return np.frombuffer(response.raw_output_contents[index], dtype="<i4").tolist()
    return list(response.outputs[index].contents.int_contents)


@dataclass
class Tracked:
    """One continuable request in flight: as sent upstream, and what its client got so far."""

    request: Any  # ModelInferRequest, with return_token_ids asked
    client_wants_ids: bool
    prefix: list[int] = field(default_factory=list)  # the client's own prefix_token_ids
    ids: list[int] = field(default_factory=list)  # the token ids of the responses forwarded
    responses: int = 0
    continuable: bool = True
    sent: bool = False  # handed to an upstream call (else it is still queued for the current one)
    resends: int = 0


class StreamBook:
    """The continuable requests of one client stream, by request id.

    ``continuable`` turns false for good once the stream carries a request the door cannot send
    again (another model, an id already in flight, a ``return_token_ids`` the client set false):
    then a lost replica ends the stream as before.
    """

    def __init__(self, models: Iterable[str], pb: Any):
        self.models = frozenset(models)
        self.pb = pb
        self.tracked: dict[str, Tracked] = {}
        self.continuable = True

    def outgoing(self, parsed) -> bytes | None:
        """The bytes to send upstream for a checked client request: re-encoded with
        ``return_token_ids`` asked when it is tracked, None to send the client's bytes as they came."""
        if not self.continuable:
            return None
        # Responses name their request by id: two in flight with one id (two without any) are ambiguous.
        if parsed.model_name not in self.models or parsed.id in self.tracked:
            self.continuable = False
            return None
        request = self.pb.ModelInferRequest()
        request.CopyFrom(parsed)
        asked = _input_index(request, ASK_INPUT)
        if asked is not None:
            values = _input_values(request, asked, "?")
            if not (values.size == 1 and bool(values[0])):
                self.continuable = False
                return None
        elif ASK_INPUT in request.parameters:
            if not request.parameters[ASK_INPUT].bool_param:
                self.continuable = False
                return None
            asked = -1
        else:
            request.parameters[ASK_INPUT].bool_param = True
        prefix: list[int] = []
        at = _input_index(request, PREFIX_INPUT)
        if at is not None:
            prefix = [int(t) for t in _input_values(request, at, "<i4")]
        self.tracked[request.id] = Tracked(request, client_wants_ids=asked is not None, prefix=prefix)
        return request.SerializeToString()

    def mark_sent(self, request_id: str | None) -> None:
        t = self.tracked.get(request_id or "")
        if t is not None:
            t.sent = True

    def incoming(self, data: bytes) -> tuple[bytes, Tracked | None, str]:
        """One upstream response: (the bytes to forward, its tracked request or None, its error
        message). The ids it carries are kept and taken out where the client did not ask; a final
        response or an error ends the request's tracking (the door decides about errors first)."""
        if not self.tracked:
            return data, None, ""
        message = self.pb.ModelStreamInferResponse.FromString(data)
        response = message.infer_response
        t = self.tracked.get(response.id)
        if t is None:
            return data, None, ""
        if message.error_message:
            return data, t, message.error_message
        t.responses += 1
        names = [o.name for o in response.outputs]
        if any(name in names for name in NOT_CONTINUABLE_OUTPUTS):
            t.continuable = False
        if IDS_OUTPUT in names:
            at = names.index(IDS_OUTPUT)
            t.ids.extend(_output_ids(response, at))
            if not t.client_wants_ids:
                del response.outputs[at]
                if len(response.raw_output_contents):
                    del response.raw_output_contents[at]
                data = message.SerializeToString()
        if FINAL in response.parameters and response.parameters[FINAL].bool_param:
            self.tracked.pop(response.id, None)
        return data, t, ""

    def done(self, request_id: str) -> None:
        """The request ended (its error was forwarded)."""
        self.tracked.pop(request_id, None)

    def can_resume(self) -> bool:
        """Whether the stream goes on after a loss: every request in flight can be sent again and
        one of them has answered already. A stream lost before any answer ends as it always did
        (UNAVAILABLE: its client retries), so a request that fails at once is never sent around."""
        return (
            self.continuable
            and any(t.responses for t in self.tracked.values())
            and all(t.continuable for t in self.tracked.values())
        )

    def resubmission(self, t: Tracked) -> bytes:
        """The request that continues ``t`` after the tokens its client got."""
        request = self.pb.ModelInferRequest()
        request.CopyFrom(t.request)
        prefix = t.prefix + t.ids
        at = _input_index(request, PREFIX_INPUT)
        raw = len(request.raw_input_contents) > 0
        if at is not None:
            del request.inputs[at]
            if raw:
                del request.raw_input_contents[at]
        if prefix:
            tensor = request.inputs.add(name=PREFIX_INPUT, datatype="INT32", shape=[len(prefix)])
            if raw:
                request.raw_input_contents.append(np.asarray(prefix, dtype="<i4").tobytes())
            else:
                tensor.contents.int_contents.extend(prefix)
        t.resends += 1
        return request.SerializeToString()

    def resubmissions(self) -> list[bytes]:
        """Every request in flight that an upstream call took, continued (in the order sent)."""
        return [self.resubmission(t) for t in self.tracked.values() if t.sent]
