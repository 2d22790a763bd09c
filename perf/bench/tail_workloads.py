"""perf.bench.tail's workloads: the request each sends (KServe v2 bodies from perf.lib.workload,
the gateway's embeddings body) and the wrk script that sends the same (perf.lib.wrk)."""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from perf.lib import wrk
from perf.lib.workload import VOCAB, gateway_request, image_request, text_request, token_request

TEXT_WORKLOADS = (
    "text_tokenizer",
    "text_encoder",
    "text_encoder_router",
    "text_embedding",
    "text_embedding_cached_unique",
    "text_embedding_cached_hits",
)
# The OpenAI gateway in front of each phase's server: embeddings through wrk, chat streams.
GATEWAY_WORKLOADS = ("gateway_embeddings_unique", "gateway_embeddings_hits", "gateway_chat_stream")
# Streaming workloads: latency is the whole answer, TTFT recorded beside it.
STREAM_WORKLOADS = ("gateway_chat_stream", "text_generation_stream")
WORKLOADS = TEXT_WORKLOADS + ("image_classification", "text_generation_stream") + GATEWAY_WORKLOADS
HIT_WORKLOADS = ("text_embedding_cached_hits", "gateway_embeddings_hits")
# Models whose /v2/models/stats are recorded per window (the ensembles' steps and BLS targets).
STATS_MODELS = (
    "text_tokenizer",
    "text_encoder_router",
    "text_encoder",
    "text_embedding",
    "text_embedding_cached",
    "image_preprocess",
    "image_classifier",
    "image_postprocess",
)


# --------------------------------------------------------------------------- requests


def png(seed: int, size: int = 64) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    image = Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _no_body(_: int) -> tuple[bytes, dict[str, str]]:
    raise RuntimeError("a streaming workload is measured by measure_stream, not by a request body")


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    kind: str  # unique_text, tokens, hits, image: what the wrk script has to generate
    make: Callable[[int], tuple[bytes, dict[str, str]]]  # request number -> (body, headers)
    warm: Sequence[tuple[bytes, dict[str, str]]] = ()  # sent once, unmeasured, before a measurement
    path: str = ""  # HTTP path; default /v2/models/<model>/infer
    via_gateway: bool = False  # sent to the phase's OpenAI gateway, not to tritonserver

    @property
    def endpoint(self) -> str:
        return self.path or f"/v2/models/{self.model}/infer"


def workloads(nonce: str, sentences: Sequence[str], api_key: str = "") -> dict[str, Workload]:
    """Every workload; ``nonce`` makes the unique texts unique across runs and phases too."""
    rng = random.Random(nonce)
    counter = iter(range(10**12))

    def unique(_: int) -> str:
        n = next(counter)
        return f"{sentences[n % len(sentences)]} ({nonce}-{n})"

    def image(_: int) -> tuple[bytes, dict[str, str]]:
        n = next(counter)  # a new image per request: image_preprocess's response cache never answers
        return image_request(png(hash((nonce, n)) & 0xFFFFFFFF))

    hits = [text_request(s) for s in sentences]
    gw_hits = [gateway_request(s, api_key) for s in sentences]
    gw: dict[str, Any] = {"path": "/v1/embeddings", "via_gateway": True}
    tokens = lambda _: token_request(rng)  # noqa: E731
    return {
        w.name: w
        for w in (
            Workload("text_tokenizer", "text_tokenizer", "unique_text", lambda n: text_request(unique(n))),
            Workload("text_encoder", "text_encoder", "tokens", tokens),
            Workload("text_encoder_router", "text_encoder_router", "tokens", tokens),
            Workload("text_embedding", "text_embedding", "unique_text", lambda n: text_request(unique(n))),
            Workload("text_embedding_cached_unique", "text_embedding_cached", "unique_text", lambda n: text_request(unique(n))),
            Workload("text_embedding_cached_hits", "text_embedding_cached", "hits", lambda n: hits[n % len(hits)], hits),
            Workload("image_classification", "image_classification", "image", image),
            Workload(
                "gateway_embeddings_unique",
                "text_embedding",
                "gw_unique_text",
                lambda n: gateway_request(unique(n), api_key),
                **gw,
            ),
            Workload("gateway_embeddings_hits", "text_embedding", "gw_hits", lambda n: gw_hits[n % len(gw_hits)], gw_hits, **gw),
            # Streams: measured by their own asyncio clients (measure_stream), never by wrk.
            Workload("gateway_chat_stream", "text_generation", "chat", _no_body, path="/v1/chat/completions", via_gateway=True),
            Workload("text_generation_stream", "text_generation", "generation", _no_body),
        )
    }


def wrk_script(w: Workload, sentences: Sequence[str], nonce: str) -> str:
    """A wrk Lua script sending ``w``'s requests: unique texts carry the nonce, the wrk thread
    and a counter; ``done`` prints the window's figures as one JSON line."""
    if w.kind in ("gw_hits", "hits"):
        make = wrk.cycle([body for body, _ in w.warm])
    elif w.kind in ("unique_text", "gw_unique_text"):
        template = gateway_request("\0", "")[0] if w.via_gateway else text_request("\0")[0]
        make = wrk.unique_texts(sentences, template, nonce)
    elif w.kind == "tokens":
        make = (
            "request = function()\n  local ids = {101}\n"
            f"  for i = 2, 15 do ids[i] = math.random({VOCAB[0]}, {VOCAB[1] - 1}) end\n  ids[16] = 102\n"
            '  local body = \'{"inputs":[{"name":"input_ids","shape":[1,16],"datatype":"INT64","data":[\''
            ' .. table.concat(ids, \',\') .. \']},{"name":"attention_mask","shape":[1,16],"datatype":"INT64",'
            '"data":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]}],"parameters":{"binary_data_output":true}}\'\n'
            "  return wrk.format('POST', path, headers, body)\nend\n"
        )
    else:
        raise ValueError(f"{w.name}: no wrk script for {w.kind} requests")
    headers = dict(w.warm[0][1] if w.warm else w.make(0)[1] if w.via_gateway else {})
    headers["Content-Type"] = "application/json"
    return wrk.script(w.endpoint, headers, make)
