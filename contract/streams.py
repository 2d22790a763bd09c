"""A generation stream that outlives the instance serving it: the inputs a decoupled model declares
so that a door or the gateway can send the request again with the token ids the client already
got, and the rule that tells such a model from its config. The gRPC door and its HTTP stream
listener (server/stream_resume.py, server/stream_door.py), the gateway's catalog and the clients
read them here."""

from __future__ import annotations

from collections.abc import Mapping

ASK_INPUT = "return_token_ids"  # BOOL: each response carries the ids of its new tokens
PREFIX_INPUT = "prefix_token_ids"  # INT32 [-1]: ids already sent; the answer goes on after them
# The continuation inputs and their KServe datatypes.
CONTINUATION_INPUTS = {ASK_INPUT: "BOOL", PREFIX_INPUT: "INT32"}


def continuable(decoupled: bool, input_datatypes: Mapping[str, str]) -> bool:
    """Whether a model's streams can be continued: decoupled, and declaring both continuation
    inputs with their datatypes (``input_datatypes``: input name -> KServe datatype)."""
    return decoupled and all(input_datatypes.get(name) == datatype for name, datatype in CONTINUATION_INPUTS.items())
