"""``/v1/rerank`` and ``/score`` on the cross-encoder reranker through the real gateway: a
random-init BERT cross-encoder checkpoint exported by the real export path into a copy of the
model repository (tests/integration/reranker_repository.py), a real tritonserver serving
``text_reranker`` beside the embedding model, the gateway in front of it.

Covered: relevance_score = transformers' logit of each pair within the export gate's tolerance,
results sorted, usage = the model's token counts; top_n, return_documents; /score 1:N and N:N
equal to rerank and to the reference; more documents than one Triton call takes, split into calls
of max_documents (counted by Triton) and still right; a pair over the token limit and truncate as
400 naming the request's field; the embedding model still scoring by cosine beside it; /v1/models.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests

from export import cross_encoder, variants
from openai_gateway.catalog import Catalog
from tests.integration.conftest import GATEWAY_TEST_KEY
from tests.integration.reranker_repository import Reference
from tests.integration.test_openai_gateway_rerank import cosine, triton_metric

RERANKER, EMB, CACHED = "text_reranker", "text_embedding", "text_embedding_cached"
AUTH = {"Authorization": f"Bearer {GATEWAY_TEST_KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def exported(reranker_repository):
    return reranker_repository


@pytest.fixture(scope="module")
def reference(exported):
    return Reference(*exported)


@pytest.fixture(scope="module")
def stack(reranker_server, start_gateway, exported):
    repo, _ = exported
    with start_gateway(reranker_server.triton_grpc_url, "--rate-limit", "0", "--model-repository", str(repo)) as gw:
        yield reranker_server, gw


@pytest.fixture(scope="module")
def gateway(stack):
    return stack[1]


@pytest.fixture(scope="module")
def tolerance():
    return variants.load_gates()["text_cross_encoder"]["fp32"]["max_logit_diff"]


def post(gw, path: str, body: dict, expect: int = 200) -> dict:
    r = requests.post(gw.url + path, data=json.dumps(body), headers=AUTH, timeout=120)
    assert r.status_code == expect, (path, r.status_code, r.text)
    return r.json()


def rerank(gw, query: str, documents: list, **extra) -> dict:
    return post(gw, "/v1/rerank", {"model": RERANKER, "query": query, "documents": documents, **extra})


def by_index(body: dict) -> np.ndarray:
    results = body["results"]
    scores = np.zeros(len(results))
    for r in results:
        scores[r["index"]] = r["relevance_score"]
    return scores


def test_rerank_scores_are_the_checkpoints_logits_sorted(gateway, reference, tolerance):
    for query, documents in cross_encoder.gate_pairs():
        body = rerank(gateway, query, documents)
        assert body["model"] == RERANKER and body["id"].startswith("rerank-")
        scores = [r["relevance_score"] for r in body["results"]]
        assert scores == sorted(scores, reverse=True), scores
        assert sorted(r["index"] for r in body["results"]) == list(range(len(documents)))
        assert [r["document"]["text"] for r in body["results"]] == [documents[r["index"]] for r in body["results"]]
        expected = reference.scores(query, documents)
        assert np.abs(by_index(body) - expected).max() <= tolerance, (query, by_index(body), expected)
        tokens = int(reference.tokenizer.encode(query, documents).num_tokens.sum())
        assert body["usage"] == {"total_tokens": tokens}, body["usage"]
    # Raw logits, not a probability or a cosine: a random model's spread is not squeezed into [0, 1].
    assert np.ptp(by_index(rerank(gateway, *cross_encoder.gate_pairs()[0]))) > 1e-3


def test_top_n_and_return_documents(gateway):
    query, documents = cross_encoder.gate_pairs()[0]
    full = rerank(gateway, query, documents)
    assert rerank(gateway, query, documents, top_n=2)["results"] == full["results"][:2]
    bare = rerank(gateway, query, documents, return_documents=False)
    assert [set(r) for r in bare["results"]] == [{"index", "relevance_score"}] * len(documents)
    assert [(r["index"], r["relevance_score"]) for r in bare["results"]] == [
        (r["index"], r["relevance_score"]) for r in full["results"]
    ]
    objects = rerank(gateway, query, [{"text": d} for d in documents])
    assert objects["results"] == full["results"]
    # TEI's body (no model: the served reranker) and raw_scores false: its logits through a sigmoid.
    logits = by_index(full)
    tei = post(gateway, "/rerank", {"query": query, "texts": documents})
    assert {r["index"] for r in tei} == set(range(len(documents)))
    for r in tei:
        assert abs(r["score"] - 1 / (1 + np.exp(-logits[r["index"]]))) <= 1e-6


def test_score_equals_rerank_one_to_n_and_n_to_n(gateway, reference, tolerance):
    (q1, docs1), (q2, docs2) = cross_encoder.gate_pairs()[:2]
    ranked = by_index(rerank(gateway, q1, docs1))
    scored = post(gateway, "/score", {"model": RERANKER, "text_1": q1, "text_2": docs1})
    assert scored["model"] == RERANKER and [d["index"] for d in scored["data"]] == list(range(len(docs1)))
    assert np.abs(np.array([d["score"] for d in scored["data"]]) - ranked).max() <= 1e-6
    # N:N, the two queries interleaved: grouped by text_1 into two calls, answered in pair order.
    text_1 = [q1, q2, q1, q2]
    text_2 = [docs1[0], docs2[0], docs1[1], docs2[1]]
    pairs = post(gateway, "/v1/score", {"model": RERANKER, "text_1": text_1, "text_2": text_2})
    got = np.array([d["score"] for d in pairs["data"]])
    expected = np.array([reference.scores(a, [b])[0] for a, b in zip(text_1, text_2)])
    assert np.abs(got - expected).max() <= tolerance, (got, expected)
    tokens = sum(int(reference.tokenizer.encode(a, [b]).num_tokens[0]) for a, b in zip(text_1, text_2))
    assert pairs["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def test_more_documents_than_one_call_takes_are_sent_in_calls_of_max_documents(stack, exported, reference, tolerance):
    server, gw = stack
    limit = Catalog.from_repository(exported[0]).models[RERANKER].max_documents  # type: ignore[union-attr]
    query = "which sentence mentions the number seven"
    documents = [f"Sentence {i} of the list mentions the number {i % 11} and a colour." for i in range(limit + 6)]
    before = triton_metric(server, "nv_inference_request_success", model=RERANKER)
    body = rerank(gw, query, documents)
    calls = triton_metric(server, "nv_inference_request_success", model=RERANKER) - before
    assert calls == 2, f"{len(documents)} documents in {calls} Triton calls; expected 2 of at most {limit}"
    expected = reference.scores(query, documents)
    assert np.abs(by_index(body) - expected).max() <= tolerance
    assert [r["relevance_score"] for r in body["results"]] == sorted(by_index(body), reverse=True)


def test_a_pair_over_the_token_limit_is_400_naming_the_requests_field(gateway):
    long_doc = "dehydration " * 600
    err = post(gateway, "/v1/rerank", {"model": RERANKER, "query": "q", "documents": ["short", long_doc]}, 400)["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "documents[1]", err
    assert "512" in err["message"] and err["message"].startswith("documents[1]"), err
    # Past the first call of 64 documents: still the request's own index.
    docs = ["short"] * 66 + [long_doc]
    err = post(gateway, "/v1/rerank", {"model": RERANKER, "query": "q", "documents": docs}, 400)["error"]
    assert err["param"] == "documents[66]", err
    err = post(gateway, "/score", {"model": RERANKER, "text_1": ["a", "b"], "text_2": ["short", long_doc]}, 400)["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "text_2[1]", err
    # No per-request truncation on this model (its pair tokenizer's config decides): refused, named.
    err = post(gateway, "/v1/rerank", {"model": RERANKER, "query": "q", "documents": [long_doc], "truncate": True}, 400)["error"]
    assert err["param"] == "truncate", err
    # And it answers afterwards.
    assert len(rerank(gateway, "q", ["short"])["results"]) == 1


def test_the_embedding_model_still_scores_by_cosine_beside_it(gateway):
    query, documents = cross_encoder.gate_pairs()[1]
    body = post(gateway, "/v1/rerank", {"model": EMB, "query": query, "documents": documents})
    vectors = np.array(
        [d["embedding"] for d in post(gateway, "/v1/embeddings", {"model": EMB, "input": [query, *documents]})["data"]]
    )
    expected = np.array([cosine(vectors[0], v) for v in vectors[1:]])
    assert np.abs(by_index(body) - expected).max() <= 1e-5, (by_index(body), expected)


def test_models_lists_the_reranker(gateway):
    listed = {m["id"]: m for m in requests.get(gateway.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]}
    assert listed[RERANKER]["kind"] == "reranker" and listed[EMB]["kind"] == "embedding", listed
    assert requests.get(gateway.url + f"/v1/models/{RERANKER}", headers=AUTH, timeout=30).json()["id"] == RERANKER
