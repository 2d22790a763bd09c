"""`python -m perf.bench.overhead frontdoor|retry|metrics`: what one layer on the request path costs.

- ``frontdoor``: the same load (text_embedding, one unique short text a request) through the front
  door (nginx + the njs check for HTTP JSON and binary; the gRPC door + nginx for gRPC) and straight
  to tritonserver's internal port, in alternating rounds: requests/s, P50, P99, max, and the ratios.
- ``retry``: the time ``Retrier.call`` / ``Retrier.acall`` (clients/resilience.py) add around a call
  that succeeds at once, in process, per call.
- ``metrics``: what the padding and batch metrics (python_backends/padding_metrics.py) cost the
  tokenizer: in process per batch size, then served, text_tokenizer as shipped against a copy with
  the parameter ``metrics`` false, one request at a time alternating (Triton's compute time per
  execution); ``--fill-rate`` adds the fill rates text_embedding shows under mixed lengths.
"""

from __future__ import annotations

import asyncio
import json
import queue
import random
import re
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from perf.lib import load, options, report, triton_stats
from perf.lib.deployment import server_deployment
from server.layout import ROOT

EMBEDDING, TOKENIZER = "text_embedding", "text_tokenizer"
METRICS_OFF = "text_tokenizer_metrics_off"
TEXT = "The quarterly report shows steady growth in the northern region"
PROTOCOLS = ("http json", "http binary", "grpc")


def frontdoor(concurrency: int, seconds: float, rounds: int) -> dict:
    """Each protocol through the front door and direct, alternating rounds; the door / direct ratios."""

    def drive(protocol: str, url: str):
        async def run(seconds: float) -> load.Tally:
            if protocol == "http json":

                def make(n: int) -> load.Request:
                    text = [f"front door cost {n}"]
                    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": text}]}
                    return json.dumps(body).encode(), {"Content-Type": "application/json"}

                return await load.closed_loop(f"http://{url}/v2/models/{EMBEDDING}/infer", make, concurrency, seconds)
            texts = lambda n: f"front door cost {n}"  # noqa: E731
            return await load.kserve_texts(protocol.split()[-1], url, EMBEDDING, texts, concurrency, seconds)

        return run

    with (
        tempfile.TemporaryDirectory(prefix="overhead-frontdoor-") as workdir,
        server_deployment((EMBEDDING,), Path(workdir), model_repository=ROOT / "model_repository") as server,
    ):
        http, grpc = (server.http_url, server.triton_http_url), (server.grpc_url, server.triton_grpc_url)
        urls = {"http json": http, "http binary": http, "grpc": grpc}
        runs = {f"{p} {path}": drive(p, url) for p in PROTOCOLS for path, url in zip(("front door", "direct"), urls[p])}
        results: dict = {key: tally.figures() for key, (tally, _) in load.alternate(runs, rounds, seconds).items()}
    rows = [
        (name, f"{r['rps']:.0f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}", r["errors"])
        for name, r in results.items()
    ]
    print(report.table([f"path (concurrency {concurrency})", "requests/s", "P50 ms", "P99 ms", "max ms", "errors"], rows))
    for p in PROTOCOLS:
        door, direct = results[f"{p} front door"], results[f"{p} direct"]
        results[f"{p} ratio"], results[f"{p} p99 ratio"] = door["rps"] / direct["rps"], door["p99_ms"] / direct["p99_ms"]
        print(f"{p}: front door / direct throughput = {results[f'{p} ratio']:.3f}, P99 = {results[f'{p} p99 ratio']:.2f}")
    return results


def retry(n: int = 200_000) -> dict:
    """Microseconds per call: direct, through Retrier.call, through Retrier.acall with and without
    its asyncio timeout (``cut``: HTTP attempts; gRPC's are bounded by gRPC's own deadline)."""
    from clients.resilience import EndpointPool, Retrier

    retrier = Retrier(EndpointPool(["a:1", "b:2"]))

    def fn(url, timeout_s):
        return url

    async def afn(url, timeout_s):
        return url

    def per_call(body, count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            body()
        return round((time.perf_counter() - start) / count * 1e6, 3)

    async def aper_call(wrap: bool, cut: bool = True) -> float:
        start = time.perf_counter()
        for _ in range(n // 10):
            await (retrier.acall(afn, 5.0, cut=cut) if wrap else afn("a:1", 5.0))
        return round((time.perf_counter() - start) / (n // 10) * 1e6, 3)

    out = {"sync_direct_us": per_call(lambda: fn("a:1", None), n), "sync_wrapped_us": per_call(lambda: retrier.call(fn, 5.0), n)}
    out |= {"async_direct_us": asyncio.run(aper_call(False)), "async_wrapped_us": asyncio.run(aper_call(True))}
    out["async_wrapped_nocut_us"] = asyncio.run(aper_call(True, cut=False))
    print(json.dumps(out, indent=2))
    return out


def metrics_in_process(batches=(1, 8, 32), repeats: int = 2000) -> dict:
    """Per execution of ``n`` one-text requests: the tokenizer call, and the counting and queueing
    ``PaddingMetrics.record`` does on the execution's path (best of three, us)."""
    from export.reference import model_dir
    from python_backends.padding_metrics import batches_counts
    from python_backends.text.tokenization import BatchTokenizer

    tok = BatchTokenizer(model_dir() / "tokenizer.json", max_length=256)
    out: dict[str, Any] = {}
    for n in batches:
        texts, spans = [f"{TEXT} {i}" for i in range(n)], [(i, i + 1) for i in range(n)]
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


def metrics_served(requests: int, rounds: int) -> dict:
    """text_tokenizer with its metrics and a copy without, one server, one request at a time in turn
    (``requests`` each per round after 50 unmeasured): Triton's compute us per execution, client P50/P99."""
    import tritonclient.grpc as grpcclient

    with tempfile.TemporaryDirectory(prefix="overhead-metrics-") as scratch:
        tmp = Path(scratch)
        repo, source = tmp / "model_repository", ROOT / "model_repository" / TOKENIZER
        for name in (TOKENIZER, METRICS_OFF):
            shutil.copytree(source, repo / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        config = (repo / METRICS_OFF / "config.pbtxt").read_text().replace(f'name: "{TOKENIZER}"', f'name: "{METRICS_OFF}"')
        config += '\nparameters { key: "metrics" value: { string_value: "false" } }\n'
        (repo / METRICS_OFF / "config.pbtxt").write_text(config)
        models = {"metrics on": TOKENIZER, "metrics off": METRICS_OFF}
        latencies: dict[str, list[float]] = {label: [] for label in models}
        per_round = []
        with server_deployment((TOKENIZER, METRICS_OFF), tmp / "work", model_repository=repo, front_door=False) as server:
            client = grpcclient.InferenceServerClient(server.grpc_url)

            def send(label: str) -> float:
                inp = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
                inp.set_data_from_numpy(np.array([[f"{TEXT} {uuid.uuid4().hex[:8]}".encode()]], dtype=object))
                start = time.perf_counter()
                client.infer(models[label], [inp])
                return time.perf_counter() - start

            def compute_us(label: str) -> tuple[int, float]:
                s = client.get_inference_statistics(models[label], as_json=True)["model_stats"][0]
                return int(s["execution_count"]), int(s["inference_stats"]["compute_infer"]["ns"]) / 1e3

            for label in models:
                for _ in range(50):
                    send(label)
            for _ in range(rounds):
                before = {label: compute_us(label) for label in models}
                for i in range(requests):
                    for label in list(models) if i % 2 else list(models)[::-1]:
                        latencies[label].append(send(label))
                after = {label: compute_us(label) for label in models}
                per_round.append({k: (after[k][1] - before[k][1]) / (after[k][0] - before[k][0]) for k in models})
            client.close()
    out: dict[str, Any] = {}
    for label, lat in latencies.items():
        figures = load.latency_ms(lat)
        out[label] = {"compute_us_per_execution": [round(r[label], 1) for r in per_round]}
        out[label] |= {k: round(figures[k] or 0, 3) for k in ("p50_ms", "p99_ms")}
    on, off = (statistics.median(r[label] for r in per_round) for label in models)
    return out | {"added_us_per_execution": round(on - off, 1), "ratio_on_off": round(on / off, 3)}


def fill_rates(requests: int, concurrency: int = 8, seed: int = 7) -> dict:
    """text_embedding under mixed lengths (unique texts of 3-100 words over HTTP): the fill rate of the
    tokenizer's tensors and of the encoder's runs, and requests per tokenizer execution (metric deltas)."""
    from python_backends.padding_metrics import BATCH_SIZE, PADDED_TOKENS, REAL_TOKENS

    words = TEXT.lower().split() + "and then the market in spring was quiet again for most traders".split()
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 100))) + f" {i}" for i in range(requests)]

    def scrape(url: str) -> dict:
        out: dict = {}
        for key, value in triton_stats.metrics(url).items():
            name, model = key.partition("{")[0], re.search(r'model="([^"]+)"', key)
            if model and name in (REAL_TOKENS, PADDED_TOKENS, f"{BATCH_SIZE}_count", f"{BATCH_SIZE}_sum"):
                out[(name, model.group(1))] = out.get((name, model.group(1)), 0.0) + value
        return out

    with (
        tempfile.TemporaryDirectory(prefix="overhead-fill-rate-") as tmp,
        server_deployment((EMBEDDING,), Path(tmp), front_door=False) as server,
    ):
        before = scrape(server.metrics_url)
        tally = asyncio.run(load.kserve_texts("http", server.http_url, EMBEDDING, texts.__getitem__, concurrency, count=requests))
        time.sleep(0.5)  # the reporter threads
        after = scrape(server.metrics_url)
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    out: dict[str, Any] = {"requests": requests, "errors": tally.errors, "requests_per_s": round(requests / tally.seconds, 1)}
    for model in (TOKENIZER, "text_encoder"):
        real, padded = delta.get((REAL_TOKENS, model), 0.0), delta.get((PADDED_TOKENS, model), 0.0)
        out[model] = {
            "real_tokens": int(real),
            "padded_tokens": int(padded),
            "fill_rate": round(real / padded, 3) if padded else None,
        }
    executions = delta.get((f"{BATCH_SIZE}_count", TOKENIZER), 0.0)
    out[TOKENIZER]["executions"] = int(executions)
    per_execution = delta.get((f"{BATCH_SIZE}_sum", TOKENIZER), 0.0) / executions if executions else None
    out[TOKENIZER]["requests_per_execution"] = None if per_execution is None else round(per_execution, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = options.parser("perf.bench.overhead", __doc__)
    p.add_argument("layer", choices=("frontdoor", "retry", "metrics"))
    p.add_argument("--concurrency", type=int, default=16, help="frontdoor: requests in flight (default %(default)s)")
    p.add_argument("--seconds", type=float, default=4.0, help="frontdoor: per path and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=600, help="metrics: requests per model and round")
    p.add_argument("--fill-rate", action="store_true", help="metrics: also text_embedding's fill rates under mixed lengths")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    result: dict[str, Any]
    if args.layer == "frontdoor":
        result = frontdoor(args.concurrency, args.seconds, args.rounds)
    elif args.layer == "retry":
        result = retry()
    else:
        result = {"in_process": metrics_in_process(), "served": metrics_served(args.requests, args.rounds)}
        if args.fill_rate:
            result["fill_rate"] = fill_rates(4 * args.requests)
        print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
