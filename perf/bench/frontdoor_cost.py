"""What the front door costs: the same load through the front door (nginx + the njs check for
HTTP JSON and binary; the gRPC door + nginx for gRPC) and straight to tritonserver's internal
port, side by side on one server (text_embedding).

    python -m perf.bench.frontdoor_cost [--concurrency 16] [--seconds 4] [--rounds 3]

Rounds alternate between the two paths so that a neighbour's burst hits both; each request is
one short text. Prints a table (requests/s, P50, P99, max) and the throughput ratio per protocol;
``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from perf.lib.stats import percentile_of

MODEL = "text_embedding"
# HTTP JSON and binary go through nginx + the njs check; gRPC through the gRPC door
# (server/grpc_door.py) and nginx's internal gRPC listener.
PROTOCOLS = ("http json", "http binary", "grpc")


async def _drive_json(url: str, concurrency: int, seconds: float) -> list[float]:
    """KServe v2 JSON bodies over aiohttp keep-alive connections."""
    import aiohttp

    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker(w: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [f"front door cost {w} {n}"]}]}
                started = time.perf_counter()
                async with session.post(f"http://{url}/v2/models/{MODEL}/infer", json=body) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}")
                latencies.append(time.perf_counter() - started)
                n += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return latencies


async def _drive(protocol: str, url: str, concurrency: int, seconds: float) -> list[float]:
    if protocol == "http json":
        return await _drive_json(url, concurrency, seconds)
    if protocol == "http binary":
        import tritonclient.http.aio as client_mod
    else:
        import tritonclient.grpc.aio as client_mod
    return await tritonclient_load(client_mod, url, concurrency, seconds, "front door cost")


async def tritonclient_load(
    client_mod, url: str, concurrency: int, seconds: float, prefix: str, output: str | None = None
) -> list[float]:
    """``concurrency`` workers sending MODEL one text each through tritonclient's asyncio module
    ``client_mod`` for ``seconds`` (reading ``output`` of each answer when named); the latencies.
    perf.bench.client_retry_cost's raw path too."""
    client = client_mod.InferenceServerClient(url)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            tensor = client_mod.InferInput("TEXT", [1, 1], "BYTES")
            # A distinct text per request: no response cache in text_embedding's path hides the cost.
            tensor.set_data_from_numpy(np.array([[f"{prefix} {w} {n}".encode()]], dtype=object))
            started = time.perf_counter()
            result = await client.infer(MODEL, [tensor])
            if output is not None:
                result.as_numpy(output)
            latencies.append(time.perf_counter() - started)
            n += 1

    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        await client.close()
    return latencies


def latency_ms(latencies: list[float]) -> dict:
    """P50, P99 and max of ``latencies`` (seconds), in ms (perf.bench.client_retry_cost's too)."""
    ms = np.array(latencies) * 1000.0
    return {
        "p50_ms": float(percentile_of(list(ms), 50)),
        "p99_ms": float(percentile_of(list(ms), 99)),
        "max_ms": float(ms.max()),
    }


def summarize(latencies: list[float], seconds: float) -> dict:
    return {"requests": len(latencies), "rps": len(latencies) / seconds, **latency_ms(latencies)}


def measure(server, concurrency: int, seconds: float, rounds: int) -> dict:
    targets = {
        ("http json", "front door"): server.http_url,
        ("http json", "direct"): server.triton_http_url,
        ("http binary", "front door"): server.http_url,
        ("http binary", "direct"): server.triton_http_url,
        ("grpc", "front door"): server.grpc_url,
        ("grpc", "direct"): server.triton_grpc_url,
    }
    collected: dict = {key: [] for key in targets}
    for key, url in targets.items():  # warm both paths (connections, first batches)
        asyncio.run(_drive(key[0], url, concurrency, 1.0))
    for r in range(rounds):
        order = list(targets) if r % 2 == 0 else list(reversed(list(targets)))
        for key in order:
            collected[key] += asyncio.run(_drive(key[0], targets[key], concurrency, seconds))
    results = {f"{p} {path}": summarize(lat, seconds * rounds) for (p, path), lat in collected.items()}
    for protocol in PROTOCOLS:
        results[f"{protocol} ratio"] = results[f"{protocol} front door"]["rps"] / results[f"{protocol} direct"]["rps"]
        results[f"{protocol} p99 ratio"] = results[f"{protocol} front door"]["p99_ms"] / results[f"{protocol} direct"]["p99_ms"]
    return results


def table(results: dict, concurrency: int) -> str:
    lines = [
        f"| path (concurrency {concurrency}) | requests/s | P50 ms | P99 ms | max ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, row in results.items():
        if isinstance(row, dict):
            lines.append(f"| {name} | {row['rps']:.0f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['max_ms']:.1f} |")
    lines.append("")
    for protocol in PROTOCOLS:
        lines.append(
            f"{protocol}: front door / direct throughput = {results[f'{protocol} ratio']:.3f}, "
            f"P99 = {results[f'{protocol} p99 ratio']:.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.frontdoor_cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=4.0, help="per path and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)

    from perf.lib.deployment import server_deployment
    from server.layout import ROOT

    workdir = Path(tempfile.mkdtemp(prefix="frontdoor-cost-"))
    with server_deployment((MODEL,), workdir, model_repository=ROOT / "model_repository") as server:
        results = measure(server.triton, args.concurrency, args.seconds, args.rounds)
    print(table(results, args.concurrency))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
