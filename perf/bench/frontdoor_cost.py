"""What the front door costs: the same load through the front door (nginx + the njs check for
HTTP JSON and binary; the gRPC door + nginx for gRPC) and straight to tritonserver's internal
port, side by side on one server (text_embedding).

    python -m perf.bench.frontdoor_cost [--concurrency 16] [--seconds 4] [--rounds 3]

Rounds alternate between the two paths so that a neighbour's burst hits both; each request is
one short text, unique (no response cache in text_embedding's path hides the cost). Prints a
table (requests/s, P50, P99, max) and the throughput ratio per protocol; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from perf.lib import load, report

MODEL = "text_embedding"
PROTOCOLS = ("http json", "http binary", "grpc")


def drive(protocol: str, url: str, concurrency: int):
    """The load of one protocol at ``url``: a function of the seconds it runs."""

    async def run(seconds: float) -> load.Tally:
        if protocol == "http json":

            def make(n: int) -> load.Request:
                body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [f"front door cost {n}"]}]}
                return json.dumps(body).encode(), {"Content-Type": "application/json"}

            return await load.closed_loop(f"http://{url}/v2/models/{MODEL}/infer", make, concurrency, seconds)
        return await load.kserve_texts(protocol.split()[-1], url, MODEL, lambda n: f"front door cost {n}", concurrency, seconds)

    return run


def measure(server, concurrency: int, seconds: float, rounds: int) -> dict:
    urls = {"http json": (server.http_url, server.triton_http_url), "http binary": (server.http_url, server.triton_http_url)}
    urls["grpc"] = (server.grpc_url, server.triton_grpc_url)
    runs = {f"{p} {path}": drive(p, url, concurrency) for p in PROTOCOLS for path, url in zip(("front door", "direct"), urls[p])}
    results: dict = {key: tally.figures() for key, (tally, _) in load.alternate(runs, rounds, seconds).items()}
    for p in PROTOCOLS:
        door, direct = results[f"{p} front door"], results[f"{p} direct"]
        results[f"{p} ratio"] = door["rps"] / direct["rps"]
        results[f"{p} p99 ratio"] = door["p99_ms"] / direct["p99_ms"]
    return results


def table(results: dict, concurrency: int) -> str:
    rows = [
        (name, f"{r['rps']:.0f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}", r["errors"])
        for name, r in results.items()
        if isinstance(r, dict)
    ]
    lines = [report.table([f"path (concurrency {concurrency})", "requests/s", "P50 ms", "P99 ms", "max ms", "errors"], rows), ""]
    for p in PROTOCOLS:
        lines.append(f"{p}: front door / direct throughput = {results[f'{p} ratio']:.3f}, P99 = {results[f'{p} p99 ratio']:.2f}")
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
        results = measure(server, args.concurrency, args.seconds, args.rounds)
    print(table(results, args.concurrency))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
