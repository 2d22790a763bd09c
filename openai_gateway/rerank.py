"""``/v1/rerank`` (Cohere's and Jina's shape, as vLLM serves it) and ``/score`` (vLLM's), scored
by one of two scorers, chosen by the kind of the model the request names:

- an **embedding model** (a bi-encoder): relevance is the cosine of the two texts' vectors
  (``bi_encoder_scores``). The distinct texts are embedded through the gateway's own embeddings
  path (``TritonBackend.embed``: the text entry, the result cache by default, coalescing and
  batching included), so a document seen before is a cache hit and costs no model work.
- a **cross-encoder reranker** (``text_reranker``, served once exported): the model reads each
  (query, document) pair together and its raw logit is the score (``cross_encoder_scores``):
  one Triton call per query and at most ``max_documents`` of its documents.

A request becomes a ``ScoreJob``: its distinct texts (each checked as ``/v1/embeddings`` checks
a text, under its own field name) and the pairs to score as indices into them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from contract.errors import InputError
from contract.truncation import RIGHT, parse_direction
from openai_gateway.catalog import EmbeddingModel, RerankerModel
from openai_gateway.embeddings import EmbeddingJob, utf8
from openai_gateway.errors import APIError, bad_request, too_large
from openai_gateway.settings import GatewaySettings

# --- request bodies (published in /openapi.json) --------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as schemas.py: unknown fields ignored, types strict


class RerankDocument(_Body):
    """A document as an object (Cohere v1, Jina): only ``text`` is read."""

    text: StrictStr


class RerankRequest(_Body):
    """The body of `POST /v1/rerank` (also `/rerank`, `/v2/rerank`): Cohere's and Jina's fields,
    or TEI's (`texts`, `raw_scores`, `return_text`; its answer is TEI's list)."""

    model: StrictStr | None = Field(
        None,
        description="An embedding model (cosine of its vectors) or a served cross-encoder reranker; "
        "absent (as TEI's clients send it): the served reranker, else the embedding model",
    )
    query: StrictStr
    documents: list[StrictStr | RerankDocument] | None = Field(None, description="Texts, or objects with a `text` field")
    texts: list[StrictStr] | None = Field(None, description="TEI's name for documents; the answer is then TEI's list")
    top_n: StrictInt | None = Field(None, description="Return the best top_n (>= 1); default: all")
    return_documents: StrictBool | None = Field(
        None, description="Echo each result's document text (default true; false on /v2/rerank, as Cohere v2)"
    )
    return_text: StrictBool = Field(False, description="TEI's: echo each result's text")
    raw_scores: StrictBool | None = Field(
        None,
        description="false: scores normalised to [0, 1] (a cross-encoder's logit through a sigmoid, a cosine as "
        "(1 + cos) / 2); default true, except with TEI's texts (false, as TEI)",
    )
    max_tokens_per_doc: StrictInt | None = Field(
        None, description="Cohere v2's: at least the model's own limit (a smaller one is refused: no per-request cut)"
    )
    # As /v1/embeddings takes them (TEI's names; docs/embeddings.md#truncation).
    truncate: StrictBool = Field(
        False, description="false (default): a text over the model's context length is refused (400 context_length_exceeded)"
    )
    truncation_direction: StrictStr = Field(
        "right", description="with truncate: right (default) keeps a text's first tokens, left its last ones"
    )
    user: StrictStr | None = None


class ScoreRequest(_Body):
    """The body of `POST /score` (also `/v1/score`), vLLM's: pairs 1:1, 1:N or N:N."""

    model: StrictStr = Field(description="An embedding model (cosine of its vectors) or a served cross-encoder reranker")
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    # As /v1/embeddings takes them (TEI's names; docs/embeddings.md#truncation).
    truncate: StrictBool = Field(
        False, description="false (default): a text over the model's context length is refused (400 context_length_exceeded)"
    )
    truncation_direction: StrictStr = Field(
        "right", description="with truncate: right (default) keeps a text's first tokens, left its last ones"
    )
    user: StrictStr | None = None


# --- the checked request --------------------------------------------------------------------


@dataclass
class ScoreJob:
    """Distinct texts to embed, and the pairs to score as (left, right) indices into them."""

    model: EmbeddingModel | RerankerModel
    truncate: bool = False  # False: a text over the context length is refused
    truncation_direction: str = RIGHT
    texts: list[str] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)  # the texts as UTF-8
    params: list[str] = field(default_factory=list)  # the field each distinct text first came from
    left: list[int] = field(default_factory=list)
    right: list[int] = field(default_factory=list)
    right_params: list[str] = field(default_factory=list)  # per pair: the field its right text came from
    uses: list[int] = field(default_factory=list)  # per distinct text: how often the request sent it
    _seen: dict[str, int] = field(default_factory=dict, repr=False)

    def add(self, text: str, param: str, settings: GatewaySettings) -> int:
        """The index of ``text`` among the distinct texts, checked as /v1/embeddings checks a text."""
        found = self._seen.get(text)
        if found is not None:
            self.uses[found] += 1
            return found
        limit = settings.max_input_chars
        if len(text) > limit:
            raise too_large(f"{param} has {len(text)} characters; the limit is {limit} (--max-input-chars)", param=param)
        if not text.strip():
            raise bad_request(f"{param} is empty or only whitespace", param=param)
        self.blobs.append(utf8(text, param))
        self.texts.append(text)
        self.params.append(param)
        self.uses.append(1)
        self._seen[text] = len(self.texts) - 1
        return len(self.texts) - 1

    def named(self, exc: APIError) -> APIError:
        """``exc`` with the request's own field for the text a model refused: the embeddings path
        names it ``input[k]``, k its index among the distinct texts."""
        old = exc.param or ""
        base, _, rest = old.partition("[")
        if base == "input" and rest.endswith("]") and rest[:-1].isdigit() and int(rest[:-1]) < len(self.params):
            exc.param = self.params[int(rest[:-1])]
            # The gateway's own messages start with the param they name ("input[2] has 402 tokens").
            head = f"{old} "
            exc.message = exc.param + exc.message[len(old) :] if exc.message.startswith(head) else f"{exc.param}: {exc.message}"
            exc.args = (exc.message,)
        return exc

    def pair(self, left: int, text: str, param: str, settings: GatewaySettings) -> None:
        """Pair the distinct text ``left`` with ``text`` (checked; its field ``param``)."""
        self.left.append(left)
        self.right.append(self.add(text, param, settings))
        self.right_params.append(param)

    def embedding_job(self, priority_class: str | None) -> EmbeddingJob:
        """The distinct texts as the embeddings path's job (same entry, cache and batching)."""
        assert isinstance(self.model, EmbeddingModel), "a bi-encoder's job"
        return EmbeddingJob(
            self.model,
            self.texts,
            None,
            "float",
            self.blobs,
            priority_class,
            truncate=self.truncate,
            truncation_direction=self.truncation_direction,
        )


def _job(req: RerankRequest | ScoreRequest, model: EmbeddingModel | RerankerModel) -> ScoreJob:
    """An empty job with the request's truncation choice, checked."""
    try:
        direction = parse_direction(req.truncation_direction, "truncation_direction")
    except InputError as exc:
        raise bad_request(f"truncation_direction {exc.message}", param="truncation_direction") from None
    if isinstance(model, RerankerModel) and req.truncate:
        # The pair tokenizer cuts or refuses by its config (truncation), not per request: truncate
        # is honoured only where that config already cuts the document's end (= direction right).
        if model.truncation != "document":
            raise bad_request(
                f"{model.id} takes no truncate: a pair over {model.max_tokens} tokens is refused (its pair "
                'tokenizer\'s truncation is "refuse" in config.pbtxt); shorten the document',
                param="truncate",
            )
        if direction != RIGHT:
            raise bad_request(
                f"{model.id} cuts a long document's end only: truncation_direction must be right", param="truncation_direction"
            )
    return ScoreJob(model, req.truncate, direction)


def _count(items: list, param: str, settings: GatewaySettings) -> None:
    if not items:
        raise bad_request(f"{param} must not be empty", param=param)
    if len(items) > settings.max_inputs:
        raise too_large(
            f"{param} has {len(items)} items; the limit is {settings.max_inputs} per request (--max-inputs)", param=param
        )


def check_rerank(
    req: RerankRequest, model: EmbeddingModel | RerankerModel, settings: GatewaySettings
) -> tuple[ScoreJob, list[str]]:
    """The rerank request as a job (the query is text 0, pairs query x each document) and the
    documents' texts; APIError naming the field and the limit it broke."""
    if req.top_n is not None and req.top_n < 1:
        raise bad_request(f"top_n must be at least 1 (omit it for all documents), got {req.top_n}", param="top_n")
    if (req.documents is None) == (req.texts is None):
        raise bad_request("send documents (Cohere, Jina, vLLM) or texts (TEI), one of them", param="documents")
    if req.max_tokens_per_doc is not None and req.max_tokens_per_doc < model.max_tokens:
        raise bad_request(
            f"max_tokens_per_doc must be at least {model.max_tokens} ({model.id}'s limit): documents are not cut "
            f"per request (send truncate: true to cut them at the model's limit), got {req.max_tokens_per_doc}",
            param="max_tokens_per_doc",
        )
    job = _job(req, model)
    field = "documents" if req.documents is not None else "texts"
    items = req.documents if req.documents is not None else req.texts or []
    _count(items, field, settings)
    query = job.add(req.query, "query", settings)
    docs = [d if isinstance(d, str) else d.text for d in items]
    for i, text in enumerate(docs):
        job.pair(query, text, f"{field}[{i}]", settings)
    return job, docs


def normalised(scores: np.ndarray, model: EmbeddingModel | RerankerModel) -> np.ndarray:
    """Scores in [0, 1]: a cross-encoder's logits through a sigmoid (TEI's raw_scores false), a
    bi-encoder's cosines as (1 + cos) / 2."""
    if isinstance(model, RerankerModel):
        return 1.0 / (1.0 + np.exp(-scores))
    return (1.0 + scores) / 2.0


def check_score(req: ScoreRequest, model: EmbeddingModel | RerankerModel, settings: GatewaySettings) -> ScoreJob:
    """The score request as a job, pairs as vLLM makes them: one text_1 against each text_2
    (1:N), or text_1[i] against text_2[i] (N:N)."""
    job = _job(req, model)
    one = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    two = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    _count(one, "text_1", settings)
    _count(two, "text_2", settings)
    if len(one) > 1 and len(one) != len(two):
        raise bad_request(
            f"text_1 has {len(one)} items and text_2 {len(two)}: pairs are 1:1, 1:N or N:N (equal lengths)", param="text_2"
        )
    name_1 = "text_1" if isinstance(req.text_1, str) else "text_1[{}]"
    name_2 = "text_2" if isinstance(req.text_2, str) else "text_2[{}]"
    firsts = [job.add(t, name_1.format(i), settings) for i, t in enumerate(one)]
    for i, text in enumerate(two):
        job.pair(firsts[i if len(firsts) > 1 else 0], text, name_2.format(i), settings)
    return job


# --- scoring --------------------------------------------------------------------------------

# What embeds a job's texts: the embeddings path (TritonBackend.embed with its request id and
# padding id bound), answering the vectors in order and each text's token count.
Embed = Callable[[EmbeddingJob], Awaitable[tuple[np.ndarray, np.ndarray]]]


@dataclass
class Scored:
    """A job's scores, one per pair, and the tokens of the texts the request sent."""

    scores: np.ndarray  # float64 [pairs]
    total_tokens: int


def check_lengths(job: ScoreJob, counts: np.ndarray) -> None:
    """400 context_length_exceeded for the first text with more tokens than the model takes."""
    assert isinstance(job.model, EmbeddingModel), "a bi-encoder's texts"
    limit = job.model.max_tokens
    for i, n in enumerate(counts):
        if n > limit:
            raise APIError(
                400,
                f"{job.params[i]} has {int(n)} tokens; {job.model.id}'s maximum context length is {limit} "
                "tokens (max_sequence_length in its config.pbtxt). Shorten or split it.",
                param=job.params[i],
                code="context_length_exceeded",
            )


def cosine(vectors: np.ndarray, left: list[int], right: list[int]) -> np.ndarray:
    """The cosine of each (left, right) pair of rows, in float64. The model's vectors are
    L2-normalised already, so this is their dot product up to float32 rounding."""
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=1)
    norms[norms == 0] = 1.0  # a zero vector scores 0 against everything, not NaN
    unit = v / norms[:, None]
    return np.einsum("ij,ij->i", unit[left], unit[right])


async def bi_encoder_scores(job: ScoreJob, embed: Embed, priority_class: str | None) -> Scored:
    """The scorer of a bi-encoder: each distinct text embedded once (through the result cache),
    each pair scored as the cosine of its two vectors. Tokens are counted per text sent (a
    repeated text counts each time, as it would in /v1/embeddings)."""
    try:
        vectors, counts = await embed(job.embedding_job(priority_class))
    except APIError as exc:
        raise job.named(exc) from None
    if not job.truncate:  # the model refuses such a text itself; this guards a model that did not
        check_lengths(job, counts)
    total = int(np.dot(np.asarray(counts, dtype=np.int64), np.asarray(job.uses, dtype=np.int64)))
    return Scored(cosine(vectors, job.left, job.right), total)


# What scores one query against some of its documents: the cross-encoder's Triton call
# (TritonBackend.rerank_pairs with the model and request id bound), given the query, the documents
# (UTF-8) and the call's number in the request; it answers each pair's raw logit and token count.
Infer = Callable[[bytes, list[bytes], int], Awaitable[tuple[np.ndarray, np.ndarray]]]


def group_pairs(left: list[int], limit: int) -> list[tuple[int, list[int]]]:
    """The pairs as cross-encoder calls: (left text, pair indices) with one left text each (the
    query), in order of first appearance, each of at most ``limit`` pairs (the model's
    max_documents). /v1/rerank is one group; /score N:N groups the pairs by their text_1."""
    groups: dict[int, list[int]] = {}
    for p, q in enumerate(left):
        groups.setdefault(q, []).append(p)
    return [(q, pairs[i : i + limit]) for q, pairs in groups.items() for i in range(0, len(pairs), limit)]


def _pair_error(job: ScoreJob, exc: APIError, left: int, pairs: list[int]) -> APIError:
    """``exc`` (the reranker refused a call) naming the request's own field, read from its data:
    ``DOCUMENTS[j]`` is the call's j-th pair, ``QUERY`` its left text. A pair over the model's token
    limit becomes 400 context_length_exceeded."""
    assert isinstance(job.model, RerankerModel)
    data = exc.data
    if data is None or not data.field:
        return exc
    base, _, rest = data.field.partition("[")
    if base == "DOCUMENTS" and rest[:-1].isdigit() and int(rest[:-1]) < len(pairs):
        param = job.right_params[pairs[int(rest[:-1])]]
    elif base == "QUERY":
        param = job.params[left]
    else:
        return exc
    tokens, limit = data.values.get("tokens"), data.values.get("limit")
    if isinstance(tokens, int) and isinstance(limit, int):
        what = "the query" if base == "QUERY" else f"{param} with its query"
        return APIError(
            400,
            f"{param}: {what} is {tokens} tokens; {job.model.id}'s maximum context length is {limit} tokens per "
            "pair (max_sequence_length of its pair tokenizer). Shorten it.",
            param=param,
            code="context_length_exceeded",
            data=data,
        )
    return APIError(exc.status, f"{param}: {exc.message}", param=param, code=exc.code, data=data)


async def cross_encoder_scores(job: ScoreJob, infer: Infer) -> Scored:
    """The scorer of a cross-encoder: each (query, document) pair read by the model together, its
    raw logit the score (no sigmoid: the order is the same, and it is what Triton answers). One
    call per query and at most ``max_documents`` of its documents, sent together; the tokens are
    the model's count of each pair sent (a repeated document counts each time)."""
    assert isinstance(job.model, RerankerModel)
    calls = group_pairs(job.left, job.model.max_documents)
    answers = await asyncio.gather(
        *(infer(job.blobs[q], [job.blobs[job.right[p]] for p in pairs], k) for k, (q, pairs) in enumerate(calls)),
        return_exceptions=True,
    )
    scores = np.zeros(len(job.left), dtype=np.float64)
    total = 0
    for (q, pairs), answer in zip(calls, answers):
        if isinstance(answer, APIError):  # the first refused call in request order is the request's error
            raise _pair_error(job, answer, q, pairs) from None
        if isinstance(answer, BaseException):
            raise answer
        logits, counts = answer
        scores[pairs] = logits
        total += int(np.asarray(counts, dtype=np.int64).sum())
    return Scored(scores, total)


# --- answers --------------------------------------------------------------------------------


def ranked(scores: np.ndarray, top_n: int | None) -> list[int]:
    """Indices by score, highest first, ties by index; the first ``top_n`` (all when None)."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return order if top_n is None else order[:top_n]


def rerank_body(
    request_id: str,
    model: EmbeddingModel | RerankerModel,
    req: RerankRequest,
    docs: list[str],
    scored: Scored,
    cohere_v2: bool = False,
) -> bytes:
    """The rerank answer, results sorted by relevance: TEI's list (``index``, ``score``, ``text``
    with return_text) for a request that sent ``texts``; else vLLM's and Jina's object (``id``,
    ``model``, ``usage``, ``results`` of ``index``, ``relevance_score``, ``document``), with Cohere
    v2's ``meta`` on /v2/rerank."""
    tei = req.texts is not None
    raw = req.raw_scores if req.raw_scores is not None else not tei
    scores = scored.scores if raw else normalised(scored.scores, model)
    order = ranked(scores, req.top_n)
    if tei:
        return orjson.dumps(
            [{"index": i, "score": float(scores[i]), **({"text": docs[i]} if req.return_text else {})} for i in order]
        )
    echo = req.return_documents if req.return_documents is not None else not cohere_v2
    results = []
    for i in order:
        item: dict = {"index": i, "relevance_score": float(scores[i])}
        if echo:
            item["document"] = {"text": docs[i]}
        results.append(item)
    body: dict = {
        "id": f"rerank-{request_id}",
        "model": model.id,
        "usage": {"total_tokens": scored.total_tokens},
        "results": results,
    }
    if cohere_v2:
        body["meta"] = {
            "api_version": {"version": "2"},
            "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": scored.total_tokens},
        }
    return orjson.dumps(body)


def score_body(request_id: str, model: EmbeddingModel | RerankerModel, scored: Scored) -> bytes:
    """vLLM's score answer: one score per pair, in pair order."""
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scored.scores)]
    usage = {"prompt_tokens": scored.total_tokens, "total_tokens": scored.total_tokens, "completion_tokens": 0}
    return orjson.dumps(
        {
            "id": f"score-{request_id}",
            "object": "list",
            "created": int(time.time()),
            "model": model.id,
            "data": data,
            "usage": usage,
        }
    )
