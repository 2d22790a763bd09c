"""`python -m perf.bench.gateway_bench` (`make perf-gateway`): the OpenAI gateway's embeddings against
Triton direct and infinity-emb, side by side (its chat streams: perf.bench.generate_bench's ``gateway``).

One tritonserver (text_embedding_cached, text_embedding; front door on), two gateways on its gRPC
port (request log off and on) and infinity-emb (perf/baselines/infinity.py, on the INT8 file optimum
quantizes for this CPU, and FP32); the systems' windows take turns. Closed loop, one text a request,
every answer checked: ``direct`` (KServe infer of text_embedding_cached), ``gateway`` (float),
``gateway_b64``, ``gateway_log``, ``infinity``, ``infinity_fp32``; texts ``unique`` (misses) and
``repeated`` (sentences_16tok.json, hits).

Ratios against the issue's targets (gateway/direct throughput >= 0.8 and P99 <= 1.3x; >= 3x
infinity's throughput at <= 1/4 of its P99). Writes summary.md, results.json (with the client's CPU
per request) and the logs to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from perf.lib import lifecycle, options, report, workload
from perf.lib.deployment import start_gateways
from perf.lib.load import Tally, call_loop, latency_ms
from perf.lib.paths import REPOSITORY

# The targets, checked (not enforced) in the printed ratios.
TARGET_EMBED = (0.8, 1.3)  # gateway / direct requests/s at concurrency 32, at least; P99, at most
TARGET_VS_PEER = (3.0, 0.25)  # direct or gateway / infinity-emb, unique texts: requests/s at least; P99 at most

DIRECT_EMBED_MODEL = "text_embedding_cached"
DIMENSIONS = 384
EMBED_SYSTEMS = ("direct", "gateway", "gateway_b64", "gateway_log", "infinity", "infinity_fp32")
PEER_SYSTEMS = ("infinity", "infinity_fp32")
WORKLOADS = ("unique", "repeated")
SAME_MODEL_COSINE = 0.9999  # the project's systems: one served model
PEER_COSINE = 0.98  # infinity-emb's INT8 file (optimum's dynamic quantization) against the served INT8 model


@dataclass
class Cell:
    """One system under one workload (unique, repeated) and concurrency: its windows, pooled."""

    system: str
    workload: str
    concurrency: int
    tally: Tally = field(default_factory=Tally)
    client_cpu_s: float = 0.0
    windows: int = 0

    def add(self, tally: Tally, cpu_s: float) -> None:
        self.tally.merge(tally)
        self.client_cpu_s += cpu_s
        self.windows += 1

    def summary(self) -> dict[str, object]:
        t, n = self.tally, len(self.tally.ok)
        out: dict[str, object] = {"system": self.system, "workload": self.workload, "concurrency": self.concurrency}
        out |= {"windows": self.windows, "seconds": round(t.seconds, 2), "requests": n, "errors": t.errors}
        out["first_error"] = t.first_error[:300]
        out |= {k: None if v is None else round(v, 2) for k, v in latency_ms(t.ok).items()}
        out["requests_per_s"] = round(n / t.seconds, 1) if n and t.seconds else None
        out["client_cpu_per_request_ms"] = round(1000 * self.client_cpu_s / n, 3) if n else None
        return out


async def window(cell: Cell, call, concurrency: int, seconds: float) -> None:
    """One window of the shared loop into ``cell``, with the client's CPU time."""
    cpu0 = time.process_time()
    tally = await call_loop(call, concurrency, seconds)
    cell.add(tally, time.process_time() - cpu0)


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


# --------------------------------------------------------------------------- the run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = options.parser("perf.bench.gateway_bench", __doc__)
    p.add_argument("--rounds", type=int, default=3, help="rounds of interleaved windows (default 3)")
    p.add_argument("--embed-concurrency", type=int, default=32, help="embedding clients (default 32)")
    p.add_argument("--embed-duration", type=float, default=4.0, help="seconds per embeddings window (default 4)")
    p.add_argument(
        "--embed-systems", type=options.choices(EMBED_SYSTEMS), default=list(EMBED_SYSTEMS), help=",".join(EMBED_SYSTEMS)
    )
    p.add_argument("--precision", default=os.environ.get("PRECISION", "auto"), help="as `make serve PRECISION=` (default auto)")
    p.add_argument("--out", type=Path, help="results folder (default perf/results/gateway-<UTC time>)")
    args = options.finish(p, p.parse_args(argv), argv)
    if min(args.rounds, args.embed_concurrency, args.embed_duration) <= 0:
        p.error("--rounds, --embed-concurrency and --embed-duration must be positive")
    if "direct" not in args.embed_systems:
        args.embed_systems.insert(0, "direct")  # the reference every ratio is taken against
    return args


def start_triton(args, workdir: Path, say):
    """tritonserver with the models and the precision variant asked for, started."""
    from export import variants
    from perf.lib.deployment import server_deployment

    models = ("text_embedding_cached", "text_embedding")
    local = tuple(v for v in variants.VARIANTS if v != "trt_plan")  # what this server can load, as the launcher's
    config_name, served = variants.resolve_precision(REPOSITORY, ["text_encoder", *models], args.precision, loadable=local)
    server = server_deployment(models, workdir / "triton", model_config_name=config_name).start()
    say(
        f"tritonserver starting ({', '.join(models)}; PRECISION={args.precision}: {served['text_encoder']}): http {server.http_url}"
    )
    return server


def start_peers(args, workdir: Path, say) -> dict:
    """infinity-emb's servers the embeddings ask for; one that cannot run here is dropped, with the reason."""
    from perf.baselines.infinity import InfinityError, InfinityServer
    from server.process import free_port

    peers: dict = {}
    for system in [s for s in PEER_SYSTEMS if s in args.embed_systems]:
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
    out, say, load = report.results_dir(args.out, "gateway"), report.progress(), report.load_average()
    say(f"perf.bench.gateway_bench: {args.rounds} round(s), load average {load}")
    key = "sk-bench-" + secrets.token_hex(16)
    workdir = Path(tempfile.mkdtemp(prefix="perf-gateway-"))
    server = None
    gateways: dict = {}
    peers: dict = {}
    embed_cells: list[Cell] = []
    failure = ""
    try:
        server = start_triton(args, workdir, say)
        server.wait_ready(timeout=300)
        wanted = {"quiet": ["--no-request-log"]} | ({"log": []} if "gateway_log" in args.embed_systems else {})
        start_gateways({name: (server.triton_grpc_url, extra) for name, extra in wanted.items()}, workdir, key, say, gateways)
        peers = start_peers(args, workdir, say)
        urls = {name: gw.url for name, gw in gateways.items()} | {name: peer.url for name, peer in peers.items()}
        embed_cells = asyncio.run(run_embeddings(args, server.http_url, urls, key, say))
    except Exception as exc:  # noqa: BLE001 - reported, with what was measured so far
        failure = f"{type(exc).__name__}: {exc}"
        say(f"perf.bench.gateway_bench stopped: {failure}")
    finally:
        lifecycle.stop(peers, out, "peer")
        lifecycle.stop(gateways, out, "gateway")
        if server is not None:
            server.stop(logs_to=out)
        shutil.rmtree(workdir, ignore_errors=True)

    embed = [c.summary() for c in sorted(embed_cells, key=lambda c: (WORKLOADS.index(c.workload), EMBED_SYSTEMS.index(c.system)))]
    ratio_rows = ratios(embed, args.embed_concurrency)
    lines = report.header("OpenAI gateway vs Triton direct", "perf.bench.gateway_bench", args.argv, load)
    lines.append(
        f"- embeddings: {args.embed_concurrency} closed-loop clients, one text per request, {args.embed_duration:g} s "
        f"windows x {args.rounds} round(s), systems interleaved (what each system is: --help)"
    )
    if failure:
        lines.append(f"- stopped early: {failure}")
    command = ["python", "-m", "perf.bench.gateway_bench", *args.argv]
    data = {"command": command, "load_average_before": load, "cpus": os.cpu_count(), "embeddings": embed}
    report.write(out, markdown(lines, embed, ratio_rows), data | {"ratios": ratio_rows, "error": failure}, say=say)
    return 0 if not failure and len(embed) == len(WORKLOADS) * len(args.embed_systems) else 1


def ratios(embed: Sequence[dict], concurrency: int) -> list[dict[str, object]]:
    """The gateway's and the peers' ratios; the embeddings targets are written for 32 clients and checked there only."""
    by = {(s["workload"], s["system"]): s for s in embed}
    pairs = [(w, s, "direct", TARGET_EMBED) for w in WORKLOADS for s in EMBED_SYSTEMS[1:] if s not in PEER_SYSTEMS]
    pairs += [("unique", s, peer, TARGET_VS_PEER) for peer in PEER_SYSTEMS for s in ("direct", "gateway")]
    rows = []
    for texts, ours, ref, (rps, p99) in pairs:
        if (a := by.get((texts, ours))) and (b := by.get((texts, ref))):
            name, checked = f"embeddings {texts}, {ours} / {ref}", concurrency == 32
            rps_row = report.ratio(
                f"{name} throughput, c{concurrency}", a["requests_per_s"], b["requests_per_s"], rps if checked else None
            )
            rows += [
                rps_row,
                report.ratio(f"{name} P99, c{concurrency}", a["p99_ms"], b["p99_ms"], p99 if checked else None, False),
            ]
    return rows


def cells(s: dict, *keys: str) -> list[str]:
    """A table row: each key's value, a figure with the decimals after a colon (``p50_ms:2``)."""
    out = []
    for key in keys:
        name, _, digits = key.partition(":")
        out.append(report.fmt(s[name], int(digits), thousands=True) if digits else str(s[name]))
    return out + [f"{s['errors']}: {s['first_error'][:80]}" if s["errors"] else "0"]


def markdown(lines: Sequence[str], embed: Sequence[dict], ratio_rows: Sequence[dict]) -> str:
    parts = ["\n".join(lines)]
    if embed:
        columns = ["embeddings", "workload", "concurrency", "requests/s", "P50 ms", "P99 ms", "max ms", "requests"]
        keys = ["system", "workload", "concurrency", "requests_per_s:1", "p50_ms:2", "p99_ms:2", "max_ms:2", "requests"]
        rows = [cells(s, *keys, "client_cpu_per_request_ms:3") for s in embed]
        parts.append(report.table([*columns, "client CPU ms/request", "errors"], rows, left=2))
    if ratio_rows:
        parts.append(report.ratio_table(ratio_rows))
    return "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
