"""``/v1/rerank`` and ``/score`` through the real gateway in front of a real tritonserver.

One server for this module with only the embedding models loaded, its result cache's L2 at a
real redis-server (each of ``text_embedding_cached``'s two instances has its own L1; with L2 a
text cached by one instance is a hit on the other, so "repeated documents cost nothing" holds
whichever instance answers).

Covered: a hand-made relevance set (``tests/data/rerank/relevance.json``, 14 queries of 5
documents, one relevant each) ranked with a mean reciprocal rank of at least 0.9 (printed);
a repeated rerank answered from the cache (the model computes no text, the cache counts a hit
per distinct text); ``/score`` equal to ``/v1/rerank`` and to the cosine of ``/v1/embeddings``
vectors; token usage equal to /v1/embeddings'; ``top_n``, ``return_documents``, document
objects, vLLM's other paths; bad input as 4xx naming the field, never 5xx; the key required.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import requests

from server.layout import ROOT
from server.redis_process import RedisProcess
from tests.integration.conftest import GATEWAY_TEST_KEY
from tests.metrics_text import metric_sum, scrape

EMB, CACHED = "text_embedding", "text_embedding_cached"
ALIAS = "sentence-transformers/all-MiniLM-L6-v2"
AUTH = {"Authorization": f"Bearer {GATEWAY_TEST_KEY}"}
RELEVANCE = ROOT / "tests" / "data" / "rerank" / "relevance.json"
MRR_MIN = 0.9
TOLERANCE = 1e-5
MAX_INPUTS = 8  # the module's gateway runs with --max-inputs 8


@pytest.fixture(scope="module")
def stack(start_triton, start_gateway):
    """(tritonserver, gateway): the embedding models only, L2 at a real Redis."""
    with RedisProcess() as redis_l2:
        env = {"EMBEDDING_CACHE_L2_REDIS_URL": redis_l2.url, "EMBEDDING_CACHE_WARN_INTERVAL_S": "3600"}
        with start_triton("triton-rerank-", (EMB, CACHED), env=env) as server:
            with start_gateway(server.triton_grpc_url, "--rate-limit", "0", "--max-inputs", str(MAX_INPUTS)) as gw:
                yield server, gw


@pytest.fixture(scope="module")
def gateway(stack):
    return stack[1]


def post(gw, path: str, body, expect: int | None = 200) -> dict:
    r = requests.post(gw.url + path, data=json.dumps(body), headers={**AUTH, "Content-Type": "application/json"}, timeout=120)
    if expect is not None:
        assert r.status_code == expect, (path, r.status_code, r.text)
    return r.json()


def rerank(gw, query: str, documents: list, path: str = "/v1/rerank", **extra) -> dict:
    return post(gw, path, {"model": EMB, "query": query, "documents": documents, **extra})


def embeddings(gw, texts: list[str]) -> tuple[np.ndarray, int]:
    """The gateway's /v1/embeddings vectors (float64) and its prompt_tokens."""
    body = post(gw, "/v1/embeddings", {"model": EMB, "input": texts})
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float64), body["usage"]["prompt_tokens"]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def triton_metric(server, name: str, **labels) -> float:
    """The sum of a Triton metric's series whose labels include ``labels`` (tests/metrics_text.py)."""
    return metric_sum(scrape(server.metrics_url), name, **labels)


def cache_counts(server) -> tuple[float, float]:
    """(texts the cache's model computed, cache hits in L1 or L2) of text_embedding_cached."""
    computed = triton_metric(server, "embedding_cache_model_texts_total", model=CACHED)
    hits = triton_metric(server, "embedding_cache_lookups_total", model=CACHED, result="hit")
    return computed, hits


def fresh(text: str) -> str:
    """A text no other test (or earlier run on the same Redis) sent."""
    return f"{text} ({uuid.uuid4().hex[:8]})"


# --- quality ---------------------------------------------------------------------------------


def test_the_hand_made_relevance_set_ranks_its_relevant_documents_first(gateway):
    cases = json.loads(RELEVANCE.read_text(encoding="utf-8"))["queries"]
    assert len(cases) >= 12
    reciprocal = []
    for case in cases:
        body = rerank(gateway, case["query"], case["documents"])
        order = [r["index"] for r in body["results"]]
        assert sorted(order) == list(range(len(case["documents"]))), body
        scores = [r["relevance_score"] for r in body["results"]]
        assert scores == sorted(scores, reverse=True), scores
        assert all(-1.0 - 1e-6 <= s <= 1.0 + 1e-6 for s in scores), scores
        assert [r["document"]["text"] for r in body["results"]] == [case["documents"][i] for i in order]
        reciprocal.append(1.0 / (order.index(case["relevant"]) + 1))
    mrr = float(np.mean(reciprocal))
    top1 = sum(r == 1.0 for r in reciprocal)
    print(f"rerank MRR over {len(cases)} queries: {mrr:.4f} (relevant document first for {top1} of {len(cases)})")
    assert mrr >= MRR_MIN, (mrr, reciprocal)


# --- the result cache ------------------------------------------------------------------------


def test_a_repeated_rerank_is_answered_from_the_cache(stack):
    server, gw = stack
    query = fresh("Which metal is liquid at room temperature?")
    docs = [
        fresh("Mercury is a metal that is liquid at room temperature."),
        fresh("Iron rusts in damp air."),
        fresh("Gold is soft."),
    ]
    docs.append(docs[0])  # a repeated document is embedded once
    computed0, hits0 = cache_counts(server)
    first = rerank(gw, query, docs)
    computed1, hits1 = cache_counts(server)
    assert computed1 - computed0 == 4, "the query and three distinct documents are new: computed once each"
    second = rerank(gw, query, docs)
    computed2, hits2 = cache_counts(server)
    assert computed2 == computed1, "a repeated rerank made the model compute texts"
    assert hits2 - hits1 == 4, (hits1, hits2)
    assert second["results"] == first["results"]
    assert [r["index"] for r in first["results"]][:2] in ([0, 3], [3, 0])
    assert first["results"][0]["relevance_score"] == first["results"][1]["relevance_score"]
    assert first["results"][0]["index"] < first["results"][1]["index"], "a tie is ordered by index"


# --- agreement -------------------------------------------------------------------------------


def test_score_equals_rerank_and_the_cosine_of_the_embeddings_vectors(gateway):
    query = "How far is the Moon from the Earth?"
    docs = [
        "The Moon is about 384,000 kilometres from the Earth.",
        "The Sun is a star.",
        "Tides are caused by the Moon's gravity.",
    ]
    ranked = rerank(gateway, query, docs)
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    scored = post(gateway, "/score", {"model": EMB, "text_1": query, "text_2": docs})
    assert scored["object"] == "list" and scored["model"] == EMB and scored["id"].startswith("score-")
    assert isinstance(scored["created"], int)
    assert [d["index"] for d in scored["data"]] == [0, 1, 2] and {d["object"] for d in scored["data"]} == {"score"}
    vectors, tokens = embeddings(gateway, [query, *docs])
    for i in range(3):
        expected = cosine(vectors[0], vectors[i + 1])
        assert abs(scored["data"][i]["score"] - expected) <= TOLERANCE, (i, scored["data"][i], expected)
        assert abs(by_index[i] - expected) <= TOLERANCE, (i, by_index[i], expected)
    # Usage: the model's token counts of the texts sent, as /v1/embeddings reports them.
    assert ranked["usage"] == {"total_tokens": tokens}
    assert scored["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    # N:N pairs text_1[i] with text_2[i]; the alias and /v1/score answer the same.
    pairs = post(gateway, "/v1/score", {"model": ALIAS, "text_1": [docs[0], docs[1]], "text_2": [docs[2], query]})
    assert abs(pairs["data"][0]["score"] - cosine(vectors[1], vectors[3])) <= TOLERANCE
    assert abs(pairs["data"][1]["score"] - cosine(vectors[2], vectors[0])) <= TOLERANCE
    assert pairs["model"] == EMB


def test_top_n_return_documents_objects_and_the_other_paths(gateway):
    query = "a programming language for data science"
    docs = ["Python is popular for data analysis and machine learning.", "Cats sleep a lot.", "R is used by statisticians."]
    full = rerank(gateway, query, docs)
    assert full["id"].startswith("rerank-") and full["model"] == EMB
    assert set(full) == {"id", "model", "usage", "results"}
    top = rerank(gateway, query, docs, top_n=2)
    assert top["results"] == full["results"][:2]
    assert rerank(gateway, query, docs, top_n=50)["results"] == full["results"]
    bare = rerank(gateway, query, docs, return_documents=False)
    assert [set(r) for r in bare["results"]] == [{"index", "relevance_score"}] * 3
    assert [(r["index"], r["relevance_score"]) for r in bare["results"]] == [
        (r["index"], r["relevance_score"]) for r in full["results"]
    ]
    objects = rerank(gateway, query, [{"text": d, "id": f"doc-{i}"} for i, d in enumerate(docs)])
    assert objects["results"] == full["results"]
    assert rerank(gateway, query, docs, path="/rerank")["results"] == full["results"]
    # Cohere v2: its meta, no documents unless asked.
    v2 = rerank(gateway, query, docs, path="/v2/rerank")
    assert v2["results"] == bare["results"] and v2["meta"]["api_version"] == {"version": "2"}
    assert rerank(gateway, query, docs, path="/v2/rerank", return_documents=True)["results"] == full["results"]


def test_teis_body_gets_teis_list_and_scores_can_be_normalised(gateway):
    """TEI's rerank body (texts, raw_scores, return_text, no model): its answer is TEI's list,
    sorted, normalised by default; raw_scores true gives the cosines, as /v1/rerank."""
    query = "a programming language for data science"
    docs = ["Python is popular for data analysis and machine learning.", "Cats sleep a lot.", "R is used by statisticians."]
    raw = {r["index"]: r["relevance_score"] for r in rerank(gateway, query, docs)["results"]}
    tei = post(gateway, "/rerank", {"query": query, "texts": docs, "return_text": True})
    assert [set(r) for r in tei] == [{"index", "score", "text"}] * 3
    assert [r["score"] for r in tei] == sorted((r["score"] for r in tei), reverse=True)
    for r in tei:
        assert abs(r["score"] - (1 + raw[r["index"]]) / 2) <= 1e-6 and r["text"] == docs[r["index"]]
    plain = post(gateway, "/rerank", {"query": query, "texts": docs, "raw_scores": True})
    assert all(abs(r["score"] - raw[r["index"]]) <= 1e-6 and "text" not in r for r in plain)
    normalised = rerank(gateway, query, docs, raw_scores=False)["results"]
    assert all(abs(r["relevance_score"] - (1 + raw[r["index"]]) / 2) <= 1e-6 for r in normalised)


# --- bad input -------------------------------------------------------------------------------

GOOD = {"model": EMB, "query": "q", "documents": ["a", "b"]}
BAD_RERANK = [
    ({**GOOD, "query": ""}, 400, "query"),
    ({**GOOD, "query": "   "}, 400, "query"),
    ({**GOOD, "query": 5}, 422, "query"),
    ({**GOOD, "query": None}, 422, "query"),
    ({k: v for k, v in GOOD.items() if k != "query"}, 422, "query"),
    ({**GOOD, "documents": []}, 400, "documents"),
    ({**GOOD, "documents": "a"}, 422, "documents"),
    ({**GOOD, "documents": [1, 2]}, 422, "documents"),
    ({**GOOD, "documents": [{"title": "no text"}]}, 422, "documents"),
    ({**GOOD, "documents": ["a", ""]}, 400, "documents[1]"),
    ({**GOOD, "documents": ["x"] * (MAX_INPUTS + 1)}, 413, "documents"),
    ({**GOOD, "documents": ["a", "x" * 20000]}, 413, "documents[1]"),
    ({**GOOD, "documents": ["a", "\ud800"]}, 400, "documents[1]"),
    ({**GOOD, "top_n": 0}, 400, "top_n"),
    ({**GOOD, "top_n": -3}, 400, "top_n"),
    ({**GOOD, "top_n": "2"}, 422, "top_n"),
    ({**GOOD, "top_n": 1.5}, 422, "top_n"),
    ({**GOOD, "return_documents": "yes"}, 422, "return_documents"),
    ({**GOOD, "model": "no-such-model"}, 404, "model"),
    ({**GOOD, "model": "text_generation"}, 404, "model"),
    ({**GOOD, "model": "text_reranker"}, 404, "model"),  # in the repository, not loaded in Triton: unknown
    ({**GOOD, "model": 5}, 422, "model"),
    ({**GOOD, "texts": ["a"]}, 400, "documents"),  # documents or texts, not both
    ({"model": EMB, "query": "q"}, 400, "documents"),
    ({"model": EMB, "query": "q", "texts": []}, 400, "texts"),
    ({"model": EMB, "query": "q", "texts": ["a", ""]}, 400, "texts[1]"),
    ({**GOOD, "raw_scores": "no"}, 422, "raw_scores"),
    ({**GOOD, "max_tokens_per_doc": 64}, 400, "max_tokens_per_doc"),
]
BAD_SCORE = [
    ({"model": EMB, "text_1": ["a", "b"], "text_2": ["c"]}, 400, "text_2"),
    ({"model": EMB, "text_1": [], "text_2": ["c"]}, 400, "text_1"),
    ({"model": EMB, "text_1": "a", "text_2": []}, 400, "text_2"),
    ({"model": EMB, "text_1": "a", "text_2": ["c", " "]}, 400, "text_2[1]"),
    ({"model": EMB, "text_1": "", "text_2": "c"}, 400, "text_1"),
    ({"model": EMB, "text_1": 5, "text_2": "c"}, 422, "text_1"),
    ({"model": EMB, "text_1": "a", "text_2": [None]}, 422, "text_2"),
    ({"model": EMB, "text_1": "a", "text_2": ["x"] * (MAX_INPUTS + 1)}, 413, "text_2"),
    ({"model": "nope", "text_1": "a", "text_2": "b"}, 404, "model"),
    ({"model": "text_reranker", "text_1": "a", "text_2": "b"}, 404, "model"),
]


@pytest.mark.parametrize(
    "path,body,status,param",
    [("/v1/rerank", *c) for c in BAD_RERANK] + [("/score", *c) for c in BAD_SCORE],
    ids=[f"rerank-{c[2]}-{i}" for i, c in enumerate(BAD_RERANK)] + [f"score-{c[2]}-{i}" for i, c in enumerate(BAD_SCORE)],
)
def test_bad_input_is_a_4xx_naming_the_field(gateway, path, body, status, param):
    r = requests.post(gateway.url + path, data=json.dumps(body), headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] in ("invalid_request_error", "not_found_error"), err
    assert err["param"] is not None and err["param"].split(".")[0] == param, err
    assert err["message"], err


def test_a_document_over_the_context_length_is_400_naming_it(gateway):
    long_doc = " ".join(["word"] * 400)
    body = post(gateway, "/v1/rerank", {**GOOD, "documents": ["short", long_doc]}, expect=400)
    assert body["error"]["param"] == "documents[1]" and body["error"]["code"] == "context_length_exceeded", body
    assert "256" in body["error"]["message"] and body["error"]["message"].startswith("documents[1] "), body


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank", "/score", "/v1/score"])
def test_every_path_needs_the_key(gateway, path):
    r = requests.post(gateway.url + path, json=GOOD, timeout=30)
    assert r.status_code == 401, (path, r.status_code, r.text)
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_both_routes_are_in_the_openapi_schema(gateway):
    paths = requests.get(gateway.url + "/openapi.json", timeout=30).json()["paths"]
    assert {"/v1/rerank", "/score"} <= set(paths), sorted(paths)
    assert "post" in paths["/v1/rerank"] and "post" in paths["/score"]


@pytest.mark.parametrize("direction", ["right", "left"])
def test_truncate_passes_through_as_v1_embeddings_takes_it(gateway, direction):
    """A document over 256 tokens is scored on its first (right) or last (left) tokens, as
    /v1/embeddings embeds it with the same choice; its whole count is in the usage."""
    query = "What do cats like to eat?"
    long_doc = "Cats like to eat fish. " + " ".join(["filler"] * 300) + " Dogs like to chew bones."
    choice = {"truncate": True, "truncation_direction": direction}
    body = post(gateway, "/v1/embeddings", {"model": EMB, "input": [query, long_doc], **choice})
    vectors = np.array([d["embedding"] for d in body["data"]], dtype=np.float64)
    assert body["usage"]["prompt_tokens"] > 256 + 8
    ranked = rerank(gateway, query, [long_doc], **choice)
    assert abs(ranked["results"][0]["relevance_score"] - cosine(vectors[0], vectors[1])) <= TOLERANCE
    assert ranked["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]
    scored = post(gateway, "/score", {"model": EMB, "text_1": query, "text_2": long_doc, **choice})
    assert abs(scored["data"][0]["score"] - cosine(vectors[0], vectors[1])) <= TOLERANCE


@pytest.mark.parametrize("path", ["/v1/rerank", "/score"])
def test_a_bad_truncation_direction_is_400_naming_it(gateway, path):
    body = {**GOOD, "text_1": "a", "text_2": "b", "truncate": True, "truncation_direction": "middle"}
    err = post(gateway, path, body, expect=400)["error"]
    assert err["param"] == "truncation_direction", err


def test_a_reranker_triton_does_not_serve_is_not_listed(gateway):
    """text_reranker's configs are in the repository, but this server never loaded it."""
    listed = requests.get(gateway.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert EMB in [m["id"] for m in listed] and "text_reranker" not in [m["id"] for m in listed], listed
    assert requests.get(gateway.url + "/v1/models/text_reranker", headers=AUTH, timeout=30).status_code == 404
