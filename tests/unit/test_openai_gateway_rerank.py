"""The cross-encoder side of ``/v1/rerank`` and ``/score`` (openai_gateway/rerank.py), no server:
pairs grouped into calls of one query and at most max_documents documents, the scores put back
in pair order, and a refusal's error data (as the pair tokenizer writes it, through the gateway's
``triton_error``) naming the request's own field. The served path is
tests/integration/test_openai_gateway_cross_encoder.py."""

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from contract.errors import TOO_LARGE, InputError, format_error
from openai_gateway import rerank
from openai_gateway.catalog import Catalog, RerankerModel
from openai_gateway.errors import APIError
from openai_gateway.settings import GatewaySettings
from openai_gateway.triton import triton_error

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
SETTINGS = GatewaySettings()


@pytest.fixture(scope="module")
def model() -> RerankerModel:
    m = Catalog.from_repository(REPOSITORY).models["text_reranker"]
    assert isinstance(m, RerankerModel)
    return dataclasses.replace(m, max_documents=3)  # small calls, so a few pairs need several


def test_group_pairs_one_query_per_call_in_first_appearance_order_at_most_limit():
    assert rerank.group_pairs([0, 0, 0, 0, 0], 2) == [(0, [0, 1]), (0, [2, 3]), (0, [4])]
    assert rerank.group_pairs([3, 1, 3, 1, 2], 64) == [(3, [0, 2]), (1, [1, 3]), (2, [4])]
    assert rerank.group_pairs([0], 1) == [(0, [0])]


def _score(model, body) -> rerank.ScoreJob:
    return rerank.check_score(rerank.ScoreRequest(model=model.id, **body), model, SETTINGS)


def _fake_logit(query: bytes, document: bytes) -> float:
    return len(query) * 100.0 + len(document)  # tells every pair apart


def test_scores_come_back_in_pair_order_from_grouped_calls(model):
    text_1 = ["qq", "q", "qq", "q", "qq", "qq", "qq"]
    text_2 = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "a"]
    job = _score(model, {"text_1": text_1, "text_2": text_2})
    calls = []

    async def infer(query, documents, k):
        calls.append((query, len(documents), k))
        return np.array([_fake_logit(query, d) for d in documents], np.float32), np.full(len(documents), 5, np.int32)

    scored = asyncio.run(rerank.cross_encoder_scores(job, infer))
    assert scored.scores.tolist() == [_fake_logit(a.encode(), b.encode()) for a, b in zip(text_1, text_2)]
    assert scored.total_tokens == 5 * len(text_2)  # each pair counted, the repeated one too
    # "qq" has 5 pairs: calls of 3 and 2; "q" one call of 2.
    assert calls == [(b"qq", 3, 0), (b"qq", 2, 1), (b"q", 2, 2)]


def _refusal(field: str, **values) -> APIError:
    """What the gateway makes of the pair tokenizer's refusal (its message with the data)."""
    text = format_error(InputError(field, "query and document together are too long", code=TOO_LARGE, values=values))
    return triton_error(RuntimeError(text), "text_reranker", {})


@pytest.mark.parametrize(
    "body, failing_call, field, param",
    [
        ({"text_1": "q", "text_2": ["a", "b", "c", "d", "e"]}, 1, "DOCUMENTS[1]", "text_2[4]"),
        ({"text_1": ["x", "y", "x"], "text_2": ["a", "b", "c"]}, 1, "DOCUMENTS[0]", "text_2[1]"),
        ({"text_1": ["x", "y"], "text_2": ["a", "b"]}, 1, "QUERY", "text_1[1]"),
    ],
)
def test_a_too_long_pair_is_context_length_exceeded_naming_the_requests_field(model, body, failing_call, field, param):
    job = _score(model, body)

    async def infer(query, documents, k):
        await asyncio.sleep(0.01 * (3 - k))  # answered out of order: the error is still the request's first
        if k == failing_call:
            raise _refusal(field, tokens=600, limit=512)
        return np.zeros(len(documents), np.float32), np.ones(len(documents), np.int32)

    with pytest.raises(APIError) as info:
        asyncio.run(rerank.cross_encoder_scores(job, infer))
    err = info.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", param)
    assert err.message.startswith(param) and "600" in err.message and "512" in err.message


def test_another_refusal_keeps_its_status_and_names_the_field(model):
    job = _score(model, {"text_1": "q", "text_2": ["a", "b"]})

    async def infer(query, documents, k):
        raise triton_error(RuntimeError(format_error(InputError("DOCUMENTS[1]", "not valid UTF-8"))), "text_reranker", {})

    with pytest.raises(APIError) as info:
        asyncio.run(rerank.cross_encoder_scores(job, infer))
    assert (info.value.status, info.value.param) == (400, "text_2[1]")


def test_truncate_is_refused_unless_the_pair_tokenizer_cuts_documents(model):
    with pytest.raises(APIError) as info:
        _score(model, {"text_1": "q", "text_2": "a", "truncate": True})
    assert (info.value.status, info.value.param) == (400, "truncate")
    cutting = dataclasses.replace(model, truncation="document")
    assert _score(cutting, {"text_1": "q", "text_2": "a", "truncate": True}).truncate
    with pytest.raises(APIError) as info:
        _score(cutting, {"text_1": "q", "text_2": "a", "truncate": True, "truncation_direction": "left"})
    assert info.value.param == "truncation_direction"
