"""What the padding and batch-size metrics cost the tokenizer (python_backends/padding_metrics.py).

    python -m perf.bench.metrics_cost [--requests 600] [--rounds 3] [--summaries] [--fill-rate]

1. In process, no server: one execution's tokenizer call (``BatchTokenizer.encode_requests``)
   against what the metrics add to it (``batches_counts`` and the queueing of
   ``PaddingMetrics.record``), per batch size, microseconds.
2. One tritonserver serving text_tokenizer twice, side by side: as shipped (metrics on: the
   execution queues its figures; a reporter thread makes the counter increments and the
   histogram observe, each an IPC round trip from the stub) and a copy with the config
   parameter ``metrics`` false. Requests alternate
   between the two, one at a time (one request per execution), unique texts; the figure is
   Triton's own compute time per execution (statistics: compute_infer / executions) and the
   client's P50 / P99, per model, over ``--rounds`` rounds.
3. With ``--summaries``: the launcher's ``--metrics-config=summary_latencies=true`` (the
   quantiles the P99 alerts read) against a second server without it, side by side.
4. With ``--fill-rate``: what the new metrics show for text_embedding under mixed lengths
   (4 x ``--requests`` unique texts of 3-100 words, 8 in flight): the tokenizer's and the
   encoder's fill rates and the requests per tokenizer execution.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from export.reference import model_dir
from perf.lib import load, triton_stats
from python_backends.padding_metrics import batches_counts
from python_backends.text.tokenization import BatchTokenizer
from server.layout import ROOT

MODEL = "text_tokenizer"
OFF = "text_tokenizer_metrics_off"
TEXT = "The quarterly report shows steady growth in the northern region"


def in_process(batches=(1, 8, 32), repeats: int = 2000) -> dict:
    """Per execution of ``n`` one-text requests: the tokenizer call, the counting and the
    queueing ``PaddingMetrics.record`` does on the execution's path (best of three, us)."""
    import queue

    tok = BatchTokenizer(model_dir() / "tokenizer.json", max_length=256)
    out: dict[str, Any] = {}
    for n in batches:
        texts = [f"{TEXT} {i}" for i in range(n)]
        spans = [(i, i + 1) for i in range(n)]
        encoded = tok.encode_requests(texts, spans)
        q: queue.SimpleQueue = queue.SimpleQueue()
        best: dict[str, list[float]] = {"tokenize_us": [], "count_and_queue_us": []}
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(repeats):
                tok.encode_requests(texts, spans)
            best["tokenize_us"].append((time.perf_counter() - start) / repeats * 1e6)
            start = time.perf_counter()
            for _ in range(repeats * 10):
                q.put((*batches_counts(encoded), n))
            best["count_and_queue_us"].append((time.perf_counter() - start) / (repeats * 10) * 1e6)
        out[n] = {key: round(min(values), 2) for key, values in best.items()}
        out[n]["share"] = round(out[n]["count_and_queue_us"] / out[n]["tokenize_us"], 4)
    return out


def make_repository(root: Path) -> Path:
    repo = root / "model_repository"
    source = ROOT / "model_repository" / MODEL
    shutil.copytree(source, repo / MODEL, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    off = repo / OFF
    shutil.copytree(source, off, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    config = (off / "config.pbtxt").read_text().replace(f'name: "{MODEL}"', f'name: "{OFF}"')
    config += '\nparameters { key: "metrics" value: { string_value: "false" } }\n'
    (off / "config.pbtxt").write_text(config)
    return repo


def alternate(targets: dict[str, tuple], requests: int, rounds: int, server_us: Callable[[str], tuple[int, float]]) -> dict:
    """One text per request to each target (label -> (tritonclient gRPC client, model)) in turn, one at
    a time, ``requests`` each per round after 50 unmeasured; per target the server's microseconds per
    count in each round (``server_us(label)``: a cumulative (count, microseconds)) and the client's P50 / P99."""
    import tritonclient.grpc as grpcclient

    def send(label: str) -> float:
        client, model = targets[label]
        inp = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[f"{TEXT} {uuid.uuid4().hex[:8]}".encode()]], dtype=object))
        start = time.perf_counter()
        client.infer(model, [inp])
        return time.perf_counter() - start

    for label in targets:
        for _ in range(50):
            send(label)
    latencies: dict[str, list[float]] = {label: [] for label in targets}
    per_round = []
    for _ in range(rounds):
        before = {label: server_us(label) for label in targets}
        for i in range(requests):
            for label in list(targets) if i % 2 else list(targets)[::-1]:
                latencies[label].append(send(label))
        after = {label: server_us(label) for label in targets}
        per_round.append({k: (after[k][1] - before[k][1]) / (after[k][0] - before[k][0]) for k in targets})
    out: dict[str, Any] = {"per_round": per_round}
    for label, lat in latencies.items():
        figures = load.latency_ms(lat)
        out[label] = {"us": [round(r[label], 1) for r in per_round]}
        out[label] |= {k: round(figures[k] or 0, 3) for k in ("p50_ms", "p99_ms")}
    return out


def served(requests: int, rounds: int) -> dict:
    """text_tokenizer with its metrics (MODEL) and without (OFF) on one server: Triton's compute time per execution."""
    import tritonclient.grpc as grpcclient

    from perf.lib.deployment import server_deployment

    tmp = Path(tempfile.mkdtemp(prefix="metrics-cost-"))
    server = server_deployment((MODEL, OFF), tmp / "work", model_repository=make_repository(tmp), front_door=False)
    server.start()
    try:
        server.wait_ready(timeout=120)
        client = grpcclient.InferenceServerClient(server.grpc_url)

        def compute_us(label: str) -> tuple[int, float]:
            s = client.get_inference_statistics(targets[label][1], as_json=True)["model_stats"][0]
            return int(s["execution_count"]), int(s["inference_stats"]["compute_infer"]["ns"]) / 1e3

        targets = {"metrics on": (client, MODEL), "metrics off": (client, OFF)}
        out = alternate(targets, requests, rounds, compute_us)
        client.close()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for label in targets:
        out[label]["compute_us_per_execution"] = out[label].pop("us")
    per_round = out.pop("per_round")
    on, off = (statistics.median(r[label] for r in per_round) for label in targets)
    return out | {"added_us_per_execution": round(on - off, 1), "ratio_on_off": round(on / off, 3)}


def summaries(requests: int, rounds: int) -> dict:
    """Two servers of text_tokenizer at once, with the launcher's --metrics-config=summary_latencies=true
    and without it (ServerOptions.summary_latencies); requests alternate between them, one at a time. Triton's
    mean request time (nv_inference_request_duration_us / requests) and the client's P50 / P99."""
    import tritonclient.grpc as grpcclient

    from perf.lib.deployment import server_deployment

    tmp = Path(tempfile.mkdtemp(prefix="summary-cost-"))
    servers = {}
    try:
        for label, summarised in (("summaries on", True), ("summaries off", False)):
            servers[label] = server_deployment(
                (MODEL,), tmp / label.replace(" ", "-"), front_door=False, summary_latencies=summarised
            )
            servers[label].start()
        for server in servers.values():
            server.wait_ready(timeout=120)
        targets = {label: (grpcclient.InferenceServerClient(server.grpc_url), MODEL) for label, server in servers.items()}

        def request_us(label: str) -> tuple[int, float]:
            s = targets[label][0].get_inference_statistics(MODEL, as_json=True)["model_stats"][0]["inference_stats"]
            return int(s["success"]["count"]), int(s["success"]["ns"]) / 1e3

        exposes = {
            label: any(k.startswith("nv_inference_queue_summary_us_count{") for k in triton_stats.metrics(server.metrics_url))
            for label, server in servers.items()
        }
        out = alternate(targets, requests, rounds, request_us)
        for client, _ in targets.values():
            client.close()
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for label in servers:
        out[label] = {"exposes_queue_summary": exposes[label], "request_us": out[label].pop("us"), **out[label]}
    per_round = out.pop("per_round")
    on, off = (statistics.median(r[label] for r in per_round) for label in servers)
    return out | {"added_us_per_request": round(on - off, 1)}


def fill_rates(requests: int, concurrency: int, seed: int = 7) -> dict:
    """text_embedding under mixed lengths (unique texts of 3-100 words, ``concurrency`` in
    flight over HTTP, tritonclient's asyncio client): the fill rate of the tokenizer's tensors and of the encoder's runs, and
    the requests per tokenizer execution, from the metrics port (deltas over the run)."""
    import random

    from perf.lib.deployment import server_deployment
    from python_backends.padding_metrics import BATCH_SIZE, PADDED_TOKENS, REAL_TOKENS

    words = TEXT.lower().split() + "and then the market in spring was quiet again for most traders".split()
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="fill-rate-"))
    server = server_deployment(("text_embedding",), tmp, front_door=False)
    server.start()

    def scrape() -> dict:
        out: dict = {}
        for key, value in triton_stats.metrics(server.metrics_url).items():
            name, model = key.partition("{")[0], re.search(r'model="([^"]+)"', key)
            if model and name in (REAL_TOKENS, PADDED_TOKENS, f"{BATCH_SIZE}_count", f"{BATCH_SIZE}_sum"):
                out[(name, model.group(1))] = out.get((name, model.group(1)), 0.0) + value
        return out

    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 100))) + f" {i}" for i in range(requests)]
    try:
        server.wait_ready(timeout=180)
        before = scrape()
        tally = asyncio.run(
            load.kserve_texts("http", server.http_url, "text_embedding", texts.__getitem__, concurrency, count=requests)
        )
        time.sleep(0.5)  # the reporter threads
        after = scrape()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    out: dict[str, Any] = {"requests": requests, "errors": tally.errors, "requests_per_s": round(requests / tally.seconds, 1)}
    for model in ("text_tokenizer", "text_encoder"):
        real, padded = delta.get((REAL_TOKENS, model), 0.0), delta.get((PADDED_TOKENS, model), 0.0)
        out[model] = {
            "real_tokens": int(real),
            "padded_tokens": int(padded),
            "fill_rate": round(real / padded, 3) if padded else None,
        }
    executions = delta.get((f"{BATCH_SIZE}_count", "text_tokenizer"), 0.0)
    out["text_tokenizer"]["executions"] = int(executions)
    out["text_tokenizer"]["requests_per_execution"] = (
        round(delta.get((f"{BATCH_SIZE}_sum", "text_tokenizer"), 0.0) / executions, 2) if executions else None
    )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=600, help="requests per model and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-server", action="store_true", help="the in-process part only")
    p.add_argument(
        "--fill-rate", action="store_true", help="also the fill rates of text_embedding under mixed lengths (one server)"
    )
    p.add_argument(
        "--summaries", action="store_true", help="also what the launcher's queue/request time summaries cost (two servers)"
    )
    args = p.parse_args(argv)
    result = {"in_process": in_process()}
    if not args.no_server:
        result["served"] = served(args.requests, args.rounds)
    if args.summaries:
        result["summaries"] = summaries(args.requests, args.rounds)
    if args.fill_rate:
        result["fill_rate"] = fill_rates(4 * args.requests, 8)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
