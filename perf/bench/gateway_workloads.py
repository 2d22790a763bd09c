"""perf.bench.gateway_bench's systems and workloads: the embedding clients (direct, through the
gateway, infinity-emb) and the chat streams, driven by the shared loop (perf.lib.load.call_loop),
each system's windows pooled in a Cell."""

from __future__ import annotations

import asyncio
import base64
import itertools
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import orjson

from perf.lib import workload
from perf.lib.chat_streams import ChatSystem, DirectChat, GatewayChat
from perf.lib.load import Tally, call_loop, latency_ms

DIRECT_EMBED_MODEL = "text_embedding_cached"
DIMENSIONS = 384
EMBED_SYSTEMS = ("direct", "gateway", "gateway_b64", "gateway_log", "infinity", "infinity_fp32")
PEER_SYSTEMS = ("infinity", "infinity_fp32")
CHAT_SYSTEMS = ("direct", "gateway")
WORKLOADS = ("unique", "repeated")
SAME_MODEL_COSINE = 0.9999  # the project's systems: one served model
PEER_COSINE = 0.98  # infinity-emb's INT8 file (optimum's dynamic quantization) against the served INT8 model


@dataclass
class Cell:
    """One system under one workload (unique, repeated; chat) and concurrency: its windows, pooled."""

    system: str
    workload: str
    concurrency: int
    tally: Tally = field(default_factory=Tally)
    client_cpu_s: float = 0.0
    windows: int = 0
    ttft: list[float] = field(default_factory=list)  # chat: seconds to the first text
    tokens: list[int] = field(default_factory=list)  # chat: output tokens of each request

    def add(self, tally: Tally, cpu_s: float) -> None:
        self.tally.merge(tally)
        self.client_cpu_s += cpu_s
        self.windows += 1

    def summary(self) -> dict[str, object]:
        t, n, tokens = self.tally, len(self.tally.ok), sum(self.tokens)
        out: dict[str, object] = {"system": self.system, "workload": self.workload, "concurrency": self.concurrency}
        out |= {"windows": self.windows, "seconds": round(t.seconds, 2), "requests": n, "errors": t.errors}
        out["first_error"] = t.first_error[:300]
        if self.workload == "chat":
            out |= {f"ttft_{k}": None if v is None else round(v, 1) for k, v in latency_ms(self.ttft).items()}
            out["tokens_per_s"] = round(tokens / t.seconds, 2) if t.seconds and tokens else None
            out |= {
                "output_tokens": tokens,
                "tokens_per_request": sorted(set(self.tokens)),
                "client_cpu_s": round(self.client_cpu_s, 2),
            }
        else:
            out |= {k: None if v is None else round(v, 2) for k, v in latency_ms(t.ok).items()}
            out["requests_per_s"] = round(n / t.seconds, 1) if n and t.seconds else None
            out["client_cpu_per_request_ms"] = round(1000 * self.client_cpu_s / n, 3) if n else None
        return out


async def window(cell: Cell, call, concurrency: int, seconds: float | None = None, count: int | None = None) -> None:
    """One window of the shared loop into ``cell``, with the client's CPU time."""
    cpu0 = time.process_time()
    tally = await call_loop(call, concurrency, seconds, count)
    cell.add(tally, time.process_time() - cpu0)


# --------------------------------------------------------------------------- embeddings


class EmbedClient:
    """One system's embeddings request for one text: sends it, parses the answer, checks the vector."""

    def __init__(self, session, system: str, direct_url: str, urls: dict[str, str], key: str):
        self.session, self.system = session, system
        self.headers = {"Content-Type": "application/json"}
        self.encoding = "base64" if system == "gateway_b64" else "float"
        if system == "direct":
            self.url = f"http://{direct_url}/v2/models/{DIRECT_EMBED_MODEL}/infer"
        elif system in PEER_SYSTEMS:
            self.url = f"{urls[system]}/embeddings"
        else:
            self.url = f"{urls['log' if system == 'gateway_log' else 'quiet']}/v1/embeddings"
            self.headers["Authorization"] = f"Bearer {key}"

    def body(self, text: str) -> bytes:
        if self.system == "direct":
            return orjson.dumps({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]})
        return orjson.dumps({"model": "text_embedding", "input": text, "encoding_format": self.encoding})

    async def send(self, text: str):
        """The answer's vector (floats, or an ndarray for base64); RuntimeError for another answer."""
        async with self.session.post(self.url, data=self.body(text), headers=self.headers) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
        doc = orjson.loads(raw)
        vec = doc["outputs"][0]["data"] if self.system == "direct" else doc["data"][0]["embedding"]
        if self.encoding == "base64":
            vec = np.frombuffer(base64.b64decode(vec), dtype="<f4")
        if len(vec) != DIMENSIONS:
            raise RuntimeError(f"a vector of {len(vec)} values, not {DIMENSIONS}")
        return vec


def unique_texts(sentences: Sequence[str]) -> Iterator[str]:
    """Each text once in the whole run (a counter in it): no cache answers any of them."""
    run = secrets.token_hex(3)
    for n in itertools.count():
        yield f"{sentences[n % len(sentences)]} ({run}-{n})"


async def check_same_vectors(clients: dict[str, EmbedClient], text: str) -> dict[str, float]:
    """Each system's cosine against direct's vector for one text: systems compared must agree first."""
    vecs = {name: np.asarray(await c.send(text), dtype=np.float64) for name, c in clients.items()}
    ref = vecs["direct"]
    return {name: float(v @ ref / (np.linalg.norm(v) * np.linalg.norm(ref))) for name, v in vecs.items()}


async def run_embeddings(args, direct_url: str, urls: dict[str, str], key: str, say) -> list[Cell]:
    """Interleaved closed-loop windows of every system, unique then repeated texts, per round."""
    import aiohttp

    sentences = workload.sentences()
    cells: dict[tuple[str, str], Cell] = {}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        clients = {s: EmbedClient(session, s, direct_url, urls, key) for s in args.embed_systems}
        cosines = await check_same_vectors(clients, sentences[0])
        say("  embeddings: cosine against direct's vector: " + ", ".join(f"{k} {v:.6f}" for k, v in cosines.items()))
        for name, cosine in cosines.items():
            if cosine < (PEER_COSINE if name in PEER_SYSTEMS else SAME_MODEL_COSINE):
                raise RuntimeError(f"{name} gives a different vector (cosine {cosine:.6f} against direct's)")
        for c in clients.values():  # warm-up: connections opened, the repeated texts cached
            await asyncio.gather(*(c.send(s) for s in sentences))
        texts = {"unique": unique_texts(sentences), "repeated": itertools.cycle(sentences)}
        for rnd in range(args.rounds):
            for w, name in enumerate(WORKLOADS):
                turn = (rnd * len(WORKLOADS) + w) % len(args.embed_systems)  # each system goes first in turn
                for system in args.embed_systems[turn:] + args.embed_systems[:turn]:
                    cell = cells.setdefault((name, system), Cell(system, name, args.embed_concurrency))
                    client, stream = clients[system], texts[name]
                    await window(cell, lambda n, c=client, s=stream: c.send(next(s)), args.embed_concurrency, args.embed_duration)
            rates = ", ".join(f"{w}/{s} {c.summary()['requests_per_s']}/s" for (w, s), c in cells.items())
            say(f"  embeddings round {rnd + 1}: {rates}")
    return list(cells.values())


# --------------------------------------------------------------------------- chat


async def run_chat(args, gateway_url: str, triton_grpc: str, key: str, say) -> list[Cell]:
    """Per round and concurrency, each system's window of ``--chat-requests`` streams per client,
    run to their end; client k starts k x --chat-stagger-ms after the first."""
    import aiohttp

    from clients.generation import AsyncGenerationClient

    prompts = workload.prompts()
    cells: dict[tuple[str, int], Cell] = {}
    direct_client = AsyncGenerationClient(triton_grpc, protocol="grpc", timeout_s=600)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        systems: dict[str, ChatSystem] = {"direct": DirectChat(direct_client), "gateway": GatewayChat(session, gateway_url, key)}
        try:
            for system in systems.values():  # warm-up: channels open, first-request costs out of the windows
                await system.stream(prompts[0], 4)
            order, turn = list(systems), 0
            for rnd in range(args.rounds):
                for c in args.chat_concurrency:
                    first = rnd * c * args.chat_requests  # each round its own prompts, the same for both systems
                    for name in order[turn % len(order) :] + order[: turn % len(order)]:
                        cell = cells.setdefault((name, c), Cell(name, "chat", c))

                        async def call(n: int, system=systems[name], cell=cell, c=c, first=first) -> None:
                            if n < c:
                                await asyncio.sleep(n * args.chat_stagger_ms / 1000)
                            ttft, tokens = await system.stream(prompts[(first + n) % len(prompts)], args.max_tokens)
                            cell.tokens.append(tokens)
                            if ttft is not None:
                                cell.ttft.append(ttft)

                        await window(cell, call, c, count=c * args.chat_requests)
                        s = cell.summary()
                        say(f"  chat round {rnd + 1} c{c} {name}: {s['tokens_per_s']} tokens/s, TTFT P50 {s['ttft_p50_ms']} ms")
                    turn += 1
        finally:
            await direct_client.close()
    return list(cells.values())
