"""`python -m perf.bench.gateway_bench` (`make perf-gateway`): the OpenAI gateway against Triton direct, side by side.

One tritonserver (text_embedding_cached, text_embedding, text_generation; front door on), two
gateways on its gRPC port (request log off and on) and infinity-emb (perf/baselines/infinity.py, on
the INT8 file optimum quantizes for this CPU, and FP32); the systems' windows take turns.

1. Embeddings, closed loop, one text a request, every answer checked: ``direct`` (KServe infer of
   text_embedding_cached), ``gateway`` (float), ``gateway_b64``, ``gateway_log``, ``infinity``,
   ``infinity_fp32``; texts ``unique`` (misses) and ``repeated`` (sentences_16tok.json, hits).
2. Chat streams, greedy, ``ignore_eos``: ``gateway`` (SSE) against ``direct`` (gRPC stream).

Ratios against the issue's targets (gateway/direct throughput >= 0.8 and P99 <= 1.3x; >= 3x
infinity's throughput at <= 1/4 of its P99; chat TTFT within 10 ms, tokens/s >= 0.95x). Writes
summary.md, results.json (with the client's CPU per request) and the logs to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from perf.bench.gateway_workloads import CHAT_SYSTEMS, EMBED_SYSTEMS, PEER_SYSTEMS, WORKLOADS, Cell, run_chat, run_embeddings
from perf.lib import lifecycle, options, report
from perf.lib.deployment import start_gateways
from perf.lib.options import int_list
from perf.lib.paths import REPOSITORY

# The targets, checked (not enforced) in the printed ratios.
TARGET_EMBED = (0.8, 1.3)  # gateway / direct requests/s at concurrency 32, at least; P99, at most
TARGET_VS_PEER = (3.0, 0.25)  # direct or gateway / infinity-emb, unique texts: requests/s at least; P99 at most
TARGET_TTFT_MS = 10.0  # gateway TTFT - direct TTFT, at most
TARGET_TOKENS = 0.95  # gateway / direct tokens/s, at least


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = options.parser("perf.bench.gateway_bench", __doc__)
    p.add_argument("--rounds", type=int, default=3, help="rounds of interleaved windows (default 3)")
    p.add_argument("--embed-concurrency", type=int, default=32, help="embedding clients (default 32)")
    p.add_argument("--embed-duration", type=float, default=4.0, help="seconds per embeddings window (default 4)")
    p.add_argument(
        "--embed-systems", type=options.choices(EMBED_SYSTEMS), default=list(EMBED_SYSTEMS), help=",".join(EMBED_SYSTEMS)
    )
    p.add_argument("--chat-concurrency", type=int_list, default=[1, 8], help="chat streams, comma-separated (default 1,8)")
    p.add_argument("--chat-requests", type=int, default=3, help="chat requests per client per window (default 3)")
    # 0: all at once, which makes TTFT hinge on whether all arrive before the engine's next step
    p.add_argument("--chat-stagger-ms", type=float, default=25.0, help="chat client k starts k x this after the first")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per chat request, ignore_eos (default 64)")
    p.add_argument("--precision", default=os.environ.get("PRECISION", "auto"), help="as `make serve PRECISION=` (default auto)")
    p.add_argument("--no-embeddings", action="store_true", help="skip the embeddings part")
    p.add_argument("--no-chat", action="store_true", help="skip the chat part (text_generation is then not loaded)")
    p.add_argument("--out", type=Path, help="results folder (default perf/results/gateway-<UTC time>)")
    args = options.finish(p, p.parse_args(argv), argv)
    if min(args.rounds, args.embed_concurrency, args.embed_duration, args.chat_requests, args.max_tokens) <= 0:
        p.error("--rounds, --embed-concurrency, --embed-duration, --chat-requests and --max-tokens must be positive")
    if "direct" not in args.embed_systems:
        args.embed_systems.insert(0, "direct")  # the reference every ratio is taken against
    return args


def start_triton(args, workdir: Path, say):
    """tritonserver with the models and the precision variant asked for, started."""
    from export import variants
    from perf.lib.deployment import server_deployment

    models = ("text_embedding_cached", "text_embedding") + (() if args.no_chat else ("text_generation",))
    local = tuple(v for v in variants.VARIANTS if v != "trt_plan")  # what this server can load, as the launcher's
    config_name, served = variants.resolve_precision(REPOSITORY, ["text_encoder", *models], args.precision, loadable=local)
    server = server_deployment(models, workdir / "triton", model_config_name=config_name).start()
    chosen = ", ".join(f"{m}={served[m]}" for m in ("text_encoder", "text_generation") if m in served)
    say(f"tritonserver starting ({', '.join(models)}; PRECISION={args.precision}: {chosen}): http {server.http_url}")
    return server


def start_peers(args, workdir: Path, say) -> dict:
    """infinity-emb's servers the embeddings ask for; one that cannot run here is dropped, with the reason."""
    from perf.baselines.infinity import InfinityError, InfinityServer
    from server.process import free_port

    peers: dict = {}
    for system in [s for s in PEER_SYSTEMS if s in args.embed_systems and not args.no_embeddings]:
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
    chat_cells: list[Cell] = []
    failure = ""
    try:
        server = start_triton(args, workdir, say)
        server.wait_ready(timeout=300)
        with_log = "gateway_log" in args.embed_systems and not args.no_embeddings
        wanted = {"quiet": ["--no-request-log"]} | ({"log": []} if with_log else {})
        start_gateways({name: (server.triton_grpc_url, extra) for name, extra in wanted.items()}, workdir, key, say, gateways)
        peers = start_peers(args, workdir, say)
        urls = {name: gw.url for name, gw in gateways.items()} | {name: peer.url for name, peer in peers.items()}
        if not args.no_embeddings:
            embed_cells = asyncio.run(run_embeddings(args, server.http_url, urls, key, say))
        if not args.no_chat:
            chat_cells = asyncio.run(run_chat(args, urls["quiet"], server.triton_grpc_url, key, say))
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
    chat = [c.summary() for c in sorted(chat_cells, key=lambda c: (c.concurrency, CHAT_SYSTEMS.index(c.system)))]
    ratio_rows = ratios(embed, chat, args.embed_concurrency)
    lines = report.header("OpenAI gateway vs Triton direct", "perf.bench.gateway_bench", args.argv, load)
    if embed:
        lines.append(
            f"- embeddings: {args.embed_concurrency} closed-loop clients, one text per request, {args.embed_duration:g} s "
            f"windows x {args.rounds} round(s), systems interleaved (what each system is: --help)"
        )
    if chat:
        lines.append(
            f"- chat: {args.max_tokens} new tokens (ignore_eos, greedy), {args.chat_requests} request(s) per client per "
            f"window, concurrency {','.join(map(str, args.chat_concurrency))}, clients {args.chat_stagger_ms:g} ms apart"
        )
    if failure:
        lines.append(f"- stopped early: {failure}")
    command = ["python", "-m", "perf.bench.gateway_bench", *args.argv]
    data = {"command": command, "load_average_before": load, "cpus": os.cpu_count(), "embeddings": embed, "chat": chat}
    report.write(out, markdown(lines, embed, chat, ratio_rows), data | {"ratios": ratio_rows, "error": failure}, say=say)
    complete = (args.no_embeddings or len(embed) == len(WORKLOADS) * len(args.embed_systems)) and (
        args.no_chat or len(chat) == len(CHAT_SYSTEMS) * len(args.chat_concurrency)
    )
    return 0 if not failure and complete else 1


def ratios(embed: Sequence[dict], chat: Sequence[dict], concurrency: int) -> list[dict[str, object]]:
    """The gateway's and the peers' ratios; the embeddings targets are written for 32 clients and checked there only."""
    by = {(s["workload"], s["system"]): s for s in embed}
    pairs = [(w, s, "direct", TARGET_EMBED) for w in WORKLOADS for s in EMBED_SYSTEMS[1:] if s not in PEER_SYSTEMS]
    pairs += [("unique", s, peer, TARGET_VS_PEER) for peer in PEER_SYSTEMS for s in ("direct", "gateway")]
    rows = []
    for workload, ours, ref, (rps, p99) in pairs:
        if (a := by.get((workload, ours))) and (b := by.get((workload, ref))):
            name, checked = f"embeddings {workload}, {ours} / {ref}", concurrency == 32
            rps_row = report.ratio(
                f"{name} throughput, c{concurrency}", a["requests_per_s"], b["requests_per_s"], rps if checked else None
            )
            rows += [
                rps_row,
                report.ratio(f"{name} P99, c{concurrency}", a["p99_ms"], b["p99_ms"], p99 if checked else None, False),
            ]
    cb = {(s["system"], s["concurrency"]): s for s in chat}
    for c in sorted({s["concurrency"] for s in chat}):
        if (g := cb.get(("gateway", c))) and (d := cb.get(("direct", c))):
            for p, key in (("P50", "ttft_p50_ms"), ("P99", "ttft_p99_ms")):
                rows.append(
                    report.ratio(
                        f"chat c{c}, gateway - direct TTFT {p} (ms)", g[key], d[key], TARGET_TTFT_MS, False, "-", unit=" ms"
                    )
                )
            tokens = g["tokens_per_s"], d["tokens_per_s"]
            rows.append(report.ratio(f"chat c{c}, gateway / direct tokens/s", *tokens, TARGET_TOKENS, True, digits=2))
    return rows


def cells(s: dict, *keys: str) -> list[str]:
    """A table row: each key's value, a figure with the decimals after a colon (``p50_ms:2``)."""
    out = []
    for key in keys:
        name, _, digits = key.partition(":")
        out.append(report.fmt(s[name], int(digits), thousands=True) if digits else str(s[name]))
    return out + [f"{s['errors']}: {s['first_error'][:80]}" if s["errors"] else "0"]


def markdown(lines: Sequence[str], embed: Sequence[dict], chat: Sequence[dict], ratio_rows: Sequence[dict]) -> str:
    parts = ["\n".join(lines)]
    if embed:
        columns = ["embeddings", "workload", "concurrency", "requests/s", "P50 ms", "P99 ms", "max ms", "requests"]
        keys = ["system", "workload", "concurrency", "requests_per_s:1", "p50_ms:2", "p99_ms:2", "max_ms:2", "requests"]
        rows = [cells(s, *keys, "client_cpu_per_request_ms:3") for s in embed]
        parts.append(report.table([*columns, "client CPU ms/request", "errors"], rows, left=2))
    if chat:
        columns = ["chat stream", "concurrency", "tokens/s", "TTFT P50 ms", "TTFT P99 ms", "TTFT max ms", "requests"]
        keys = ["system", "concurrency", "tokens_per_s:2", "ttft_p50_ms:1", "ttft_p99_ms:1", "ttft_max_ms:1", "requests"]
        rows = [cells(s | {"tokens": ",".join(map(str, s["tokens_per_request"]))}, *keys, "tokens") for s in chat]
        parts.append(report.table([*columns, "tokens per request", "errors"], rows))
    if ratio_rows:
        parts.append(report.ratio_table(ratio_rows))
    return "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
