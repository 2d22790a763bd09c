"""The gateway continues a generation stream that Triton lost after its first pieces
(openai_gateway/triton.py ``TritonBackend.generate``), without Triton: a fake client whose first
stream ends UNAVAILABLE after two pieces; the second request carries their token ids as
prefix_token_ids and the pieces the caller sees are the whole answer, once each."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from openai_gateway import triton as gateway_triton
from openai_gateway.catalog import Catalog, GenerationModel
from openai_gateway.completions import GenerationJob
from openai_gateway.errors import APIError

PIECES = [("The", [10]), (" capital", [11]), (" is", [12]), (" Paris.", [13])]


class Result:
    def __init__(self, text: str, ids: list[int], final: bool):
        self.arrays = {"text_output": np.array([text.encode()], dtype=object), "token_ids": np.asarray(ids, np.int32)}
        self.final = final

    def as_numpy(self, name):
        return self.arrays.get(name)

    def get_response(self):
        class Param:
            bool_param = self.final

        class Response:
            parameters = {"triton_final_response": Param()}

        return Response()


class FakeClient:
    """Its first stream dies after ``cut`` pieces; later ones continue after the prefix they get."""

    def __init__(self, cut: int | None):
        self.cut, self.requests = cut, []

    def stream_infer(self, requests, stream_timeout=None):
        return LazyStream(self, requests)


class LazyStream:
    """tritonclient.grpc.aio's stream_infer: (result, error) pairs, and cancel()."""

    def __init__(self, client: FakeClient, requests):
        self.client, self.request_iter = client, requests

    def cancel(self):
        pass

    def __aiter__(self):
        return self._run()

    async def _run(self):
        request = await anext(self.request_iter)
        inputs = {i.name(): i for i in request["inputs"]}
        self.client.requests.append(inputs)
        prefix = len(inputs["prefix_token_ids"]._get_content()) // 4 if "prefix_token_ids" in inputs else 0  # INT32 raw
        first = len(self.client.requests) == 1
        for k, (text, ids) in enumerate(PIECES[prefix:], prefix):
            if first and self.client.cut is not None and k == self.client.cut:
                raise InferenceServerException("upstream lost", status="StatusCode.UNAVAILABLE")
            yield Result(text, ids, final=k == len(PIECES) - 1), None


def _collect(cut: int | None, continuable: bool = True):
    model = GenerationModel("text_generation", 4096, continuable=continuable)
    backend = gateway_triton.TritonBackend("fake:0", Catalog([model]), 5.0, 5.0)
    backend.client = FakeClient(cut)
    job = GenerationJob(model=model, chat=False, text_input="Hi", sampling={}, stream=True, include_usage=False)

    async def go():
        return [p async for p in backend.generate(job, "req-1")]

    return asyncio.run(go()), backend


def test_a_stream_lost_after_two_pieces_is_continued_after_their_token_ids(monkeypatch):
    monkeypatch.setattr(gateway_triton, "RESUME_BACKOFF_S", 0.0)
    pieces, backend = _collect(cut=2)
    assert "".join(p.text for p in pieces) == "The capital is Paris." and pieces[-1].final
    first, second = backend.client.requests
    assert "return_token_ids" in first and "prefix_token_ids" not in first
    assert np.frombuffer(second["prefix_token_ids"]._get_content(), "<i4").tolist() == [10, 11]
    assert backend.streams_resumed == 1


def test_before_the_first_piece_or_without_the_models_inputs_the_error_goes_to_the_client(monkeypatch):
    monkeypatch.setattr(gateway_triton, "RESUME_BACKOFF_S", 0.0)
    with pytest.raises(APIError) as e:
        _collect(cut=0)
    assert e.value.status == 503
    with pytest.raises(APIError) as e:
        _collect(cut=2, continuable=False)
    assert e.value.status == 503


class SilentAfter:
    """A grpc.aio-like stream: ``n`` items, then silence until cancelled (a read of a cancelled
    call raises CancelledError, as grpc.aio's does)."""

    def __init__(self, n: int):
        self.n, self.cancelled = n, asyncio.Event()

    def cancel(self):
        self.cancelled.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.n:
            self.n -= 1
            await asyncio.sleep(0)
            return ("item", None)
        await self.cancelled.wait()
        raise asyncio.CancelledError()


def test_one_watcher_per_stream_ends_a_silent_stream_of_a_marked_model(tmp_path, monkeypatch):
    monkeypatch.setattr(gateway_triton, "HEALTH_POLL_S", 0.02)
    backend = gateway_triton.TritonBackend("fake:0", Catalog([]), 5.0, 5.0, health_dir=tmp_path)
    started = []
    real = asyncio.ensure_future
    monkeypatch.setattr(asyncio, "ensure_future", lambda *a, **k: started.append(1) or real(*a, **k))

    async def go():
        got = []
        (tmp_path / "text_generation").write_text("stub died")
        with pytest.raises(APIError) as e:
            async for item in backend._watched(SilentAfter(500), "text_generation"):
                got.append(item)  # items flowing while the model is marked are not cut
        return got, e.value

    got, error = asyncio.run(go())
    assert len(got) == 500 and error.status == 503 and error.code == "model_unavailable"
    assert len(started) == 1  # one watcher for the stream, not a task per item
