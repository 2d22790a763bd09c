"""The cross-encoder reranker served: a random-init BERT cross-encoder checkpoint (what a team's
own ms-marco-style checkpoint looks like) exported by the real export path into a copy of the
model repository, then text_reranker on a real tritonserver: its SCORES equal transformers'
logits of the same checkpoint within the export gate's tolerance, hostile requests are refused
naming the field, and the model answers afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from export import cross_encoder, variants
from tests.integration.reranker_repository import Reference

MODEL = "text_reranker"


@pytest.fixture(scope="module")
def exported(reranker_repository):
    return reranker_repository


@pytest.fixture(scope="module")
def server(reranker_server):
    return reranker_server


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.http_url)
    yield c
    c.close()


def _bytes(name, values):
    data = np.array([x.encode() if isinstance(x, str) else x for x in values], dtype=object)
    tensor = httpclient.InferInput(name, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    return tensor


def _inputs(query, documents):
    return [_bytes("QUERY", query if isinstance(query, list) else [query]), _bytes("DOCUMENTS", documents)]


def rerank(client, query, documents):
    result = client.infer(MODEL, _inputs(query, documents))
    return result.as_numpy("SCORES"), result.as_numpy("NUM_TOKENS")


def reference_scores(exported, query, documents):
    return Reference(*exported).scores(query, documents)


def test_served_scores_equal_the_checkpoints_logits_within_the_gate(client, exported):
    tolerance = variants.load_gates()["text_cross_encoder"]["fp32"]["max_logit_diff"]
    for query, documents in cross_encoder.gate_pairs():
        scores, num_tokens = rerank(client, query, documents)
        assert scores.shape == (len(documents), 1) and scores.dtype == np.float32
        expected = reference_scores(exported, query, documents)
        assert np.abs(scores[:, 0] - expected).max() <= tolerance, (query, scores[:, 0], expected)
        assert num_tokens.shape == (len(documents),) and (num_tokens > 3).all()
    # Not a constant model: the documents of one query get different scores.
    scores, _ = rerank(client, *cross_encoder.gate_pairs()[0])
    assert scores.std() > 1e-3


def _refused(client, inputs) -> str:
    with pytest.raises(InferenceServerException) as info:
        client.infer(MODEL, inputs)
    assert info.value.status() == "400", info.value
    return str(info.value)


def test_hostile_requests_are_refused_naming_the_field_and_the_model_still_answers(client, exported):
    too_many = ["doc"] * 65
    assert "DOCUMENTS" in _refused(client, _inputs("q", too_many)) and "64" in _refused(client, _inputs("q", too_many))
    long_doc = "dehydration " * 600
    message = _refused(client, _inputs("symptoms", ["short one", long_doc]))
    assert "DOCUMENTS[1]" in message and "512" in message
    assert "DOCUMENTS[0]" in _refused(client, _inputs("q", [b"\xff\xfe junk"]))
    assert "QUERY" in _refused(client, _inputs("   ", ["a document"]))
    assert "QUERY" in _refused(client, _inputs(["two", "queries"], ["a document"]))
    numbers = httpclient.InferInput("DOCUMENTS", [2], "INT64")
    numbers.set_data_from_numpy(np.array([1, 2], dtype=np.int64))
    assert "DOCUMENTS" in _refused(client, [_bytes("QUERY", ["q"]), numbers])
    assert "DOCUMENTS" in _refused(client, [_bytes("QUERY", ["q"])])
    # Afterwards: answered, and right.
    query, documents = cross_encoder.gate_pairs()[1]
    scores, _ = rerank(client, query, documents)
    assert np.abs(scores[:, 0] - reference_scores(exported, query, documents)).max() <= 1e-3
