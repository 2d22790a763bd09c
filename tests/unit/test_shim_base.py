"""python_backends.shim_base: the decode -> run -> encode lifecycle, driven with a fake pb_utils."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from contract.errors import InputError
from python_backends import shim_base
from python_backends.shim_base import AsyncBatchShim, BatchShim
from tests.unit.triton_fakes import Request, make_pb_utils, model_config, tensor, triton_logging

PB = make_pb_utils()
pytestmark = pytest.mark.usefixtures(triton_logging.__name__)
CONFIG = model_config("doubler", [tensor("X", [1], "TYPE_FP32")], [tensor("Y", [1], "TYPE_FP32")])


class Doubler(BatchShim):
    """Doubles X; a negative X fails its request in decode, an X of 13 fails it in run."""

    pb_utils = PB

    def load(self, args):
        self.config.require("input", "X", "TYPE_FP32", (1,))
        self.runs, self.closed = [], False

    def decode(self, request):
        x = PB.get_input_tensor_by_name(request, "X").as_numpy()
        if (x < 0).any():
            raise InputError("X", "must not be negative")
        return x

    def run(self, decoded):
        self.runs.append(sorted(decoded))
        return [(i, RuntimeError("unlucky") if (x == 13).any() else x * 2) for i, x in decoded.items()]

    def encode(self, result):
        return PB.InferenceResponse(output_tensors=[PB.Tensor("Y", result)])

    def close(self):
        self.closed = True

    def metric_objects(self):
        return ["a metric"]


class AsyncDoubler(AsyncBatchShim, Doubler):
    async def run(self, decoded):
        await asyncio.sleep(0)
        return Doubler.run(self, decoded)


def requests():
    return [Request(f"r{i}", X=np.array([[x]], np.float32)) for i, x in enumerate([1.0, -1.0, 13.0, 4.0])]


def check(responses):
    assert len(responses) == 4 and all(r is not None for r in responses)
    assert responses[0].output("Y").tolist() == [[2.0]] and responses[3].output("Y").tolist() == [[8.0]]
    assert responses[1].error().code() == PB.TritonError.INVALID_ARG and "must not be negative" in responses[1].error().message()
    assert responses[2].error().code() == PB.TritonError.INTERNAL and "unlucky" in responses[2].error().message()


@pytest.mark.parametrize("cls", [Doubler, AsyncDoubler])
def test_one_response_per_request_each_failure_its_own(cls, monkeypatch):
    monkeypatch.setattr(shim_base, "freeze_loaded_objects", lambda: 0)
    model = cls()
    model.initialize({"model_config": CONFIG})
    out = model.execute(requests())
    check(asyncio.run(out) if cls is AsyncDoubler else out)
    assert model.runs == [[0, 2, 3]]  # one run for the batch, without the request decode refused


def test_run_is_called_even_when_every_request_was_refused(monkeypatch):
    monkeypatch.setattr(shim_base, "freeze_loaded_objects", lambda: 0)
    model = Doubler()
    model.initialize({"model_config": CONFIG})
    responses = model.execute([Request("bad", X=np.array([[-2.0]], np.float32))])
    assert responses[0].error().code() == PB.TritonError.INVALID_ARG and model.runs == [[]]


def test_a_load_failure_names_the_model_and_finalize_keeps_the_metrics(monkeypatch):
    monkeypatch.setattr(shim_base, "freeze_loaded_objects", lambda: 0)
    broken = model_config("doubler", [tensor("X", [2], "TYPE_FP32")], [])
    with pytest.raises(PB.TritonModelException, match=r"doubler: .*'X' must have dims \[1\]"):
        Doubler().initialize({"model_config": broken})
    kept = []
    monkeypatch.setattr(shim_base, "keep_metrics", lambda *objects: kept.extend(objects))
    model = Doubler()
    model.initialize({"model_config": CONFIG})
    model.finalize()
    assert model.closed and kept == ["a metric"]


def test_a_sender_reply_sends_arrays_errors_with_their_data_and_the_final_flag():
    from contract.errors import parse_error
    from python_backends.shim import SenderReply

    pb = make_pb_utils()

    class Sender:
        sent: list = []

        def send(self, response=None, flags=0):
            self.sent.append((response, flags))

        def is_cancelled(self):
            return False

    sender = Sender()
    reply = SenderReply(pb, sender, "text_generation", "r1")
    reply.send({"text_output": np.array([b"hi"], dtype=object)}, final=False)
    reply.fail(InputError("max_tokens", "must be > 0"))
    reply.close()
    (piece, f0), (error, f1), (closed, f2) = sender.sent
    assert piece.output("text_output").tolist() == [b"hi"] and f0 == 0
    data = parse_error(error.error().message())
    assert error.error().code() == pb.TritonError.INVALID_ARG and (data.code, data.field) == ("invalid_value", "max_tokens")
    assert closed is None and f1 == f2 == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and not reply.is_cancelled()
