"""perf.bench.gateway_bench's systems and workloads: the targets, the measured cells, the embedding
clients and windows (direct, through the gateway, infinity-emb) and the chat streams."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

from perf.lib.chat_streams import ChatSystem, DirectChat, GatewayChat
from perf.lib.paths import GENERATION_PROMPTS as PROMPTS
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
