"""``/v1/rerank`` and ``/score``: relevance of texts to a query (or of text pairs), scored by the
named model's kind (``openai_gateway/rerank.py``): an embedding model's cosine of its vectors
(through the embeddings path), or a served cross-encoder reranker's raw logit of each pair.

``/rerank`` answers as ``/v1/rerank`` (TEI's list when the body is TEI's), ``/v2/rerank`` adds
Cohere v2's ``meta`` and leaves documents out unless asked, and ``/v1/score`` answers as ``/score``
(vLLM serves all four); only ``/v1/rerank`` and ``/score`` are published in /openapi.json.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Security

from openai_gateway import rerank
from openai_gateway.catalog import EmbeddingModel, RerankerModel
from openai_gateway.embeddings import EmbeddingJob
from openai_gateway.errors import APIError
from openai_gateway.responses import json_response
from openai_gateway.routes import bearer
from openai_gateway.routes.embeddings import PRIORITY_HEADER, priority_class_of
from openai_gateway.state import gateway_state, request_info
from openai_gateway.streaming import until_done_or_gone

router = APIRouter()


async def _score(request: Request, job: rerank.ScoreJob, model: EmbeddingModel | RerankerModel) -> rerank.Scored:
    """The job scored by the model's scorer; the tokens counted in the log line and the per-key
    metrics."""
    st = gateway_state(request)
    info = request_info(request)
    info["texts"] = len(job.texts)
    scored = await (_cross_encoder(request, job, model) if isinstance(model, RerankerModel) else _bi_encoder(request, job, model))
    info["prompt_tokens"] = scored.total_tokens
    st.metrics.count_tokens(info["key_id"], model.id, scored.total_tokens)
    return scored


async def _cross_encoder(request: Request, job: rerank.ScoreJob, model: RerankerModel) -> rerank.Scored:
    """A cross-encoder's scores: one Triton call per query and at most max_documents documents."""
    st = gateway_state(request)
    request_id = request_info(request)["request_id"]
    value = request.headers.get(PRIORITY_HEADER)
    if value is not None and value.strip().lower() != "default":  # as priority_class_of for a model without lanes
        raise APIError(
            400,
            f"{PRIORITY_HEADER} must be default for {model.id} (it has no priority classes), got {value[:40]!r}",
            param=PRIORITY_HEADER,
            code="invalid_priority_class",
        )
    st.backend.require_ready(model)
    calls = len(rerank.group_pairs(job.left, model.max_documents))

    async def infer(query: bytes, documents: list[bytes], k: int):
        return await st.backend.rerank_pairs(model, query, documents, request_id if calls == 1 else f"{request_id}.{k}")

    work = rerank.cross_encoder_scores(job, infer)
    # As the embeddings path: one call is over quickly; several are watched for a disconnect.
    return await (work if calls == 1 else until_done_or_gone(request, work, st.metrics, request.url.path))


async def _bi_encoder(request: Request, job: rerank.ScoreJob, model: EmbeddingModel) -> rerank.Scored:
    """An embedding model's scores, its texts through the embeddings path."""
    st = gateway_state(request)
    info = request_info(request)
    priority_class = priority_class_of(request, model)
    st.backend.require_ready(model)
    if priority_class is not None:
        st.backend.require_entry_ready(model, priority_class)
    pad_id = st.vocabularies[model.id].pad_id

    async def embed(ejob: EmbeddingJob):
        work = st.backend.embed(ejob, info["request_id"], pad_id)
        # As /v1/embeddings: one batch is over in milliseconds; several are watched for a disconnect.
        return await (work if len(ejob.chunks()) == 1 else until_done_or_gone(request, work, st.metrics, request.url.path))

    return await rerank.bi_encoder_scores(job, embed, priority_class)


@router.post("/v1/rerank", dependencies=[Security(bearer)])
async def create_rerank(body: rerank.RerankRequest, request: Request):
    """Rank `documents` by relevance to `query`: the cosine of an embedding model's vectors
    (documents go through the result cache), or a served cross-encoder reranker's raw logit."""
    st = gateway_state(request)
    model = st.find_scorer(body.model if body.model is not None else st.default_scorer())
    request_info(request)["model"] = model.id
    job, docs = rerank.check_rerank(body, model, st.settings)
    scored = await _score(request, job, model)
    cohere_v2 = request.url.path == "/v2/rerank"
    return json_response(200, rerank.rerank_body(request_info(request)["request_id"], model, body, docs, scored, cohere_v2))


@router.post("/score", dependencies=[Security(bearer)])
async def create_score(body: rerank.ScoreRequest, request: Request):
    """Score text pairs (vLLM's 1:1, 1:N, N:N): the cosine of an embedding model's vectors, or a
    served cross-encoder reranker's raw logit."""
    st = gateway_state(request)
    model = st.find_scorer(body.model)
    request_info(request)["model"] = model.id
    job = rerank.check_score(body, model, st.settings)
    scored = await _score(request, job, model)
    return json_response(200, rerank.score_body(request_info(request)["request_id"], model, scored))


# vLLM's other paths for the same two handlers, kept out of the schema (one published path each).
router.add_api_route("/rerank", create_rerank, methods=["POST"], dependencies=[Security(bearer)], include_in_schema=False)
router.add_api_route("/v2/rerank", create_rerank, methods=["POST"], dependencies=[Security(bearer)], include_in_schema=False)
router.add_api_route("/v1/score", create_score, methods=["POST"], dependencies=[Security(bearer)], include_in_schema=False)
