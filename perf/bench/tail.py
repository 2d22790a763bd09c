"""`python -m perf.bench.tail`: the latency tail of every served model and ensemble, side by side.

Two tritonservers run at once (the models `make serve` loads, the CPU variants, Triton's
response cache on, no front door: the batcher is what is measured), on the same machine:

  after   the configs as shipped (model_repository/*/config.pbtxt);
  before  a copy of the repository (model files linked, not copied) whose batching configs add
          what they had until the fix: ``priority_levels: 2``, ``default_priority_level: 2``
          and ``default_queue_policy { timeout_action: REJECT allow_timeout_override: true }``.
          On tritonserver 2.51 those make the dynamic batcher miss wake-ups and wait out its
          500 ms default wait (docs/performance.md). With ``--alt-configs DIR`` the second
          server serves DIR's ``<model>/config.pbtxt`` (and ``<model>/configs/*.pbtxt``) instead,
          phase "alt": any config change measured side by side against the shipped one.

Each workload runs at each ``--concurrency`` in ``--rounds`` rounds of ``--duration`` seconds,
the phases interleaved A B, B A, A B ... so both see the same machine; a point's figures are
the median over its rounds (max: the largest). The load generator is ``wrk`` (C, one thread,
a Lua script makes every text unique) when it is installed, else an asyncio client;
``--client`` chooses. Each window also records the CPU (in cores) used by the client, by the
server's process tree and by the whole machine, and, from /v2/models/stats, each model's
mean batch size and queue and compute time per request: where the time goes.

Workloads: text_tokenizer, text_encoder (direct, token ids), text_encoder_router (token ids),
text_embedding, text_embedding_cached with unique texts (all misses) and with 60 texts sent
once beforehand (all hits), image_classification (unique 64 x 64 PNGs, asyncio client only),
text_generation_stream (text_generation over a gRPC stream, ``--max-tokens`` new tokens:
latency of the whole answer and TTFT), and through an OpenAI gateway started in front of each
phase's server (``python -m openai_gateway``, rate limit and request log off):
gateway_embeddings_unique / gateway_embeddings_hits (POST /v1/embeddings, wrk) and
gateway_chat_stream (POST /v1/chat/completions, stream, asyncio SSE client). The before phase
also serves text_generation without its admission window (``admission_window_ms`` 0).
Texts and images are unique per request across the whole run, so neither Triton's response
cache nor the embedding cache answers them.

``--long 60``: one 60 s window per workload and phase at concurrency 32. The targets, checked
at the highest concurrency and printed as a table at the end (also targets.md / targets.csv):
all-hit P99 <= 50 ms, every other workload P99 <= 3 x P50 (streams: the answer and TTFT), and
in long mode max <= 5 x P50; each with the CPU figures of its window, so a target missed
because the cores were busy shows it. Writes tail.csv (every window), summary.md and the
server and gateway logs under perf/results/tail-<UTC time>/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import io
import json
import math
import os
import random
import re
import resource
import secrets
import shutil
import struct
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from perf.lib import wrk
from perf.lib.harness import write_csv
from perf.lib.paths import GENERATION_PROMPTS, ROOT
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.paths import SENTENCES_16TOK as SENTENCES
from perf.lib.stats import median, percentile
from server.process import DEFAULT_CACHE_SIZE_MB

BATCHING_MODELS = (
    "text_encoder",
    "text_tokenizer",
    "text_encoder_router",
    "text_embedding_cached",
    "image_preprocess",
    "image_classifier",
    "image_postprocess",
)
SERVED_MODELS = ("text_embedding", "text_embedding_cached", "image_classification")
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
COLD_PASS_LIMIT_S = 120.0  # the longest a stream window waits for every prompt's first answer
STREAM_WORKLOADS = ("gateway_chat_stream", "text_generation_stream")
WORKLOADS = TEXT_WORKLOADS + ("image_classification", "text_generation_stream") + GATEWAY_WORKLOADS
HIT_WORKLOADS = ("text_embedding_cached_hits", "gateway_embeddings_hits")
TARGET_MAX_OVER_P50 = 5.0
# The generation engine before its admission window (docs/generation-internals.md#the-engine): the before phase
# serves text_generation with these parameters.
BEFORE_PARAMETERS = {"text_generation": {"admission_window_ms": "0"}}
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
TARGET_HITS_P99_MS = 50.0
TARGET_P99_OVER_P50 = 3.0
VOCAB = (1000, 30000)  # token ids drawn for the encoder's direct inputs (all-MiniLM-L6-v2: 30,522)


# --------------------------------------------------------------------------- requests


def infer_body(inputs: list[dict], binary: bytes = b"") -> tuple[bytes, dict[str, str]]:
    """A KServe v2 HTTP request; outputs come back in Triton's binary extension (cheap to skip)."""
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    headers = {"Content-Type": "application/octet-stream"}
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(header))
    return header + binary, headers


def text_request(text: str) -> tuple[bytes, dict[str, str]]:
    return infer_body([{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}])


def token_request(rng: random.Random, length: int = 16) -> tuple[bytes, dict[str, str]]:
    ids = [101] + [rng.randrange(*VOCAB) for _ in range(length - 2)] + [102]
    return infer_body(
        [
            {"name": "input_ids", "shape": [1, length], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, length], "datatype": "INT64", "data": [1] * length},
        ]
    )


def png(seed: int, size: int = 64) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    image = Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image_request(blob: bytes) -> tuple[bytes, dict[str, str]]:
    raw = struct.pack("<I", len(blob)) + blob
    return infer_body(
        [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}}], raw
    )


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


def gateway_request(text: str, api_key: str) -> tuple[bytes, dict[str, str]]:
    """POST /v1/embeddings for one text, float vectors."""
    body = json.dumps({"model": "text_embedding", "input": text, "encoding_format": "float"}).encode()
    return body, {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}


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


# --------------------------------------------------------------------------- measurement


@dataclass
class Window:
    """One measured window: one phase, one workload, one concurrency, one round."""

    phase: str
    workload: str
    concurrency: int
    round: int
    client: str
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    ttft_p50_ms: float | None = None  # streams: time to the first piece of text
    ttft_p99_ms: float | None = None
    ttft_max_ms: float | None = None
    client_cores: float | None = None  # CPU seconds of the load generator per wall second
    gateway_cores: float | None = None  # the OpenAI gateway's process (gateway workloads)
    server_cores: float | None = None  # the same for tritonserver and its backend stubs
    server_wait_cores: float | None = None  # seconds its threads sat runnable, waiting for a CPU, per second
    machine_cores: float | None = None  # every process of the machine (neighbours included)
    first_error: str = ""
    stats: dict = field(default_factory=dict)  # model -> mean batch, queue and compute ms per request

    @property
    def p99_over_p50(self) -> float | None:
        return self.p99_ms / self.p50_ms if self.p99_ms and self.p50_ms else None

    @property
    def max_over_p50(self) -> float | None:
        return self.max_ms / self.p50_ms if self.max_ms and self.p50_ms else None

    def record(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "stats"}
        out["p99_over_p50"] = self.p99_over_p50
        out["max_over_p50"] = self.max_over_p50
        out["stats"] = json.dumps(self.stats, sort_keys=True)
        return out


async def _closed_loop(
    url: str, w: Workload, concurrency: int, duration: float, warmup: float
) -> tuple[list[float], int, str, float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    latencies: list[float] = []
    errors = 0
    first_error = ""
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        endpoint = f"http://{url}{w.endpoint}"
        for body, headers in w.warm:
            async with session.post(endpoint, data=body, headers=headers) as r:
                await r.read()
        started = time.monotonic()
        measure_from, stop_at = started + warmup, started + warmup + duration
        n = iter(range(10**12))

        async def client() -> None:
            nonlocal errors, first_error
            while True:
                now = time.monotonic()
                if now >= stop_at:
                    return
                body, headers = w.make(next(n))
                t0 = time.perf_counter()
                try:
                    async with session.post(endpoint, data=body, headers=headers) as r:
                        payload = await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    ok, payload = False, repr(exc).encode()
                elapsed = time.perf_counter() - t0
                if now < measure_from:
                    continue
                if ok:
                    latencies.append(elapsed)
                else:
                    errors += 1
                    first_error = first_error or payload[:200].decode(errors="replace")

        await asyncio.gather(*(client() for _ in range(concurrency)))
        measured = time.monotonic() - measure_from
    return latencies, errors, first_error, measured


def measure_python(url: str, w: Workload, window: Window, duration: float) -> None:
    """The asyncio client in this process (its CPU: this process's over the window)."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    latencies, errors, first_error, seconds = asyncio.run(
        _closed_loop(url, replace(w, warm=()), window.concurrency, duration, 0.0)
    )
    window.client_cores = (time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9)
    window.requests, window.errors, window.first_error, window.seconds = len(latencies), errors, first_error, seconds
    if latencies:
        ms = sorted(x * 1000.0 for x in latencies)
        window.rps = len(ms) / seconds if seconds > 0 else None
        window.p50_ms, window.p99_ms, window.max_ms = percentile(ms, 50), percentile(ms, 99), ms[-1]


async def _stream_loop(
    w: Workload,
    target: str,
    api_key: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrency: int,
    duration: float,
    warmup: float,
) -> tuple[list[tuple[float, float]], int, str, float]:
    """``concurrency`` closed-loop streams: ``(TTFT, total)`` seconds of each request started inside
    the measured part (waited for to their end), errors, first error, the measured seconds. The
    measured part starts once every client has had one answer, every prompt has been answered
    once, and ``warmup`` s have passed, and lasts ``duration`` s. The prompts come back in turn,
    so inside the window their prefixes are in the engine's prefix cache; a prompt's first pass
    is a cold prefill of its whole length, and left inside the window those passes came as a
    backlog at its start (32 clients cover 32 of the prompts before the first condition holds). ``target``: the gateway's base URL, or tritonserver's gRPC host:port."""
    import aiohttp

    from clients.generation import AsyncGenerationClient
    from perf.lib.chat_streams import ChatSystem, DirectChat, GatewayChat

    session = None
    direct = None
    system: ChatSystem
    if w.via_gateway:
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=300), connector=aiohttp.TCPConnector(limit=0)
        )
        system = GatewayChat(session, target, api_key)
    else:
        direct = AsyncGenerationClient(target, protocol="grpc", timeout_s=300)
        system = DirectChat(direct)
    samples: list[tuple[float, float]] = []
    errors = 0
    first_error = ""
    try:
        await system.stream(prompts[0], 2)  # the connection opened, outside the window
        started = time.monotonic()
        measure_from: float | None = None
        answered = 0
        turn = iter(range(10**12))
        cold = set(range(len(prompts)))  # prompts not yet answered once

        async def client(k: int) -> None:
            nonlocal errors, first_error, measure_from, answered
            first = True
            while measure_from is None or time.monotonic() < measure_from + duration:
                now = time.monotonic()
                counted = measure_from is not None and now >= measure_from
                index = next(turn) % len(prompts)
                t0 = time.perf_counter()
                try:
                    ttft, _ = await system.stream(prompts[index], max_tokens)
                    if counted:
                        samples.append((ttft if ttft is not None else float("nan"), time.perf_counter() - t0))
                    cold.discard(index)
                except Exception as exc:  # noqa: BLE001 - counted, the window goes on
                    if counted:
                        errors += 1
                        first_error = first_error or f"{type(exc).__name__}: {exc}"[:200]
                    await asyncio.sleep(0.05)
                if first:
                    first, answered = False, answered + 1
                # (A prompt that keeps failing must not hold the window off for ever: its errors count.)
                if (
                    measure_from is None
                    and answered == concurrency
                    and (not cold or time.monotonic() > started + warmup + COLD_PASS_LIMIT_S)
                ):
                    measure_from = max(time.monotonic(), started + warmup)

        await asyncio.gather(*(client(k) for k in range(concurrency)))
        measured = time.monotonic() - (measure_from or started)
    finally:
        if session is not None:
            await session.close()
        if direct is not None:
            await direct.close()
    return samples, errors, first_error, measured


def measure_stream(
    w: Workload,
    target: str,
    api_key: str,
    prompts: Sequence[str],
    max_tokens: int,
    window: Window,
    duration: float,
    warmup: float,
) -> None:
    """The asyncio streaming client in this process: latency = the whole answer, TTFT beside it."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    samples, errors, first_error, seconds = asyncio.run(
        _stream_loop(w, target, api_key, prompts, max_tokens, window.concurrency, duration, warmup)
    )
    window.client_cores = (time.process_time() - cpu0) / max(time.monotonic() - wall0, 1e-9)
    window.requests, window.errors, window.first_error, window.seconds = len(samples), errors, first_error, seconds
    if samples:
        total = sorted(1000.0 * t for _, t in samples)
        ttft = sorted(1000.0 * f for f, _ in samples if not math.isnan(f))
        window.rps = len(total) / seconds if seconds > 0 else None
        window.p50_ms, window.p99_ms, window.max_ms = percentile(total, 50), percentile(total, 99), total[-1]
        if ttft:
            window.ttft_p50_ms, window.ttft_p99_ms, window.ttft_max_ms = (percentile(ttft, 50), percentile(ttft, 99), ttft[-1])


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


def measure_wrk(url: str, w: Workload, window: Window, script: Path, duration: float) -> None:
    """wrk, one thread, in a child process (its CPU: the children's rusage over the window)."""
    before, wall0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    result = wrk.run(url, script, window.concurrency, duration)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - wall0
    window.client_cores = ((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)) / max(wall, 1e-9)
    window.seconds = result["duration_us"] / 1e6
    window.requests, window.errors = result["requests"] - result["errors"], result["errors"]
    if window.errors:
        window.first_error = "wrk counted non-2xx responses or socket errors"
    if result["requests"]:
        window.rps = result["requests"] / window.seconds
        window.p50_ms, window.p99_ms, window.max_ms = (result[k] / 1000.0 for k in ("p50_us", "p99_us", "max_us"))


def warm_up(url: str, w: Workload, concurrency: int, seconds: float, script: Path | None) -> None:
    """Unmeasured: ``w.warm`` once (the hits' texts), then ``seconds`` of the same load."""
    if w.warm:
        asyncio.run(_closed_loop(url, w, 1, 0.0, 0.0))
    if seconds > 0:
        if script is not None:
            wrk.run(url, script, concurrency, seconds)
        else:
            asyncio.run(_closed_loop(url, replace(w, warm=()), concurrency, seconds, 0.0))


class CpuMeter:
    """CPU seconds of a process tree and of the whole machine, between start() and stop()."""

    def __init__(self, pid: int | None):
        self.pid = pid

    def _tree(self) -> tuple[float, float]:
        """(CPU seconds, run-queue wait seconds) of the tree's threads (/proc/<pid>/task/*/schedstat)."""
        import psutil

        if self.pid is None:
            return 0.0, 0.0
        cpu = wait = 0.0
        try:
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    for task in Path(f"/proc/{p.pid}/task").iterdir():
                        fields = (task / "schedstat").read_text().split()
                        cpu += int(fields[0]) / 1e9
                        wait += int(fields[1]) / 1e9
                except (OSError, psutil.Error, ValueError, IndexError):
                    pass
        except psutil.Error:
            pass
        return cpu, wait

    @staticmethod
    def _machine() -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def start(self) -> None:
        self.t0, self.tree0, self.machine0 = time.monotonic(), self._tree(), self._machine()

    def stop(self, window: Window) -> None:
        wall = max(time.monotonic() - self.t0, 1e-9)
        cpu, wait = self._tree()
        window.server_cores = (cpu - self.tree0[0]) / wall
        window.server_wait_cores = (wait - self.tree0[1]) / wall
        window.machine_cores = (self._machine() - self.machine0) / wall


def model_stats(url: str) -> dict[str, dict[str, float]]:
    """Counters of /v2/models/stats summed over versions: requests, executions, batched
    inferences and the nanoseconds of queue and compute (input + infer + output)."""
    with urllib.request.urlopen(f"http://{url}/v2/models/stats", timeout=10) as r:
        payload = json.loads(r.read())
    out: dict[str, dict[str, float]] = {}
    for m in payload.get("model_stats", []):
        if m["name"] not in STATS_MODELS:
            continue
        s = m.get("inference_stats", {})
        agg = out.setdefault(m["name"], {"requests": 0, "executions": 0, "inferences": 0, "queue_ns": 0, "compute_ns": 0})
        agg["requests"] += int(s.get("success", {}).get("count", 0))
        agg["executions"] += int(m.get("execution_count", 0))
        agg["inferences"] += int(m.get("inference_count", 0))
        agg["queue_ns"] += int(s.get("queue", {}).get("ns", 0))
        agg["compute_ns"] += sum(int(s.get(k, {}).get("ns", 0)) for k in ("compute_input", "compute_infer", "compute_output"))
    return out


def stats_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per model over a window: mean batch, queue ms and compute ms per request."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        d = {k: a[k] - b.get(k, 0) for k in a}
        if d["requests"] <= 0:
            continue
        out[name] = {
            "requests": d["requests"],
            "batch": round(d["inferences"] / d["executions"], 2) if d["executions"] else None,
            "queue_ms": round(d["queue_ns"] / d["requests"] / 1e6, 3),
            "compute_ms": round(d["compute_ns"] / d["requests"] / 1e6, 3),
        }
    return out


# --------------------------------------------------------------------------- phases


STALL_PBTXT = (
    "priority_levels: 2\n  default_priority_level: 2\n"
    "  default_queue_policy { timeout_action: REJECT allow_timeout_override: true }\n"
)


def stall_config_text(text: str, model: str = "", variant: bool = False) -> str:
    """A config.pbtxt text with the stall settings added to its dynamic_batching block (if any),
    and ``model``'s BEFORE_PARAMETERS values in place of its shipped ones (a generated variant in
    configs/ may predate a parameter: left as it is)."""
    text = text.replace("dynamic_batching {", "dynamic_batching {\n  " + STALL_PBTXT, 1)
    for key, value in BEFORE_PARAMETERS.get(model, {}).items():

        def with_value(m: re.Match[str], v: str = value) -> str:
            return m.group(1) + v + m.group(2)

        text, n = re.subn(
            r'(parameters \{ key: "' + re.escape(key) + r'" value: \{ string_value: ")[^"]*(")',
            with_value,
            text,
        )
        if n != 1 and not variant:
            raise ValueError(f"{model}/config.pbtxt: no parameter {key} to set for the before phase")
    return text


def before_repository(source: Path, target: Path, alt_configs: Path | None = None) -> Path:
    """A repository at ``target`` serving ``source``'s models: version folders and other files
    are symlinks; config.pbtxt and configs/*.pbtxt are copies with the stall settings added, or,
    with ``alt_configs``, taken from ``alt_configs/<model>/`` where it has them (else unchanged)."""
    for model_dir in sorted(p for p in source.iterdir() if (p / "config.pbtxt").is_file()):
        out = target / model_dir.name
        out.mkdir(parents=True)

        def config(path: Path, relative: str) -> str:
            if alt_configs is None:
                return stall_config_text(path.read_text(), model_dir.name, variant=relative != "config.pbtxt")  # noqa: B023
            replacement = alt_configs / model_dir.name / relative  # noqa: B023 (called within this iteration)
            return replacement.read_text() if replacement.is_file() else path.read_text()

        for entry in model_dir.iterdir():
            if entry.name == "config.pbtxt":
                (out / entry.name).write_text(config(entry, "config.pbtxt"))
            elif entry.name == "configs" and entry.is_dir():
                (out / "configs").mkdir()
                for variant in entry.glob("*.pbtxt"):
                    (out / "configs" / variant.name).write_text(config(variant, f"configs/{variant.name}"))
            else:
                (out / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return target


# --------------------------------------------------------------------------- summary


@dataclass
class Point:
    """The rounds of one phase, workload and concurrency: medians, and the largest max."""

    phase: str
    workload: str
    concurrency: int
    rounds: int
    requests: int
    errors: int
    rps: float | None
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    p99_range: tuple[float, float] | None
    client_cores: float | None
    server_cores: float | None
    server_wait_cores: float | None
    machine_cores: float | None
    stats: dict
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_max_ms: float | None = None
    gateway_cores: float | None = None

    @property
    def p99_over_p50(self) -> float | None:
        return self.p99_ms / self.p50_ms if self.p99_ms and self.p50_ms else None

    @property
    def max_over_p50(self) -> float | None:
        return self.max_ms / self.p50_ms if self.max_ms and self.p50_ms else None


def points(windows: Sequence[Window]) -> list[Point]:
    groups: dict[tuple[str, str, int], list[Window]] = {}
    for w in windows:
        groups.setdefault((w.phase, w.workload, w.concurrency), []).append(w)
    out = []
    for (phase, workload, conc), ws in groups.items():
        p99s = [w.p99_ms for w in ws if w.p99_ms is not None]
        stats: dict[str, dict] = {}
        for model in {m for w in ws for m in w.stats}:
            per = [w.stats[model] for w in ws if model in w.stats]
            stats[model] = {k: median([s[k] for s in per]) for k in ("batch", "queue_ms", "compute_ms")}
        out.append(
            Point(
                phase,
                workload,
                conc,
                len(ws),
                sum(w.requests for w in ws),
                sum(w.errors for w in ws),
                median([w.rps for w in ws]),
                median([w.p50_ms for w in ws]),
                median(p99s),
                max((w.max_ms for w in ws if w.max_ms is not None), default=None),
                (min(p99s), max(p99s)) if p99s else None,
                median([w.client_cores for w in ws]),
                median([w.server_cores for w in ws]),
                median([w.server_wait_cores for w in ws]),
                median([w.machine_cores for w in ws]),
                stats,
                median([w.ttft_p50_ms for w in ws]),
                median([w.ttft_p99_ms for w in ws]),
                max((w.ttft_max_ms for w in ws if w.ttft_max_ms is not None), default=None),
                median([w.gateway_cores for w in ws]),
            )
        )
    return out


def targets(results: Sequence[Point], concurrency: int, phase: str = "after", long: bool = False) -> list[dict]:
    """The issue's targets, checked on ``phase`` at ``concurrency``: all-hit P99 <= 50 ms, every other
    workload P99 <= 3 x P50 (streams: the whole answer and TTFT), and with ``long`` (one long window
    per workload) max <= 5 x P50. Each row: target, value, met, and the figures it comes from."""
    rows = []
    by = {(r.phase, r.workload, r.concurrency): r for r in results}

    def row(target: str, value: float | None, limit: float, r: Point, detail: str) -> None:
        rows.append(
            {
                "target": target,
                "value": value,
                "limit": limit,
                "detail": detail,
                "met": value is not None and value <= limit and not r.errors,
                "cores": f"client {_f(r.client_cores, 2)}, server {_f(r.server_cores, 2)} "
                f"(waiting {_f(r.server_wait_cores, 2)}), machine {_f(r.machine_cores, 2)}",
            }
        )

    for name in WORKLOADS:
        r = by.get((phase, name, concurrency))
        if r is None:
            continue
        c = f"c{concurrency}"
        if name in HIT_WORKLOADS:
            row(f"{name}, {c}: P99 <= {TARGET_HITS_P99_MS:g} ms", r.p99_ms, TARGET_HITS_P99_MS, r, f"P99 {_f(r.p99_ms)} ms")
        else:
            what = "answer " if name in STREAM_WORKLOADS else ""
            row(
                f"{name}, {c}: {what}P99 <= {TARGET_P99_OVER_P50:g} x P50",
                r.p99_over_p50,
                TARGET_P99_OVER_P50,
                r,
                f"P50 {_f(r.p50_ms)}, P99 {_f(r.p99_ms)} ms",
            )
        if name in STREAM_WORKLOADS and r.ttft_p50_ms:
            row(
                f"{name}, {c}: TTFT P99 <= {TARGET_P99_OVER_P50:g} x P50",
                (r.ttft_p99_ms or 0) / r.ttft_p50_ms,
                TARGET_P99_OVER_P50,
                r,
                f"TTFT P50 {_f(r.ttft_p50_ms)}, P99 {_f(r.ttft_p99_ms)} ms",
            )
        if long:
            row(
                f"{name}, {c}: max <= {TARGET_MAX_OVER_P50:g} x P50 (long window)",
                r.max_over_p50,
                TARGET_MAX_OVER_P50,
                r,
                f"P50 {_f(r.p50_ms)}, max {_f(r.max_ms)} ms",
            )
            if name in STREAM_WORKLOADS and r.ttft_p50_ms:
                row(
                    f"{name}, {c}: TTFT max <= {TARGET_MAX_OVER_P50:g} x P50 (long window)",
                    (r.ttft_max_ms or 0) / r.ttft_p50_ms,
                    TARGET_MAX_OVER_P50,
                    r,
                    f"TTFT P50 {_f(r.ttft_p50_ms)}, max {_f(r.ttft_max_ms)} ms",
                )
    return rows


def targets_table(rows: Sequence[dict]) -> str:
    """The targets as a markdown table: each target, the figure, PASS / FAIL, and the CPU beside it."""
    lines = ["| target | value | result | from | CPU cores (client, server, machine) |", "| --- | ---: | --- | --- | --- |"]
    for t in rows:
        lines.append(f"| {t['target']} | {_f(t['value'], 2)} | {'PASS' if t['met'] else 'FAIL'} | {t['detail']} | {t['cores']} |")
    return "\n".join(lines) + "\n"


def _f(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(header: Sequence[str], results: Sequence[Point], target_rows: Sequence[dict]) -> str:
    lines = list(header) + [
        "",
        "| workload | conc. | phase | requests/s | P50 ms | P99 ms (rounds) | max ms | P99/P50 | errors | "
        "client cores | server cores | server waiting | machine cores |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ordered = sorted(results, key=lambda r: (WORKLOADS.index(r.workload), r.concurrency, r.phase != "before", r.phase))
    for r in ordered:
        spread = f" ({_f(r.p99_range[0])}-{_f(r.p99_range[1])})" if r.p99_range and r.rounds > 1 else ""
        lines.append(
            f"| {r.workload} | {r.concurrency} | {r.phase} | {_f(r.rps, 0 if r.rps and r.rps > 100 else 1)} | "
            f"{_f(r.p50_ms)} | {_f(r.p99_ms)}{spread} | {_f(r.max_ms)} | {_f(r.p99_over_p50, 2)} | {r.errors} | "
            f"{_f(r.client_cores, 2)} | {_f(r.server_cores, 2)} | {_f(r.server_wait_cores, 2)} | "
            f"{_f(r.machine_cores, 2)} |"
        )
    streams = [r for r in ordered if r.workload in STREAM_WORKLOADS]
    if streams:
        lines += [
            "",
            "Streams (P50/P99/max above are of the whole answer): time to the first text piece.",
            "",
            ("| workload | conc. | phase | answers/s | TTFT P50 ms | TTFT P99 ms | TTFT max ms | TTFT P99/P50 | gateway cores |"),
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in streams:
            ratio = r.ttft_p99_ms / r.ttft_p50_ms if r.ttft_p99_ms and r.ttft_p50_ms else None
            lines.append(
                f"| {r.workload} | {r.concurrency} | {r.phase} | {_f(r.rps, 1)} | {_f(r.ttft_p50_ms)} | "
                f"{_f(r.ttft_p99_ms)} | {_f(r.ttft_max_ms)} | {_f(ratio, 2)} | {_f(r.gateway_cores, 2)} |"
            )
    if target_rows:
        lines += ["", "Targets:", "", targets_table(target_rows).rstrip("\n")]
    lines += [
        "",
        "Where the time goes (/v2/models/stats, medians over rounds): mean batch, queue ms and "
        "compute ms per request of each model the workload reached.",
        "",
        "| workload | conc. | phase | model | batch | queue ms | compute ms |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for r in ordered:
        for model in (m for m in STATS_MODELS if m in r.stats):
            s = r.stats[model]
            lines.append(
                f"| {r.workload} | {r.concurrency} | {r.phase} | {model} | {_f(s['batch'], 2)} | "
                f"{_f(s['queue_ms'], 2)} | {_f(s['compute_ms'], 2)} |"
            )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def chat_prompts() -> list[str]:
    """The user messages the streams send, in turn (perf/data/generation_prompts.json, the long ones left out)."""
    doc = json.loads(GENERATION_PROMPTS.read_text(encoding="utf-8"))
    return [e["text"] for e in doc["prompts"] if e["kind"] != "long"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.tail", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--concurrency", default="4,32", help="comma-separated connection counts (default 4,32)")
    p.add_argument(
        "--phases",
        default="after,before",
        help="after (shipped configs) and/or before (stall settings; 'alt' with --alt-configs)",
    )
    p.add_argument(
        "--alt-configs",
        type=Path,
        help="a folder of <model>/config.pbtxt (and <model>/configs/*.pbtxt) the second server serves "
        "instead of the stall settings (phase 'alt')",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point (default 3)")
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per window (default 4)")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each window (default 1)")
    p.add_argument(
        "--client",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="load generator: wrk when installed (auto, default) or the asyncio client; "
        "image_classification always uses the asyncio client",
    )
    p.add_argument("--precision", default="cpu", help="what the server serves, as `make serve PRECISION=` (default cpu)")
    p.add_argument(
        "--cache-size-mb",
        type=int,
        default=DEFAULT_CACHE_SIZE_MB,
        help=f"Triton's response cache (default {DEFAULT_CACHE_SIZE_MB}, as make serve)",
    )
    p.add_argument("--out-dir", type=Path, help="results folder (default perf/results/tail-<UTC time>)")
    p.add_argument(
        "--long",
        type=float,
        metavar="SECONDS",
        help="long mode: one window of SECONDS per workload and phase at concurrency 32 (unless "
        "--concurrency names others), and the max <= 5 x P50 target checked on it",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=8,
        help="new tokens per streamed answer (ignore_eos, greedy) of the generation workloads (default 8)",
    )
    args = p.parse_args(argv)
    if args.long is not None:
        if args.long <= 0:
            p.error("--long must be positive")
        args.rounds, args.duration = 1, args.long
        if not any(a == "--concurrency" or a.startswith("--concurrency=") for a in (argv or sys.argv[1:])):
            args.concurrency = "32"
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.workload_list = [w for w in args.workloads.split(",") if w]
    args.concurrency_list = [int(c) for c in args.concurrency.split(",") if c]
    second = "alt" if args.alt_configs else "before"
    args.phase_list = [second if x in ("before", "alt") else x for x in args.phases.split(",") if x]
    if unknown := set(args.workload_list) - set(WORKLOADS):
        p.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    if set(args.phase_list) - {"after", second} or not args.phase_list:
        p.error(f"--phases: after, {second} or both")
    if args.alt_configs and not args.alt_configs.is_dir():
        p.error(f"--alt-configs {args.alt_configs}: not a folder")
    if (
        not args.concurrency_list
        or min(args.concurrency_list) < 1
        or args.duration <= 0
        or args.rounds < 1
        or args.max_tokens < 1
    ):
        p.error("--concurrency, --duration, --rounds and --max-tokens must be positive")
    if args.client == "wrk" and not shutil.which("wrk"):
        p.error("--client wrk: wrk is not installed (Debian package wrk)")
    args.use_wrk = args.client == "wrk" or (args.client == "auto" and shutil.which("wrk") is not None)
    return args


def run(args: argparse.Namespace) -> int:
    from perf.lib import served as served_mod
    from server.process import ServerError, ServerOptions, TritonServer

    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", flush=True)

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or DEFAULT_RESULTS / f"tail-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    served = served_mod.served_encoder(args.precision)
    sentences = served_mod.load_sentences(SENTENCES)
    load_avg = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    needs_image = "image_classification" in args.workload_list
    models = SERVED_MODELS if needs_image else tuple(m for m in SERVED_MODELS if m != "image_classification")
    if any(w in STREAM_WORKLOADS for w in args.workload_list):
        models += ("text_generation",)
    if "text_encoder_router" in args.workload_list:  # off text_embedding's path outside a rollout
        models += ("text_encoder_router",)
    needs_gateway = any(w in GATEWAY_WORKLOADS for w in args.workload_list)
    nonce = secrets.token_hex(4)
    api_key = "sk-tail-" + secrets.token_hex(16)
    work = workloads(nonce, sentences, api_key)
    prompts = chat_prompts()
    windows: list[Window] = []
    workdir = Path(tempfile.mkdtemp(prefix="perf-tail-"))
    scripts = {}
    if args.use_wrk:
        for name in args.workload_list:
            if work[name].kind not in ("image", "chat", "generation"):
                scripts[name] = workdir / f"{name}.lua"
                scripts[name].write_text(wrk_script(work[name], sentences, nonce))

    servers: dict[str, TritonServer] = {}
    gateways: dict = {}
    try:
        for phase in args.phase_list:
            repository = ROOT / "model_repository"
            if phase != "after":
                repository = before_repository(repository, workdir / f"repository-{phase}", args.alt_configs)
            servers[phase] = TritonServer(
                ServerOptions.with_free_ports(
                    workdir=workdir / phase,
                    model_repository=repository,
                    models=models,
                    model_config_name=served.config_name,
                    cache_size_bytes=args.cache_size_mb * 1024 * 1024,
                    repository_token=secrets.token_urlsafe(16),
                    front_door=False,
                )
            )
            say(
                f"perf.bench.tail: starting tritonserver for {phase} ({', '.join(models)}; "
                f"--model-config-name={served.config_name or '(none)'}, response cache {args.cache_size_mb} MiB)"
            )
            servers[phase].start()
        for phase, server in servers.items():
            try:
                server.wait_ready(timeout=300)
            except ServerError as exc:
                say(f"    {phase}: {exc}\n{exc.log_tail}")
                return 1
        if needs_gateway:
            from server.gateway import GatewayOptions, GatewayProcess
            from server.process import free_port

            for phase, server in servers.items():
                gateways[phase] = GatewayProcess(
                    GatewayOptions(
                        server.triton_grpc_url,
                        port=free_port(),
                        workdir=workdir / f"gateway-{phase}",
                        api_key_file=workdir / "gateway-api-key",
                        env={"GATEWAY_API_KEYS": api_key},
                        drain_timeout=5,
                        extra_args=["--rate-limit", "0", "--no-request-log"],
                    )
                ).start()
            for phase, gateway in gateways.items():
                gateway.wait_ready(timeout=120)
                say(f"perf.bench.tail: gateway for {phase} ready on {gateway.url}")
        if "before" in servers:
            with urllib.request.urlopen(
                f"http://{servers['before'].triton_http_url}/v2/models/text_tokenizer/config", timeout=10
            ) as r:
                levels = int(json.loads(r.read()).get("dynamic_batching", {}).get("priority_levels", 0))
            if levels != 2:
                raise RuntimeError(f"before phase: text_tokenizer serves priority_levels {levels}, not 2")
            if "text_generation" in models:
                with urllib.request.urlopen(
                    f"http://{servers['before'].triton_http_url}/v2/models/text_generation/config", timeout=10
                ) as r:
                    params = json.loads(r.read()).get("parameters", {})
                for key, value in BEFORE_PARAMETERS["text_generation"].items():
                    if params.get(key, {}).get("string_value") != value:
                        raise RuntimeError(f"before phase: text_generation serves {key} {params.get(key)}, not {value}")

        for conc in args.concurrency_list:
            for name in args.workload_list:
                for rnd in range(args.rounds):
                    order = args.phase_list if rnd % 2 == 0 else args.phase_list[::-1]
                    for phase in order:
                        server = servers[phase]
                        w = work[name]
                        gateway = gateways.get(phase) if w.via_gateway else None
                        url = gateway.url.removeprefix("http://") if gateway else server.triton_http_url
                        use_wrk = name in scripts
                        stream = name in STREAM_WORKLOADS
                        window = Window(phase, name, conc, rnd + 1, "wrk" if use_wrk else "python")
                        if use_wrk:
                            # Each wrk run counts from 1: a fresh salt per run, or the warm-up's texts
                            # (and an earlier window's) come back as cache hits in the measured window.
                            scripts[name].write_text(wrk_script(work[name], sentences, f"{nonce}-{secrets.token_hex(3)}"))
                        if not stream:
                            warm_up(url, w, conc, args.warmup, scripts.get(name))
                            if use_wrk:
                                scripts[name].write_text(wrk_script(work[name], sentences, f"{nonce}-{secrets.token_hex(3)}"))
                        meter = CpuMeter(server.process.pid if server.process else None)
                        gw_meter = CpuMeter(gateway.process.pid) if gateway is not None and gateway.process else None
                        stats0 = model_stats(server.triton_http_url)
                        meter.start()
                        if gw_meter:
                            gw_meter.start()
                        if stream:
                            target = gateway.url if gateway else server.triton_grpc_url
                            measure_stream(w, target, api_key, prompts, args.max_tokens, window, args.duration, args.warmup)
                        elif use_wrk:
                            measure_wrk(url, w, window, scripts[name], args.duration)
                        else:
                            measure_python(url, w, window, args.duration)
                        if gw_meter:
                            probe = Window(phase, name, conc, rnd + 1, "")
                            gw_meter.stop(probe)
                            window.gateway_cores = probe.server_cores
                        meter.stop(window)
                        window.stats = stats_delta(stats0, model_stats(server.triton_http_url))
                        windows.append(window)
                        say(
                            f"{phase:6} {name:28} c{conc:<3} r{rnd + 1} {_f(window.rps, 0):>6} req/s  "
                            f"P50 {_f(window.p50_ms):>7}  P99 {_f(window.p99_ms):>7}  max {_f(window.max_ms):>7} ms  "
                            f"client {_f(window.client_cores, 2)} server {_f(window.server_cores, 2)} "
                            f"waiting {_f(window.server_wait_cores, 2)} machine {_f(window.machine_cores, 2)} cores  "
                            + (
                                f"TTFT P50 {_f(window.ttft_p50_ms)} P99 {_f(window.ttft_p99_ms)} max {_f(window.ttft_max_ms)}  "
                                if stream
                                else ""
                            )
                            + (f"gateway {_f(window.gateway_cores, 2)} cores  " if gateway else "")
                            + f"errors {window.errors}"
                            + (f" ({window.first_error})" if window.first_error else "")
                        )
    finally:
        for phase, gateway in gateways.items():
            gateway.stop()
            if gateway.log_path.is_file():
                shutil.copyfile(gateway.log_path, out_dir / f"gateway-{phase}.log")
        for phase, server in servers.items():
            server.stop()
            if server.log_path.is_file():
                shutil.copyfile(server.log_path, out_dir / f"tritonserver-{phase}.log")
        shutil.rmtree(workdir, ignore_errors=True)

    results = points(windows)
    main_phase = "after" if "after" in args.phase_list else args.phase_list[0]
    target_rows = targets(results, max(args.concurrency_list), main_phase, long=args.long is not None)
    second = "a second server on the same machine with " + (
        f"the configs of {args.alt_configs}" if args.alt_configs else "the old settings"
    )
    header = [
        "# Latency tail per model and ensemble, side by side",
        "",
        f"- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before "
        f"{load_avg}, after {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- command: `{' '.join(['python -m perf.bench.tail', *args.argv])}`",
        (
            f"- phases {', '.join(args.phase_list)} interleaved in {args.rounds} rounds of {args.duration:g} s "
            f"(after {args.warmup:g} s warm-up); the second phase: {second}; encoder variant {served.variant}; "
            f"client {'wrk (1 thread, Lua)' if args.use_wrk else 'asyncio'} over HTTP keep-alive, straight to tritonserver "
            "(gateway_*: to an OpenAI gateway in front of each server); unique texts and images per request (hits: 60 "
            f"texts sent once first); streams: asyncio clients (SSE; gRPC for text_generation_stream), {args.max_tokens} "
            "new tokens (ignore_eos, greedy), the prompts of perf/data/generation_prompts.json in turn"
        ),
        "- figures: medians over the rounds (P99 range in brackets), max the largest; cores: CPU seconds per second; "
        "server waiting: seconds per second the server's threads were runnable but waited for a CPU (schedstat)",
    ]
    if args.long is None:
        header.append("- max <= 5 x P50 is a target over one long window per workload: `--long 60`")
    table = markdown(header, results, target_rows)
    (out_dir / "summary.md").write_text(table)
    write_csv(out_dir / "tail.csv", [w.record() for w in windows])
    (out_dir / "targets.md").write_text("\n".join(header[:3]) + "\n\n" + targets_table(target_rows))
    write_csv(out_dir / "targets.csv", target_rows)
    print("\n" + table, flush=True)
    print(f"Targets at c{max(args.concurrency_list)} ({main_phase}):\n\n" + targets_table(target_rows), flush=True)
    say(f"perf.bench.tail: results in {out_dir.relative_to(ROOT) if out_dir.is_relative_to(ROOT) else out_dir}")
    return 0 if windows and all(w.requests and not w.errors for w in windows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
