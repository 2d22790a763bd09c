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
import datetime as dt
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from perf.bench.gateway_report import markdown, ratios
from perf.bench.gateway_workloads import (
    CHAT_SYSTEMS,
    DIRECT_EMBED_MODEL,
    EMBED_SYSTEMS,
    MODELS,
    PEER_SYSTEMS,
    WORKLOADS,
    ChatCell,
    EmbedCell,
    run_chat,
    run_embeddings,
)
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.report import load_average, progress

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
    from perf.lib.deployment import server_deployment
    from server.gateway import GatewayOptions, GatewayProcess
    from server.layout import ROOT
    from server.process import free_port

    models = tuple(m for m in MODELS if not (args.no_chat and m == "text_generation"))
    local = tuple(v for v in variants.VARIANTS if v != "trt_plan")  # what this server can load, as the launcher's
    config_name, served = variants.resolve_precision(
        ROOT / "model_repository", ["text_encoder", *models], args.precision, loadable=local
    )
    server = server_deployment(models, workdir / "triton", model_config_name=config_name).start()
    triton = server.triton
    say(
        f"tritonserver starting ({', '.join(models)}; PRECISION={args.precision}: text_encoder={served['text_encoder']}"
        + (f", text_generation={served['text_generation']}" if "text_generation" in served else "")
        + f"): http {triton.http_url}, internal grpc {triton.triton_grpc_url}"
    )
    server.wait_ready(timeout=300)
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
    return server, gateways


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

    say = progress(started)

    load = load_average()
    say(f"perf.bench.gateway_bench: {args.rounds} round(s), load average {load}")
    key = "sk-bench-" + secrets.token_hex(16)
    workdir = Path(tempfile.mkdtemp(prefix="perf-gateway-"))
    server = None
    gateways: dict = {}
    peers: dict = {}
    embed_cells: list[EmbedCell] = []
    chat_cells: list[ChatCell] = []
    failure = ""
    try:
        server, gateways = start_servers(args, workdir, key, say)
        peers = start_peers(args, workdir, say)
        urls = {name: gw.url for name, gw in gateways.items()}
        urls.update({name: peer.url for name, peer in peers.items()})
        if not args.no_embeddings:
            embed_cells = asyncio.run(run_embeddings(args, server.http_url, urls, key, say))
        if not args.no_chat:
            chat_cells = asyncio.run(run_chat(args, urls["quiet"], server.triton.triton_grpc_url, key, say))
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
        if server is not None:
            server.stop()
            if server.triton.log_path.is_file():
                shutil.copyfile(server.triton.log_path, out.with_name(f"{out.stem}-tritonserver.log"))
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
