"""One bad request sent straight to text_encoder_router fails alone, with INVALID_ARG.

The router joins the requests of a batch that share a version and padded length into one
encoder call; an id beyond the vocabulary in one of them fails that call. The others must
still be answered, with the vectors text_encoder gives them directly, and the failures must
count as requests, not as a failed call of every request in the group.
"""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.integration.conftest import unload_and_wait
from tests.metrics_text import metric_series, scrape, series_names

ROUTER = "text_encoder_router"
VOCAB = 30522  # all-MiniLM-L6-v2's vocabulary: ids are 0..30521
LENGTH = 16


@pytest.fixture(scope="module")
def server(triton, http_client):
    """The session's server with text_encoder_router loaded for this module (it is on the request
    path only while a rollout runs), unloaded after. Its counters go on across loads: the test
    reads their deltas."""
    http_client.load_model(ROUTER)
    try:
        yield triton
    finally:
        unload_and_wait(http_client, ROUTER)


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


def inputs(ids: np.ndarray):
    out = []
    for name, value in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
        inp = grpcclient.InferInput(name, list(value.shape), "INT64")
        inp.set_data_from_numpy(value)
        out.append(inp)
    return out


def requests(n: int, bad: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    batch = []
    for i in range(n):
        ids = rng.integers(1000, 20000, size=(1 + i % 2, LENGTH), dtype=np.int64)
        ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
        if i == bad:
            ids[0, 5] = VOCAB + 100
        batch.append(ids)
    return batch


def calls(server, *, flushed: bool = True) -> dict[str, float]:
    """canary_encoder_calls_total of version 1 by result, summed over router instances. The router
    makes its labelled counters at its first flush: before one (``flushed=False``), a scrape
    without the family counts nothing; after, the family must be there."""
    text = scrape(server.metrics_url)
    if not flushed and "canary_encoder_calls_total" not in series_names(text):
        return {}
    out: dict[str, float] = {}
    for labels, value in metric_series(text, "canary_encoder_calls_total", version="1"):
        out[labels["result"]] = out.get(labels["result"], 0.0) + value
    return out


def test_eight_concurrent_requests_one_out_of_vocabulary_only_it_fails(client, server):
    batch = requests(8, bad=3)
    direct = {
        i: client.infer("text_encoder", inputs(ids)).as_numpy("sentence_embedding") for i, ids in enumerate(batch) if i != 3
    }
    before = calls(server, flushed=False)
    done: queue.Queue = queue.Queue()
    for i, ids in enumerate(batch):  # all in flight at once: the router batches them
        client.async_infer(ROUTER, inputs(ids), callback=lambda result, error, i=i: done.put((i, result, error)))
    answers = dict((i, (result, error)) for i, result, error in (done.get(timeout=60) for _ in batch))

    result, error = answers[3]
    assert result is None and error is not None
    assert error.status() == "StatusCode.INVALID_ARGUMENT", f"{error.status()}: {error.message()}"
    assert "out of data bounds" in error.message() or "out of range" in error.message(), error.message()
    for i, vectors in direct.items():
        result, error = answers[i]
        assert error is None, f"request {i} failed: {error}"
        got = result.as_numpy("sentence_embedding")
        assert got.shape == vectors.shape == (batch[i].shape[0], 384)
        assert np.abs(got - vectors).max() < 1e-4  # the same vectors as text_encoder's own
        assert (result.as_numpy("encoder_version") == 1).all()

    # Each router instance flushes its tally at its first batch 0.5 s after the last flush.
    deadline = time.monotonic() + 20
    while True:
        time.sleep(0.6)
        for ids in batch[:2]:
            client.async_infer(ROUTER, inputs(ids), callback=lambda result, error: done.put((result, error)))
        for _ in range(2):
            done.get(timeout=60)
        delta = {k: v - before.get(k, 0.0) for k, v in calls(server).items()}
        if delta.get("rejected", 0.0) >= 1 and delta.get("ok", 0.0) >= 7 or time.monotonic() > deadline:
            break
    assert delta.get("error", 0.0) == 0, delta  # the client's bad row is no error of version 1
    assert delta.get("rejected", 0.0) == 1, delta  # one request, not its whole group
    assert delta.get("ok", 0.0) >= 7, delta
