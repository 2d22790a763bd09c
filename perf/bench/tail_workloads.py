"""perf.bench.tail's workloads: the request each sends (KServe v2 bodies from perf.lib.workload,
the gateway's embeddings body) and the wrk script that sends the same (perf.lib.wrk)."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    raise RuntimeError("a streaming workload is measured by stream_window, not by a request body")


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

    def unique_text(_: int) -> tuple[bytes, dict[str, str]]:
        n = next(counter)
        return text_request(f"{sentences[n % len(sentences)]} ({nonce}-{n})")

    hits = [text_request(s) for s in sentences]
    gw_hits = [gateway_request(s, api_key) for s in sentences]

    def _next_text() -> str:
        n = next(counter)
        return f"{sentences[n % len(sentences)]} ({nonce}-{n})"

    def image(_: int) -> tuple[bytes, dict[str, str]]:
        n = next(counter)  # a new image per request: image_preprocess's response cache never answers
        return image_request(png(hash((nonce, n)) & 0xFFFFFFFF))

    return {
        "text_tokenizer": Workload("text_tokenizer", "text_tokenizer", "unique_text", unique_text),
        "text_encoder": Workload("text_encoder", "text_encoder", "tokens", lambda _: token_request(rng)),
        "text_encoder_router": Workload("text_encoder_router", "text_encoder_router", "tokens", lambda _: token_request(rng)),
        "text_embedding": Workload("text_embedding", "text_embedding", "unique_text", unique_text),
        "text_embedding_cached_unique": Workload(
            "text_embedding_cached_unique", "text_embedding_cached", "unique_text", unique_text
        ),
        "text_embedding_cached_hits": Workload(
            "text_embedding_cached_hits", "text_embedding_cached", "hits", lambda n: hits[n % len(hits)], warm=hits
        ),
        "image_classification": Workload("image_classification", "image_classification", "image", image),
        "gateway_embeddings_unique": Workload(
            "gateway_embeddings_unique",
            "text_embedding",
            "gw_unique_text",
            lambda _: gateway_request(_next_text(), api_key),
            path="/v1/embeddings",
            via_gateway=True,
        ),
        "gateway_embeddings_hits": Workload(
            "gateway_embeddings_hits",
            "text_embedding",
            "gw_hits",
            lambda n: gw_hits[n % len(gw_hits)],
            warm=gw_hits,
            path="/v1/embeddings",
            via_gateway=True,
        ),
        # Streams: measured by their own asyncio clients (stream_window), never by wrk.
        "gateway_chat_stream": Workload(
            "gateway_chat_stream", "text_generation", "chat", _no_body, path="/v1/chat/completions", via_gateway=True
        ),
        "text_generation_stream": Workload("text_generation_stream", "text_generation", "generation", _no_body),
    }


def wrk_script(w: Workload, sentences: Sequence[str], nonce: str) -> str:
    """A wrk Lua script sending ``w``'s requests: unique texts carry the nonce, the wrk thread
    and a counter; ``done`` prints the window's figures as one JSON line."""
    tail = '"]}],"parameters":{"binary_data_output":true}}'
    hits = "request = function()\n  n = n + 1\n  return wrk.format('POST', path, headers, bodies[(n % #bodies) + 1])\nend\n"
    if w.kind == "gw_unique_text":
        make = (
            wrk.lua_list("texts", [json.dumps(s)[1:-1] for s in sentences]) + "request = function()\n  n = n + 1\n"
            '  local body = \'{"model":"text_embedding","encoding_format":"float","input":"\' .. '
            f"texts[(n % #texts) + 1] .. ' ({nonce}-' .. tid .. '-' .. n .. ')\"}}'\n"
            "  return wrk.format('POST', path, headers, body)\nend\n"
        )
    elif w.kind in ("gw_hits", "hits"):
        make = wrk.lua_list("bodies", [body.decode() for body, _ in w.warm]) + hits
    elif w.kind == "unique_text":
        make = (
            wrk.lua_list("texts", [json.dumps(s)[1:-1] for s in sentences]) + "request = function()\n  n = n + 1\n"
            '  local body = \'{"inputs":[{"name":"TEXT","shape":[1,1],"datatype":"BYTES","data":["\' .. '
            f"texts[(n % #texts) + 1] .. ' ({nonce}-' .. tid .. '-' .. n .. ')' .. {wrk.lua_string(tail)}\n"
            "  return wrk.format('POST', path, headers, body)\nend\n"
        )
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
    headers = {"Content-Type": "application/json"}
    if w.warm:
        headers.update(w.warm[0][1])
    elif w.via_gateway:
        headers.update(w.make(0)[1])
    headers["Content-Type"] = "application/json"
    return wrk.script(w.endpoint, headers, make)
