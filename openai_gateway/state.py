"""What one gateway holds for its lifetime: settings, keys, catalog, limiter, metrics, the
Triton backend and the token counters; routes reach it as ``request.app.state.gateway``."""

from __future__ import annotations

import logging
from typing import Any, Literal, overload

from fastapi import Request

from openai_gateway import embeddings
from openai_gateway.auth import ApiKeys
from openai_gateway.catalog import Catalog, EmbeddingModel, GenerationModel, Model, RerankerModel
from openai_gateway.errors import model_not_found
from openai_gateway.metrics import GatewayMetrics
from openai_gateway.ratelimit import RateLimiter, SharedRateLimiter
from openai_gateway.response_store import ResponseStore, open_store
from openai_gateway.settings import GatewaySettings
from openai_gateway.tokenize import ModelTokenizer
from openai_gateway.triton import TritonBackend

log = logging.getLogger("openai_gateway")


class GatewayState:
    """The gateway's parts, built once per app from its settings, and the model lookups the
    routes share."""

    def __init__(self, settings: GatewaySettings, keys: ApiKeys, catalog: Catalog | None = None):
        self.settings = settings
        self.keys = keys
        self.catalog = catalog or Catalog.from_repository(settings.model_repository, settings.embedding_entry)
        self.metrics = GatewayMetrics()
        self.limiter: RateLimiter | SharedRateLimiter
        if settings.rate_limit_redis_url and settings.rate_limit_rps > 0:
            # One bucket per key for every gateway behind the front door (serve-cluster's Redis).
            self.limiter = SharedRateLimiter(
                settings.rate_limit_redis_url, settings.rate_limit_rps, settings.rate_limit_burst, fail=settings.rate_limit_fail
            )
        else:
            self.limiter = RateLimiter(settings.rate_limit_rps, settings.rate_limit_burst)
        self.redis_errors_seen = 0
        self.backend = TritonBackend(
            settings.triton_url,
            self.catalog,
            settings.triton_timeout_s,
            settings.generation_timeout_s,
            settings.ready_poll_s,
            coalesce=settings.coalesce_embeddings,
            coalesce_max_rows=settings.coalesce_max_rows,
            health_dir=settings.triton_health_dir,
        )
        self.backend.on_batch = self.metrics.coalesced.observe
        self.responses: ResponseStore = open_store(
            settings.responses_redis_url, settings.responses_store_dir, settings.responses_ttl_s, settings.responses_max_entries
        )
        self.vocabularies: dict[str, embeddings.Vocabulary] = {}
        self.tokenizers: dict[str, ModelTokenizer] = {}  # /tokenize, /detokenize
        for g in self.catalog.of_kind("generation"):
            if g.version_dir is not None and (g.version_dir / "tokenizer.json").is_file():
                self.tokenizers[g.id] = ModelTokenizer.load(
                    g.version_dir / "tokenizer.json", g.max_model_len, g.version_dir / "chat_template.jinja"
                )
        for m in self.catalog.of_kind("embedding"):
            try:
                self.vocabularies[m.id] = embeddings.Vocabulary(m.tokenizer_file)
                self.tokenizers[m.id] = ModelTokenizer.load(m.tokenizer_file, m.max_tokens)
            except FileNotFoundError as exc:
                log.warning("%s is not served by the gateway: %s", m.id, exc)

    async def start(self) -> None:
        """Connect to Triton and start polling its readiness (the app's startup)."""
        await self.backend.start()

    async def close(self) -> None:
        """Close the Triton channel, the shared limiter's Redis connection and the response store (the app's shutdown)."""
        await self.backend.close()
        if isinstance(self.limiter, SharedRateLimiter):
            await self.limiter.close()
        await self.responses.close()

    @overload
    def find(self, name: str, kind: Literal["embedding"]) -> EmbeddingModel: ...

    @overload
    def find(self, name: str, kind: Literal["generation"]) -> GenerationModel: ...

    def find(self, name: str, kind: str) -> Model:
        """The served model ``name`` (an id or alias) of ``kind``; 404 in OpenAI's shape otherwise.
        An embedding model also needs its tokenizer file (the vocabulary token arrays are checked against)."""
        model = self.catalog.find(name, kind)
        if model is None or (kind == "embedding" and model.id not in self.vocabularies):
            served = [m.id for m in self.catalog.of_kind(kind)]
            raise model_not_found(name, kind, served)
        return model

    def find_scorer(self, name: str) -> EmbeddingModel | RerankerModel:
        """The model that scores ``/v1/rerank`` and ``/score`` requests to ``name``: an embedding
        model (the cosine of its vectors), or a cross-encoder reranker while Triton serves it. A
        reranker is exported and loaded on request only, so one that Triton does not have ready is
        unknown (404), as in /v1/models; while Triton itself is down the route answers 503."""
        reranker = self.catalog.find(name, "reranker")
        if reranker is not None and (self.backend.is_ready(reranker) or not self.backend.server_ready):
            return reranker
        embedding = self.catalog.find(name, "embedding")
        if embedding is not None and embedding.id in self.vocabularies:
            return embedding
        served = [m.id for m in self.catalog.of_kind("embedding") if m.id in self.vocabularies]
        served += [m.id for m in self.backend.served("reranker")]
        raise model_not_found(name, "embedding or reranker", served)

    def default_scorer(self) -> str:
        """The model a rerank request without one (TEI's) goes to: the served cross-encoder
        reranker, else the first embedding model; 404 when neither is served."""
        served = self.backend.served("reranker") if self.backend.server_ready else []
        if served:
            return served[0].id
        embeddings = [m.id for m in self.catalog.of_kind("embedding") if m.id in self.vocabularies]
        if not embeddings:
            raise model_not_found("(none given)", "embedding or reranker", [])
        return embeddings[0]

    def servable(self) -> list[Model]:
        """Ready in Triton, and (embeddings) with the tokenizer file the gateway checks token arrays against."""
        return [m for m in self.backend.served() if not isinstance(m, EmbeddingModel) or m.id in self.vocabularies]


def gateway_state(request: Request) -> GatewayState:
    """The state of the app serving ``request``."""
    return request.app.state.gateway


def request_info(request: Request) -> dict[str, Any]:
    """The request's log and metrics record (request id, key id, model, tokens, error), set by
    the gate before any route runs."""
    return request.scope["state"]["gateway"]
