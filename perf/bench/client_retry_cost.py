"""What the clients' retry wrapper costs on the happy path (clients/resilience.py).

    python -m perf.bench.client_retry_cost [--concurrency 8] [--seconds 4] [--rounds 3]

Two measurements:

1. In process, no server: the time ``Retrier.call`` / ``Retrier.acall`` adds around a call
   that succeeds at once (a no-op function), per call, against calling the function directly.
2. Against one tritonserver (text_embedding only, through its front door), HTTP and gRPC: the
   asyncio load of one short text per call at ``--concurrency``, side by side in alternating
   rounds, through plain tritonclient, through ``AsyncEmbeddingClient`` with its request made
   directly (the client's code without the wrapper) and through ``AsyncEmbeddingClient`` as
   shipped (retry policy, breaker and pool on every call). Prints calls/s, P50, P99, max and
   the ratio of the last two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Literal

from clients import AsyncEmbeddingClient
from clients.embeddings import build_request, read_embeddings
from clients.resilience import EndpointPool, Retrier
from perf.lib import load, report

MODEL = "text_embedding"
PATHS = ("raw tritonclient", "client, no wrapper", "client (retry wrapper)")


def in_process(n: int = 200_000) -> dict:
    """Microseconds per call: direct, through Retrier.call and through Retrier.acall."""
    retrier = Retrier(EndpointPool(["a:1", "b:2"]))

    def fn(url, timeout_s):
        return url

    start = time.perf_counter()
    for _ in range(n):
        fn("a:1", None)
    direct = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n):
        retrier.call(fn, 5.0)
    wrapped = time.perf_counter() - start

    async def afn(url, timeout_s):
        return url

    async def arun(wrap: bool, cut: bool = True) -> float:
        begin = time.perf_counter()
        for _ in range(n // 10):
            if wrap:
                await retrier.acall(afn, 5.0, cut=cut)
            else:
                await afn("a:1", 5.0)
        return time.perf_counter() - begin

    adirect = asyncio.run(arun(False))
    awrapped = asyncio.run(arun(True))
    anocut = asyncio.run(arun(True, cut=False))  # gRPC attempts: bounded by gRPC's own deadline
    m = n // 10
    return {
        "sync_direct_us": direct / n * 1e6,
        "sync_wrapped_us": wrapped / n * 1e6,
        "async_direct_us": adirect / m * 1e6,
        "async_wrapped_us": awrapped / m * 1e6,
        "async_wrapped_nocut_us": anocut / m * 1e6,
    }


class UnwrappedClient(AsyncEmbeddingClient):
    """The client with each request sent once, straight: its code without the retry wrapper."""

    async def _request(self, items, start, stop):
        o = self.options
        inputs, outputs = build_request(o, items[start:stop])
        result = await self._connection(o.url).infer(o.model, inputs, outputs=outputs, **o.infer_kwargs())
        return read_embeddings(result, stop - start, o)


def drive(path: str, protocol: Literal["http", "grpc"], url: str, concurrency: int):
    """The load of one path: a function of the seconds it runs."""

    async def run(seconds: float) -> load.Tally:
        if path == "raw tritonclient":
            return await load.kserve_texts(
                protocol, url, MODEL, lambda n: f"retry cost {n}", concurrency, seconds, output="EMBEDDING"
            )
        async with (UnwrappedClient if path == "client, no wrapper" else AsyncEmbeddingClient)(
            url, protocol, timeout_s=10.0
        ) as client:
            return await load.call_loop(lambda n: client.embed([f"retry cost {n}"]), concurrency, seconds)

    return run


def against_server(server, concurrency: int, seconds: float, rounds: int) -> dict:
    urls: dict[Literal["http", "grpc"], str] = {"http": server.http_url, "grpc": server.grpc_url}
    runs = {f"{p} {path}": drive(path, p, urls[p], concurrency) for p in urls for path in PATHS}
    results: dict = {
        key: {**tally.figures(), "client_cpu_us_per_call": cpu / max(len(tally.ok), 1) * 1e6}
        for key, (tally, cpu) in load.alternate(runs, rounds, seconds).items()
    }
    for p in urls:
        results[f"{p} ratio"] = results[f"{p} client (retry wrapper)"]["rps"] / results[f"{p} client, no wrapper"]["rps"]
    return results


def table(results: dict, micro: dict, concurrency: int) -> str:
    lines = [
        (
            f"in process: direct {micro['sync_direct_us']:.2f} us, Retrier.call {micro['sync_wrapped_us']:.2f} us; "
            f"async direct {micro['async_direct_us']:.2f} us, Retrier.acall {micro['async_wrapped_us']:.2f} us "
            f"(with asyncio.timeout, HTTP), {micro['async_wrapped_nocut_us']:.2f} us (without, gRPC) per call"
        ),
        "",
        report.table(
            [f"path (concurrency {concurrency})", "calls/s", "P50 ms", "P99 ms", "max ms", "errors", "client CPU us/call"],
            [
                (name, f"{r['rps']:.0f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}", r["errors"])
                + (f"{r['client_cpu_us_per_call']:.0f}",)
                for name, r in results.items()
                if isinstance(r, dict)
            ],
        ),
    ]
    for p in ("http", "grpc"):
        lines.append(f"\n{p}: with / without the retry wrapper, calls/s = {results[f'{p} ratio']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.client_retry_cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=float, default=4.0, help="per path and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)

    from perf.lib.deployment import server_deployment
    from server.layout import ROOT

    micro = in_process()
    workdir = Path(tempfile.mkdtemp(prefix="client-retry-cost-"))
    with server_deployment((MODEL,), workdir, model_repository=ROOT / "model_repository") as server:
        results = against_server(server, args.concurrency, args.seconds, args.rounds)
    print(table(results, micro, args.concurrency))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"in_process": micro, **results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
