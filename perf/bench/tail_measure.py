"""perf.bench.tail's workloads and measurements: the request each workload sends (KServe v2 bodies
from perf.lib.workload, the gateway's embeddings body) and the wrk script that sends the same
(perf.lib.wrk); one window of a workload (wrk, the asyncio client of perf.lib.load, or the
streaming clients), the CPU it cost, and Triton's per-model statistics over it."""

from __future__ import annotations

import asyncio
import io
import math
import random
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf.lib import load, processes, triton_stats, wrk
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
    lua: str = ""  # wrk's request function (perf.lib.wrk) for a kind wrk_script does not build

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
    if w.lua:
        make = w.lua
    elif w.kind in ("gw_hits", "hits"):
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


# --------------------------------------------------------------------------- measurements

COLD_PASS_LIMIT_S = 120.0  # the longest a stream window waits for every prompt's first answer


@dataclass
class Window(load.Window):
    """A window (or a point: perf.lib.load.points) of perf.bench.tail, with the streams' TTFT and the CPU it cost."""

    ttft_p50_ms: float | None = None  # streams: time to the first piece of text
    ttft_p99_ms: float | None = None
    ttft_max_ms: float | None = None
    client_cores: float | None = None  # CPU seconds of the load generator per wall second
    gateway_cores: float | None = None  # the OpenAI gateway's process (gateway workloads)
    server_cores: float | None = None  # the same for tritonserver and its backend stubs
    server_wait_cores: float | None = None  # seconds its threads sat runnable, waiting for a CPU, per second
    machine_cores: float | None = None  # every process of the machine (neighbours included)


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
    """``concurrency`` closed-loop streams to ``target`` (the gateway's base URL, or tritonserver's gRPC
    host:port): ``(TTFT, total)`` seconds of each request started inside the measured part, errors,
    first error, measured seconds. That part starts once every client has had one answer, every
    prompt has been answered once (its cold prefill is left out; the prompts come back in turn,
    their prefixes cached) and ``warmup`` s have passed, and lasts ``duration`` s."""
    import aiohttp

    from clients.generation import AsyncGenerationClient
    from perf.lib.chat_streams import ChatSystem, DirectChat, GatewayChat

    system: ChatSystem
    if w.via_gateway:
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=300), connector=aiohttp.TCPConnector(limit=0)
        )
        system, close = GatewayChat(session, target, api_key), session.close
    else:
        direct = AsyncGenerationClient(target, protocol="grpc", timeout_s=300)
        system, close = DirectChat(direct), direct.close
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
        await close()
    return samples, errors, first_error, measured


def measure(
    window: Window,
    w: Workload,
    server,
    gateway,
    script: Path | None,
    duration: float,
    stream: tuple[str, Sequence[str], int, float] | None = None,
) -> None:
    """One window of ``w`` against ``server`` (a server.deployment.Deployment) or its ``gateway``: wrk with ``script``,
    else the asyncio client, or for a stream (``stream``: api key, prompts, new tokens, warm-up s)
    the streaming clients; the CPU each side used and Triton's statistics over it."""
    url = _url(server, gateway)
    meters = [CpuMeter(server.process.pid if server.process else None)]
    if gateway is not None and gateway.process:
        meters.append(CpuMeter(gateway.process.pid))
    stats0 = triton_stats.snapshot(server.triton_http_url)
    for m in meters:
        m.start()
    cpu0, wall0, children0 = time.process_time(), time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if stream is not None:
        target = gateway.url if gateway else server.triton_grpc_url
        api_key, prompts, max_tokens, warmup = stream
        samples, errors, first_error, seconds = asyncio.run(
            _stream_loop(w, target, api_key, prompts, max_tokens, window.concurrency, duration, warmup)
        )
        window.take(load.Tally(ok=[t for _, t in samples], errors=errors, first_error=first_error, seconds=seconds))
        ttft = load.latency_ms([f for f, _ in samples if not math.isnan(f)])
        window.ttft_p50_ms, window.ttft_p99_ms, window.ttft_max_ms = ttft["p50_ms"], ttft["p99_ms"], ttft["max_ms"]
    elif script is not None:
        window.take_wrk(wrk.run(url, script, window.concurrency, duration))
    else:
        window.take(asyncio.run(load.closed_loop(f"http://{url}{w.endpoint}", w.make, window.concurrency, duration)))
    wall = max(time.monotonic() - wall0, 1e-9)
    if script is not None:  # wrk: a child process
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        window.client_cores = (children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime) / wall
    else:
        window.client_cores = (time.process_time() - cpu0) / wall
    window.server_cores, window.server_wait_cores, window.machine_cores = meters[0].stop()
    if len(meters) > 1:
        window.gateway_cores = meters[1].stop()[0]
    window.stats = triton_stats.per_request(stats0, triton_stats.snapshot(server.triton_http_url), STATS_MODELS)


def _url(server, gateway) -> str:
    return gateway.url.removeprefix("http://") if gateway else server.triton_http_url


def warm_up(server, gateway, w: Workload, concurrency: int, seconds: float, script: Path | None) -> None:
    """Unmeasured: ``w.warm`` once (the hits' texts), then ``seconds`` of the same load."""
    endpoint = f"http://{_url(server, gateway)}{w.endpoint}"
    if w.warm:
        asyncio.run(load.closed_loop(endpoint, w.make, 1, 0.0, warm=w.warm))
    if seconds > 0:
        if script is not None:
            wrk.run(_url(server, gateway), script, concurrency, seconds)
        else:
            asyncio.run(load.closed_loop(endpoint, w.make, concurrency, seconds))


class CpuMeter:
    """CPU seconds of a process tree and of the whole machine, between start() and stop()."""

    def __init__(self, pid: int | None):
        self.pid = pid

    def _tree(self) -> tuple[float, float]:
        """(CPU seconds, run-queue wait seconds) of the tree's threads (/proc/<pid>/task/*/schedstat)."""
        cpu = wait = 0.0
        for pid in processes.tree(self.pid) if self.pid is not None else ():
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    fields = (task / "schedstat").read_text().split()
                    cpu, wait = cpu + int(fields[0]) / 1e9, wait + int(fields[1]) / 1e9
                except (OSError, ValueError, IndexError):
                    pass
        return cpu, wait

    def start(self) -> None:
        self.t0, self.tree0, self.machine0 = time.monotonic(), self._tree(), processes.machine_busy_s() or 0.0

    def stop(self) -> tuple[float, float, float]:
        """Cores used by the tree, cores its threads waited for, cores used by the machine."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        cpu, wait = self._tree()
        machine = (processes.machine_busy_s() or 0.0) - self.machine0
        return (cpu - self.tree0[0]) / wall, (wait - self.tree0[1]) / wall, machine / wall
