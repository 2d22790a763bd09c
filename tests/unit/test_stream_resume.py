"""Generation streams that outlive their upstream, without Triton: the gRPC door's book of
continuable requests (server/stream_resume.py), and the door itself (server/grpc_door.py) in front
of a fake upstream whose first call dies after a few pieces: the client sees every piece once, no
error, and the second call gets the request again with the ids it was sent as prefix_token_ids."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc import aio
from tritonclient.grpc import service_pb2

from server.frontdoor import model_limits
from server.grpc_check import Limits
from server.grpc_door import STREAM, Door, Handler
from server.stream_resume import StreamBook, continuable_models

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
LIMITS = Limits(models=model_limits(REPOSITORY), max_elements=1 << 26)


def generation_request(request_id="r1", ask_ids: bool | None = None, raw: bool = True, model="text_generation"):
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    text = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    flag = req.inputs.add(name="stream", datatype="BOOL", shape=[1])
    if raw:
        req.raw_input_contents.append(struct.pack("<I", 2) + b"Hi")
        req.raw_input_contents.append(b"\x01")
    else:
        text.contents.bytes_contents.append(b"Hi")
        flag.contents.bool_contents.append(True)
    if ask_ids is not None:
        ask = req.inputs.add(name="return_token_ids", datatype="BOOL", shape=[1])
        if raw:
            req.raw_input_contents.append(b"\x01" if ask_ids else b"\x00")
        else:
            ask.contents.bool_contents.append(ask_ids)
    return req


def response(request_id: str, text: str, ids: list[int], final=False, extra: tuple[str, ...] = ()) -> bytes:
    msg = service_pb2.ModelStreamInferResponse()
    r = msg.infer_response
    r.id, r.model_name = request_id, "text_generation"
    r.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    r.raw_output_contents.append(struct.pack("<I", len(text.encode())) + text.encode())
    r.outputs.add(name="token_ids", datatype="INT32", shape=[len(ids)])
    r.raw_output_contents.append(np.asarray(ids, "<i4").tobytes())
    for name in extra:
        r.outputs.add(name=name, datatype="UINT32", shape=[1])
        r.raw_output_contents.append(np.zeros(1, "<u4").tobytes())
    r.parameters["triton_final_response"].bool_param = final
    return msg.SerializeToString()


def prefix_of(req) -> list[int] | None:
    for i, t in enumerate(req.inputs):
        if t.name == "prefix_token_ids":
            assert list(t.shape) == [len(req.raw_input_contents[i]) // 4]
            return np.frombuffer(req.raw_input_contents[i], "<i4").tolist()
    return None


def test_the_continuable_models_are_those_whose_config_declares_the_continuation():
    assert continuable_models(LIMITS.models) == {"text_generation"}


@pytest.mark.parametrize("raw", [True, False])
def test_the_book_asks_for_ids_keeps_those_forwarded_and_continues_after_them(raw):
    book = StreamBook({"text_generation"}, service_pb2)
    sent = service_pb2.ModelInferRequest.FromString(book.outgoing(generation_request(raw=raw)))
    assert sent.parameters["return_token_ids"].bool_param and len(sent.inputs) == 2
    book.mark_sent("r1")
    data, tracked, error = book.incoming(response("r1", "Hel", [5, 6]))
    assert tracked is not None and not error and tracked.ids == [5, 6]
    forwarded = service_pb2.ModelStreamInferResponse.FromString(data).infer_response
    assert [o.name for o in forwarded.outputs] == ["text_output"] and len(forwarded.raw_output_contents) == 1
    book.incoming(response("r1", "lo", [7]))
    (again,) = book.resubmissions()
    again = service_pb2.ModelInferRequest.FromString(again)
    if raw:
        assert prefix_of(again) == [5, 6, 7]
    else:
        (tensor,) = [t for t in again.inputs if t.name == "prefix_token_ids"]
        assert list(tensor.contents.int_contents) == [5, 6, 7] and not again.raw_input_contents
    assert again.id == "r1" and again.parameters["triton_enable_empty_final_response"].bool_param
    book.incoming(response("r1", "", [], final=True))
    assert not book.tracked and not book.can_resume()  # nothing in flight that answered


def test_a_client_that_asked_for_ids_keeps_them_and_what_cannot_be_continued_says_so():
    book = StreamBook({"text_generation"}, service_pb2)
    book.outgoing(generation_request("a", ask_ids=True))
    data, _, _ = book.incoming(response("a", "x", [1]))
    assert data == response("a", "x", [1])  # forwarded as it came
    book.incoming(response("a", "y", [2], extra=("index",)))  # n > 1: no prefix continues it
    assert not book.can_resume()
    for request in (generation_request("b", ask_ids=False), generation_request("c", model="other")):
        other = StreamBook({"text_generation"}, service_pb2)
        assert other.outgoing(request) is None and not other.continuable
    unnamed = StreamBook({"text_generation"}, service_pb2)
    assert unnamed.outgoing(generation_request("")) is not None  # one without an id is unambiguous
    assert unnamed.outgoing(generation_request("")) is None and not unnamed.continuable  # two are not


# --------------------------------------------------------------------------- the door, over a fake upstream


class FakeUpstream:
    """ModelStreamInfer that answers each request with PIECES; its first call dies UNAVAILABLE after
    CUT pieces (a replica killed); later calls continue after the prefix they are given."""

    PIECES = [("The", [10]), (" cap", [11]), ("ital", [12]), (" is", [13]), (" Paris", [14]), (".", [15])]

    def __init__(self, cut: int = 3):
        self.calls: list[list] = []
        self.cut = cut

    async def stream(self, request_iterator, context):
        seen: list = []
        self.calls.append(seen)
        first = len(self.calls) == 1
        async for data in request_iterator:
            req = service_pb2.ModelInferRequest.FromString(data)
            seen.append(req)
            prefix = prefix_of(req) or []
            start = len(prefix)
            for i, (text, ids) in enumerate(self.PIECES[start:], start):
                if first and i == self.cut:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "upstream connect error (replica killed)")
                yield response(req.id, text, ids)
                await asyncio.sleep(0.01)
            yield response(req.id, "", [], final=True)


async def _serve(handler) -> tuple[aio.Server, int]:
    server = aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _through_the_door(cut: int, requests=None):
    async def go():
        fake = FakeUpstream(cut)
        upstream, up_port = await _serve(
            grpc.method_handlers_generic_handler(
                "inference.GRPCInferenceService", {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(fake.stream)}
            )
        )
        door = Door(f"127.0.0.1:{up_port}", LIMITS, None, 1 << 26)
        front, port = await _serve(Handler(door))
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:

                async def one():
                    for req in requests or [generation_request()]:
                        yield req.SerializeToString()

                got, error = [], None
                try:
                    async for r in channel.stream_stream(STREAM)(one()):
                        got.append(service_pb2.ModelStreamInferResponse.FromString(r))
                except aio.AioRpcError as exc:
                    error = exc
        finally:
            await front.stop(None)
            await upstream.stop(None)
            await door.channel.close()
        return fake, door, got, error

    return asyncio.run(go())


def test_the_door_continues_a_stream_whose_upstream_died_mid_answer():
    fake, door, got, error = _through_the_door(cut=3)
    assert error is None
    texts = [struct.unpack_from("<I", r.infer_response.raw_output_contents[0])[0] for r in got]
    assert all(not r.error_message for r in got)
    text = b"".join(r.infer_response.raw_output_contents[0][4:] for r in got).decode()
    assert text == "The capital is Paris." and len(texts) == len(FakeUpstream.PIECES) + 1
    assert all([o.name for o in r.infer_response.outputs] == ["text_output"] for r in got)  # ids taken out again
    (first,), (second,) = fake.calls
    assert prefix_of(first) is None and prefix_of(second) == [10, 11, 12]
    assert (door.streams_resumed, door.requests_resumed) == (1, 1)


def test_a_stream_lost_before_its_first_piece_ends_unavailable_as_before():
    """Its client retries it; the door does not send around a request that never answered."""
    fake, door, got, error = _through_the_door(cut=0)
    assert got == [] and error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert len(fake.calls) == 1 and door.streams_resumed == 0


def test_a_refusal_by_the_door_is_its_own_answer_never_a_tracked_requests():
    """tritonclient's requests have no id by default: a request the door refuses (its own error response,
    id "") must reach its client as it is, not be taken for the id-less request in flight."""
    bad = generation_request(request_id="")
    bad.inputs[0].datatype = "FP32"  # text_input is BYTES: the door refuses it, naming the field
    fake, door, got, error = _through_the_door(cut=99, requests=[generation_request(request_id=""), bad])
    assert error is None and door.refused == 1 and door.streams_resumed == 0
    errors = [r for r in got if r.error_message]
    assert len(errors) == 1 and "text_input" in errors[0].error_message, errors
    text = b"".join(r.infer_response.raw_output_contents[0][4:] for r in got if not r.error_message).decode()
    assert text == "The capital is Paris."
    assert all([o.name for o in r.infer_response.outputs] == ["text_output"] for r in got if not r.error_message)
