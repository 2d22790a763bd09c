"""`python -m perf.bench.gateway_bench` (`make perf-gateway`): the OpenAI gateway against Triton direct, side by side.

Starts its own tritonserver (text_embedding_cached, text_embedding, text_generation; the
launcher's code path, front door included) and two gateways in front of its gRPC port
(``python -m openai_gateway``, rate limit off): one with the request log off, one with it
on. Then, in one run, windows of each system take turns (A B C D A B C D ...) so a noisy
neighbour hurts them alike:

1. Embeddings, closed loop at --embed-concurrency (default 32) clients on one event loop
   (aiohttp), one text per request, each window --embed-duration seconds:
     direct        POST /v2/models/text_embedding_cached/infer on the front door, the text as
                   a JSON TEXT input (Triton's own HTTP endpoint, as clients reach it);
     gateway       POST /v1/embeddings, encoding_format float, request log off;
     gateway_b64   the same with encoding_format base64;
     gateway_log   float with the request log on (one JSON line per request);
     infinity      the peer: infinity-emb's POST /embeddings, its optimum engine (ONNX Runtime) on the
                   same model quantized to INT8 by optimum for this CPU (dynamic, per channel: what
                   infinity picks on a CPU; its worst held-out text moves to cosine 0.967 of FP32's,
                   where the served INT8 keeps 0.997, export/text_quant.py), its dynamic batch of 32
                   (perf/baselines/infinity.py; installed on first use into its own virtualenv);
     infinity_fp32 the same server on the FP32 file (``--onnx-do-not-prefer-quantized``).
   Two workloads: ``unique`` (a sentence of perf/data/sentences_16tok.json with a counter, never
   sent twice: every request is a cache miss computed by text_embedding) and ``repeated`` (the
   60 sentences as they are, warmed first: every request is a hit of the result cache).
   Every response is parsed (orjson; base64 decoded) and its vector length checked.
2. Chat streaming, greedy, --max-tokens (default 64) new tokens with ``ignore_eos``, the
   prompts of perf/data/generation_prompts.json (the long ones left out), at each
   --chat-concurrency (default 1 and 8); each window runs --chat-requests requests per
   client to their end (client k starting k x --chat-stagger-ms after the first), the same
   prompts for both systems:
     gateway       POST /v1/chat/completions, stream true, include_usage (raw SSE, aiohttp);
     direct        text_generation over a gRPC stream, clients.generation.AsyncGenerationClient,
                   on the tritonserver port the gateway itself uses (so the difference is the
                   gateway's hop and nothing else).
   TTFT is from send to the first piece of text; tokens/s is the window's output tokens over
   its length (every request runs to max_tokens, so both systems make the same tokens).

Prints a markdown table and the ratios the issue's targets are written in (embeddings at
concurrency 32: gateway/direct throughput >= 0.8, P99 <= 1.3x; direct and gateway against
infinity-emb, unique texts: throughput >= 3x with <= 1/4 of its P99; chat: TTFT within 10 ms of
direct, tokens/s >= 0.95x), and writes them as JSON to --out (default
perf/results/gateway-<UTC time>.json, the table beside it as .md). The client's own CPU time
per window is recorded too: on 2 cores the load generator competes with the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import itertools
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from perf.lib.chat_streams import ChatSystem, DirectChat, GatewayChat
from perf.lib.paths import GENERATION_PROMPTS as PROMPTS
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.paths import SENTENCES_16TOK as SENTENCES
from perf.lib.stats import percentile

MODELS = ("text_embedding_cached", "text_embedding", "text_generation")
DIRECT_EMBED_MODEL = "text_embedding_cached"
DIMENSIONS = 384
EMBED_SYSTEMS = ("direct", "gateway", "gateway_b64", "gateway_log", "infinity", "infinity_fp32")
PEER_SYSTEMS = ("infinity", "infinity_fp32")
CHAT_SYSTEMS = ("direct", "gateway")
WORKLOADS = ("unique", "repeated")

# The targets, checked (not enforced) in the printed ratios.
TARGET_EMBED_THROUGHPUT = 0.8  # gateway / direct requests/s at concurrency 32, at least
TARGET_EMBED_P99 = 1.3  # gateway / direct P99, at most
TARGET_TTFT_MS = 10.0  # gateway TTFT - direct TTFT, at most
TARGET_TOKENS = 0.95  # gateway / direct tokens/s, at least
TARGET_VS_PEER = 3.0  # direct or gateway / infinity-emb requests/s, unique texts, at least
TARGET_P99_VS_PEER = 0.25  # direct or gateway / infinity-emb P99, at most
SAME_MODEL_COSINE = 0.9999  # the project's systems: one served model
PEER_COSINE = 0.98  # infinity-emb's INT8 file (optimum's dynamic quantization) against the served INT8 model


# --------------------------------------------------------------------------- records


@dataclass
class EmbedCell:
    system: str
    workload: str
    concurrency: int
    latencies: list[float] = field(default_factory=list)  # seconds, requests that succeeded
    seconds: float = 0.0  # the windows' lengths, summed
    client_cpu_s: float = 0.0
    windows: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        lat = sorted(self.latencies)

        def q(p):
            return round(1000 * percentile(lat, p), 2) if lat else None

        return {
            "system": self.system,
            "workload": self.workload,
            "concurrency": self.concurrency,
            "windows": self.windows,
            "seconds": round(self.seconds, 2),
            "requests": len(lat),
            "requests_per_s": round(len(lat) / self.seconds, 1) if self.seconds and lat else None,
            "p50_ms": q(50),
            "p99_ms": q(99),
            "max_ms": q(100),
            "client_cpu_per_request_ms": round(1000 * self.client_cpu_s / len(lat), 3) if lat else None,
            "errors": len(self.errors),
            "first_error": self.errors[0][:300] if self.errors else "",
        }


@dataclass
class ChatCell:
    system: str
    concurrency: int
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    seconds: float = 0.0
    client_cpu_s: float = 0.0
    windows: int = 0
    token_counts: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        t = sorted(self.ttft)

        def q(p):
            return round(1000 * percentile(t, p), 1) if t else None

        return {
            "system": self.system,
            "concurrency": self.concurrency,
            "windows": self.windows,
            "seconds": round(self.seconds, 2),
            "requests": self.requests,
            "output_tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds and self.tokens else None,
            "ttft_p50_ms": q(50),
            "ttft_p99_ms": q(99),
            "ttft_max_ms": q(100),
            "tokens_per_request": sorted(set(self.token_counts)),
            "client_cpu_s": round(self.client_cpu_s, 2),
            "errors": len(self.errors),
            "first_error": self.errors[0][:300] if self.errors else "",
        }


# --------------------------------------------------------------------------- embeddings


class EmbedClient:
    """One system's embeddings request for one text: sends it, parses the answer, checks the vector."""

    def __init__(self, session, system: str, direct_url: str, gateway_urls: dict[str, str], key: str):
        self.session, self.system = session, system
        if system == "direct":
            self.url = f"http://{direct_url}/v2/models/{DIRECT_EMBED_MODEL}/infer"
            self.headers = {"Content-Type": "application/json"}
        elif system in PEER_SYSTEMS:
            self.url = f"{gateway_urls[system]}/embeddings"
            self.headers = {"Content-Type": "application/json"}
        else:
            self.url = f"{gateway_urls['log' if system == 'gateway_log' else 'quiet']}/v1/embeddings"
            self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        self.encoding = "base64" if system == "gateway_b64" else "float"

    def body(self, text: str) -> bytes:
        if self.system == "direct":
            return orjson.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]})
        return orjson.dumps({"model": "text_embedding", "input": text, "encoding_format": self.encoding})

    def vector(self, raw: bytes):
        """The response's vector (a list of floats, or an ndarray for base64)."""
        doc = orjson.loads(raw)
        if self.system == "direct":
            return doc["outputs"][0]["data"]
        item = doc["data"][0]["embedding"]
        if self.encoding == "base64":
            import numpy as np

            return np.frombuffer(base64.b64decode(item), dtype="<f4")
        return item

    async def send(self, text: str):
        async with self.session.post(self.url, data=self.body(text), headers=self.headers) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
        vec = self.vector(raw)
        if len(vec) != DIMENSIONS:
            raise RuntimeError(f"a vector of {len(vec)} values, not {DIMENSIONS}")
        return vec


async def embed_window(client: EmbedClient, texts, concurrency: int, duration: float, cell: EmbedCell) -> None:
    """``concurrency`` closed-loop clients for ``duration`` s; requests sent before the end are waited for
    (they take milliseconds) and counted, the window's length runs to the last answer."""
    stop_at = time.perf_counter() + duration
    started = time.perf_counter()
    cpu0 = time.process_time()

    async def one_client():
        while time.perf_counter() < stop_at:
            text = next(texts)
            t0 = time.perf_counter()
            try:
                await client.send(text)
                cell.latencies.append(time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - recorded, the window goes on
                cell.errors.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.01)

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    cell.seconds += time.perf_counter() - started
    cell.client_cpu_s += time.process_time() - cpu0
    cell.windows += 1


def unique_texts(sentences: Sequence[str]):
    """Each text once in the whole run (a counter in it): no cache answers any of them."""
    run = secrets.token_hex(3)
    for n in itertools.count():
        yield f"{sentences[n % len(sentences)]} ({run}-{n})"


async def check_same_vectors(clients: dict[str, EmbedClient], text: str) -> dict[str, float]:
    """Each system's cosine against direct's vector for one text (a benchmark that compares
    systems must first see them give the same answer)."""
    import numpy as np

    vecs = {name: np.asarray(await c.send(text), dtype=np.float64) for name, c in clients.items()}
    ref = vecs["direct"]
    return {name: float(v @ ref / (np.linalg.norm(v) * np.linalg.norm(ref))) for name, v in vecs.items()}


async def run_embeddings(args, direct_url: str, gateway_urls: dict[str, str], key: str, say) -> list[EmbedCell]:
    import aiohttp

    sentences = [d["TEXT"]["content"][0] for d in json.loads(SENTENCES.read_text())["data"]]
    cells: dict[tuple[str, str], EmbedCell] = {}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        clients = {s: EmbedClient(session, s, direct_url, gateway_urls, key) for s in args.embed_systems}
        cosines = await check_same_vectors(clients, sentences[0])
        say("  embeddings: cosine against direct's vector: " + ", ".join(f"{k} {v:.6f}" for k, v in cosines.items()))
        for name, cosine in cosines.items():
            if cosine < (PEER_COSINE if name in PEER_SYSTEMS else SAME_MODEL_COSINE):
                raise RuntimeError(f"{name} gives a different vector (cosine {cosine:.6f} against direct's)")
        # Warm-up: connections opened, the repeated texts cached, first-request costs paid.
        for c in clients.values():
            await asyncio.gather(*(c.send(s) for s in sentences))
        uniq = unique_texts(sentences)
        repeated = itertools.cycle(sentences)
        order = list(args.embed_systems)
        turn = 0
        for rnd in range(args.rounds):
            for workload in WORKLOADS:
                for system in order[turn % len(order) :] + order[: turn % len(order)]:
                    cell = cells.setdefault((workload, system), EmbedCell(system, workload, args.embed_concurrency))
                    await embed_window(
                        clients[system],
                        uniq if workload == "unique" else repeated,
                        args.embed_concurrency,
                        args.embed_duration,
                        cell,
                    )
                turn += 1
            say(
                f"  embeddings round {rnd + 1}: "
                + ", ".join(f"{w}/{s} {c.summary()['requests_per_s']}/s" for (w, s), c in cells.items())
            )
    return list(cells.values())


# --------------------------------------------------------------------------- chat


async def chat_window(
    system, prompts: Sequence[str], concurrency: int, per_client: int, max_tokens: int, cell: ChatCell, stagger_s: float = 0.0
) -> None:
    """``concurrency`` clients, each ``per_client`` requests one after the other, to their end;
    client k starts ``k * stagger_s`` after the first."""
    queue = list(prompts)
    started = time.perf_counter()
    cpu0 = time.process_time()

    async def one_client(k: int):
        if stagger_s:
            await asyncio.sleep(k * stagger_s)
        for j in range(per_client):
            prompt = queue[(k * per_client + j) % len(queue)]
            try:
                ttft, tokens = await system.stream(prompt, max_tokens)
            except Exception as exc:  # noqa: BLE001 - recorded, the window goes on
                cell.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            cell.requests += 1
            cell.tokens += tokens
            cell.token_counts.append(tokens)
            if ttft is not None:
                cell.ttft.append(ttft)

    await asyncio.gather(*(one_client(k) for k in range(concurrency)))
    cell.seconds += time.perf_counter() - started
    cell.client_cpu_s += time.process_time() - cpu0
    cell.windows += 1


async def run_chat(args, gateway_url: str, triton_grpc: str, key: str, say) -> list[ChatCell]:
    import aiohttp

    from clients.generation import AsyncGenerationClient

    doc = json.loads(PROMPTS.read_text(encoding="utf-8"))
    prompts = [e["text"] for e in doc["prompts"] if e["kind"] != "long"]
    cells: dict[tuple[str, int], ChatCell] = {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    direct_client = AsyncGenerationClient(triton_grpc, protocol="grpc", timeout_s=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        every: dict[str, ChatSystem] = {"gateway": GatewayChat(session, gateway_url, key), "direct": DirectChat(direct_client)}
        systems = {k: every[k] for k in CHAT_SYSTEMS if k in args.chat_systems}
        try:
            for system in systems.values():  # warm-up: channels open, first-request costs out of the windows
                await system.stream(prompts[0], 4)
            order = list(systems)
            turn = 0
            for rnd in range(args.rounds):
                for c in args.chat_concurrency:
                    # Each round its own prompts, the same for both systems.
                    window_prompts = prompts[(rnd * c * args.chat_requests) % len(prompts) :] + prompts
                    for key_ in order[turn % len(order) :] + order[: turn % len(order)]:
                        cell = cells.setdefault((key_, c), ChatCell(key_, c))
                        await chat_window(
                            systems[key_],
                            window_prompts,
                            c,
                            args.chat_requests,
                            args.max_tokens,
                            cell,
                            args.chat_stagger_ms / 1000,
                        )
                        s = cell.summary()
                        say(
                            f"  chat round {rnd + 1} c{c:<2} {key_:<7} {s['tokens_per_s']} tokens/s, "
                            f"TTFT p50 {s['ttft_p50_ms']} ms"
                        )
                    turn += 1
        finally:
            await direct_client.close()
    return list(cells.values())


# --------------------------------------------------------------------------- report


def _fmt(value, digits: int = 1) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _embed_ratio_rows(
    label: str, ours: dict, ref: dict, targets: tuple[float, float], concurrency: int
) -> list[dict[str, object]]:
    """Throughput (ours / ref, at least targets[0]) and P99 (at most targets[1]) of two embeddings cells;
    the targets are written for 32 clients and checked there only."""
    checked = concurrency == 32
    rows = []
    for name, num, den, tgt, above in (
        ("throughput", ours["requests_per_s"], ref["requests_per_s"], targets[0], True),
        ("P99", ours["p99_ms"], ref["p99_ms"], targets[1], False),
    ):
        value = round(num / den, 3) if num and den else None
        met = None if value is None or not checked else (value >= tgt if above else value <= tgt)
        rows.append(
            {
                "name": f"{label} {name}, c{concurrency}",
                "value": value,
                "target": f"{'>=' if above else '<='} {tgt:g}" if checked else "",
                "met": "" if met is None else ("yes" if met else "no"),
                "detail": f"{_fmt(num)} / {_fmt(den)}",
            }
        )
    return rows


def ratios(embed: Sequence[dict], chat: Sequence[dict], embed_concurrency: int) -> list[dict[str, object]]:
    rows = []
    by = {(s["workload"], s["system"]): s for s in embed}
    for workload in WORKLOADS:
        d = by.get((workload, "direct"))
        for system in EMBED_SYSTEMS[1:]:
            g = by.get((workload, system))
            if system in PEER_SYSTEMS or not d or not g:
                continue
            label = f"embeddings {workload}, {system} / direct"
            rows += _embed_ratio_rows(label, g, d, (TARGET_EMBED_THROUGHPUT, TARGET_EMBED_P99), embed_concurrency)
    for peer in PEER_SYSTEMS:
        theirs = by.get(("unique", peer))
        for system in ("direct", "gateway"):
            ours = by.get(("unique", system))
            if not theirs or not ours:
                continue
            label = f"embeddings unique, {system} / {peer}"
            rows += _embed_ratio_rows(label, ours, theirs, (TARGET_VS_PEER, TARGET_P99_VS_PEER), embed_concurrency)
    cb = {(s["system"], s["concurrency"]): s for s in chat}
    for c in sorted({s["concurrency"] for s in chat}):
        g, d = cb.get(("gateway", c)), cb.get(("direct", c))
        if not g or not d:
            continue
        for p in ("p50", "p99"):
            a, b = g[f"ttft_{p}_ms"], d[f"ttft_{p}_ms"]
            value = round(a - b, 1) if a is not None and b is not None else None
            met = None if value is None else value <= TARGET_TTFT_MS
            rows.append(
                {
                    "name": f"chat c{c}, gateway - direct TTFT {p.upper()} (ms)",
                    "value": value,
                    "target": f"<= {TARGET_TTFT_MS:g}",
                    "met": "" if met is None else ("yes" if met else "no"),
                    "detail": f"{_fmt(a)} - {_fmt(b)} ms",
                }
            )
        a, b = g["tokens_per_s"], d["tokens_per_s"]
        value = round(a / b, 3) if a and b else None
        met = None if value is None else value >= TARGET_TOKENS
        rows.append(
            {
                "name": f"chat c{c}, gateway / direct tokens/s",
                "value": value,
                "target": f">= {TARGET_TOKENS:g}",
                "met": "" if met is None else ("yes" if met else "no"),
                "detail": f"{_fmt(a, 2)} / {_fmt(b, 2)}",
            }
        )
    return rows


def markdown(header: Sequence[str], embed: Sequence[dict], chat: Sequence[dict], ratio_rows: Sequence[dict]) -> str:
    lines = list(header)
    if embed:
        lines += [
            "",
            (
                "| embeddings | workload | concurrency | requests/s | P50 ms | P99 ms | max ms | requests | "
                "client CPU ms/request | errors |"
            ),
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for s in embed:
            err = f"{s['errors']}: {s['first_error'][:80]}" if s["errors"] else "0"
            lines.append(
                f"| {s['system']} | {s['workload']} | {s['concurrency']} | {_fmt(s['requests_per_s'])} | "
                f"{_fmt(s['p50_ms'], 2)} | {_fmt(s['p99_ms'], 2)} | {_fmt(s['max_ms'], 2)} | {s['requests']} | "
                f"{_fmt(s['client_cpu_per_request_ms'], 3)} | {err} |"
            )
    if chat:
        lines += [
            "",
            (
                "| chat stream | concurrency | tokens/s | TTFT P50 ms | TTFT P99 ms | TTFT max ms | requests | "
                "tokens per request | errors |"
            ),
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        ]
        for s in chat:
            err = f"{s['errors']}: {s['first_error'][:80]}" if s["errors"] else "0"
            lines.append(
                f"| {s['system']} | {s['concurrency']} | {_fmt(s['tokens_per_s'], 2)} | {_fmt(s['ttft_p50_ms'])} | "
                f"{_fmt(s['ttft_p99_ms'])} | {_fmt(s['ttft_max_ms'])} | {s['requests']} | "
                f"{','.join(map(str, s['tokens_per_request']))} | {err} |"
            )
    if ratio_rows:
        lines += ["", "| ratio | value | target | met | from |", "| --- | ---: | --- | --- | --- |"]
        for r in ratio_rows:
            lines.append(f"| {r['name']} | {_fmt(r['value'], 3)} | {r['target']} | {r['met']} | {r['detail']} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(choices: Sequence[str]):
    def parse(s: str) -> list[str]:
        names = [x.strip() for x in s.split(",") if x.strip()]
        unknown = sorted(set(names) - set(choices))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(choices)}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.gateway_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of interleaved windows (default 3)")
    p.add_argument("--embed-concurrency", type=int, default=32, help="embedding clients (default 32)")
    p.add_argument("--embed-duration", type=float, default=4.0, help="seconds per embeddings window (default 4)")
    p.add_argument(
        "--embed-systems",
        type=_names(EMBED_SYSTEMS),
        default=list(EMBED_SYSTEMS),
        help=f"comma-separated subset of {','.join(EMBED_SYSTEMS)}",
    )
    p.add_argument("--chat-concurrency", type=_ints, default=[1, 8], help="chat streams, comma-separated (default 1,8)")
    p.add_argument("--chat-requests", type=int, default=3, help="chat requests per client per window (default 3)")
    p.add_argument(
        "--chat-systems",
        type=_names(CHAT_SYSTEMS),
        default=list(CHAT_SYSTEMS),
        help=f"comma-separated subset of {','.join(CHAT_SYSTEMS)}",
    )
    p.add_argument(
        "--chat-stagger-ms",
        type=float,
        default=25.0,
        help="client k of a chat window starts k x this many ms after the first (default 25; 0: all at once, "
        "which makes TTFT hinge on whether all arrive before the engine's next step)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per chat request, ignore_eos (default 64)")
    p.add_argument(
        "--precision",
        default=os.environ.get("PRECISION", "auto"),
        help="what Triton serves, as `make serve PRECISION=` (default auto, or $PRECISION)",
    )
    p.add_argument(
        "--watchdog-folder",
        action="store_true",
        help="give the gateways an (empty) stub watchdog folder, as `make serve` does (--triton-health-dir): "
        "its streams are then watched for a dead stub",
    )
    p.add_argument("--no-embeddings", action="store_true", help="skip the embeddings part")
    p.add_argument("--no-chat", action="store_true", help="skip the chat part (text_generation is then not loaded)")
    p.add_argument(
        "--out",
        type=Path,
        help="the JSON of results (default perf/results/gateway-<UTC time>.json); "
        "the markdown table and the servers' logs go beside it",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if (
        args.rounds < 1
        or args.embed_concurrency < 1
        or args.embed_duration <= 0
        or args.chat_requests < 1
        or args.max_tokens < 1
        or not args.chat_concurrency
        or min(args.chat_concurrency) < 1
    ):
        p.error(
            "--rounds, --embed-concurrency, --embed-duration, --chat-concurrency, --chat-requests and "
            "--max-tokens must be positive"
        )
    if "direct" not in args.embed_systems:
        args.embed_systems.insert(0, "direct")  # the reference every ratio is taken against
    return args


def start_servers(args, workdir: Path, key: str, say):
    from export import variants
    from server.gateway import GatewayOptions, GatewayProcess
    from server.layout import ROOT
    from server.process import ServerOptions, TritonServer, free_port

    models = tuple(m for m in MODELS if not (args.no_chat and m == "text_generation"))
    local = tuple(v for v in variants.VARIANTS if v != "trt_plan")  # what this server can load, as the launcher's
    config_name, served = variants.resolve_precision(
        ROOT / "model_repository", ["text_encoder", *models], args.precision, loadable=local
    )
    triton = TritonServer(
        ServerOptions.with_free_ports(workdir=workdir / "triton", models=models, model_config_name=config_name)
    ).start()
    say(
        f"tritonserver starting ({', '.join(models)}; PRECISION={args.precision}: text_encoder={served['text_encoder']}"
        + (f", text_generation={served['text_generation']}" if "text_generation" in served else "")
        + f"): http {triton.http_url}, internal grpc {triton.triton_grpc_url}"
    )
    triton.wait_ready(timeout=300)
    gateways = {}
    watch = []
    if args.watchdog_folder:
        (workdir / "health").mkdir(parents=True, exist_ok=True)
        watch = ["--triton-health-dir", str(workdir / "health")]
    for name, extra in (("quiet", ["--no-request-log", *watch]), ("log", watch)):
        if name == "log" and ("gateway_log" not in args.embed_systems or args.no_embeddings):
            continue
        gw = GatewayProcess(
            GatewayOptions(
                triton.triton_grpc_url,
                port=free_port(),
                workdir=workdir / f"gateway-{name}",
                api_key_file=workdir / "gateway-api-key",
                extra_args=["--rate-limit", "0", *extra],
                env={"GATEWAY_API_KEYS": key},
                drain_timeout=5,
            )
        )
        gateways[name] = gw.start()
    for name, gw in gateways.items():
        gw.wait_ready(timeout=120)
        assert gw.process is not None  # started above
        say(f"gateway ({name}, pid {gw.process.pid}) ready on {gw.url}")
    return triton, gateways


def start_peers(args, workdir: Path, say) -> dict:
    """infinity-emb's servers the embeddings ask for (a system whose server cannot run here is dropped, with the reason)."""
    peers: dict = {}
    wanted = [s for s in PEER_SYSTEMS if s in args.embed_systems and not args.no_embeddings]
    if not wanted:
        return peers
    from perf.baselines.infinity import InfinityError, InfinityServer
    from server.process import free_port

    for system in wanted:
        try:
            peer = InfinityServer(free_port(), workdir / f"{system}.log", quantized=system == "infinity", say=say)
            peers[system] = peer.start()
        except (InfinityError, OSError) as exc:
            say(f"{system} skipped: {exc}")
            args.embed_systems.remove(system)
            continue
        what = "INT8, dynamic per channel" if peer.quantized else "FP32"
        say(f"{system} ready on {peer.url} (infinity-emb, optimum engine, {what}, batch {peer.batch_size})")
    return peers


def run(args: argparse.Namespace) -> int:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or DEFAULT_RESULTS / f"gateway-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", flush=True)

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    say(f"perf.bench.gateway_bench: {args.rounds} round(s), load average {load}")
    key = "sk-bench-" + secrets.token_hex(16)
    workdir = Path(tempfile.mkdtemp(prefix="perf-gateway-"))
    triton = None
    gateways: dict = {}
    peers: dict = {}
    embed_cells: list[EmbedCell] = []
    chat_cells: list[ChatCell] = []
    failure = ""
    try:
        triton, gateways = start_servers(args, workdir, key, say)
        peers = start_peers(args, workdir, say)
        urls = {name: gw.url for name, gw in gateways.items()}
        urls.update({name: peer.url for name, peer in peers.items()})
        if not args.no_embeddings:
            embed_cells = asyncio.run(run_embeddings(args, triton.http_url, urls, key, say))
        if not args.no_chat:
            chat_cells = asyncio.run(run_chat(args, urls["quiet"], triton.triton_grpc_url, key, say))
    except Exception as exc:  # noqa: BLE001 - reported, with what was measured so far
        failure = f"{type(exc).__name__}: {exc}"
        say(f"perf.bench.gateway_bench stopped: {failure}")
    finally:
        for name, peer in peers.items():
            peer.stop()
            if peer.log_path.is_file():
                shutil.copyfile(peer.log_path, out.with_name(f"{out.stem}-{name}.log"))
        for name, gw in gateways.items():
            gw.stop()
            if gw.log_path.is_file():
                shutil.copyfile(gw.log_path, out.with_name(f"{out.stem}-gateway-{name}.log"))
        if triton is not None:
            triton.stop()
            if triton.log_path.is_file():
                shutil.copyfile(triton.log_path, out.with_name(f"{out.stem}-tritonserver.log"))
        shutil.rmtree(workdir, ignore_errors=True)

    embed = [c.summary() for c in sorted(embed_cells, key=lambda c: (WORKLOADS.index(c.workload), EMBED_SYSTEMS.index(c.system)))]
    chat = [c.summary() for c in sorted(chat_cells, key=lambda c: (c.concurrency, CHAT_SYSTEMS.index(c.system)))]
    ratio_rows = ratios(embed, chat, args.embed_concurrency)
    header = [
        "# OpenAI gateway vs Triton direct",
        "",
        f"- {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before measuring {load}",
        f"- command: `{' '.join(['python -m perf.bench.gateway_bench', *args.argv])}`",
        (
            f"- embeddings: {args.embed_concurrency} closed-loop clients (aiohttp, one loop), one text per request, "
            f"{args.embed_duration:g} s windows x {args.rounds} round(s), systems interleaved; direct = POST "
            f"/v2/models/{DIRECT_EMBED_MODEL}/infer on the front door, gateway = POST /v1/embeddings, "
            "infinity / infinity_fp32 = infinity-emb's POST /embeddings (optimum engine, INT8 / FP32)"
        ),
        (
            f"- chat: {args.max_tokens} new tokens (ignore_eos, greedy), {args.chat_requests} request(s) per client per "
            f"window, concurrency {','.join(map(str, args.chat_concurrency))}, clients {args.chat_stagger_ms:g} ms apart; "
            "direct = text_generation over gRPC (AsyncGenerationClient) on the port the gateway uses, gateway = "
            "/v1/chat/completions SSE"
        ),
    ]
    if failure:
        header.append(f"- stopped early: {failure}")
    table = markdown(header, embed, chat, ratio_rows)
    result = {
        "command": ["python", "-m", "perf.bench.gateway_bench", *args.argv],
        "load_average_before": load,
        "cpus": os.cpu_count(),
        "embeddings": embed,
        "chat": chat,
        "ratios": ratio_rows,
        "error": failure,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print("\n" + table, flush=True)
    say(f"perf.bench.gateway_bench: results in {out}")
    complete = (args.no_embeddings or len(embed) == len(WORKLOADS) * len(args.embed_systems)) and (
        args.no_chat or len(chat) == len(args.chat_systems) * len(args.chat_concurrency)
    )
    return 0 if not failure and complete else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
