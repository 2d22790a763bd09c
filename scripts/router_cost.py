"""What the canary router step costs: text_embedding (tokenizer -> text_encoder, the steady state)
against its routed form (tokenizer -> router -> encoder version, BLS; what a rollout puts in
front), side by side on one server with perf_analyzer, interleaved rounds.

    .venv/bin/python scripts/router_cost.py [--concurrency 16] [--rounds 3] [--request-count 2000]

Writes perf_analyzer's CSV and logs under build/router-cost-<UTC time>/ and prints a table.
Stability is not required (-s 999: the average of 3 count windows): on a shared 2-core machine
perf_analyzer's stabilisation rarely converges, so the rounds are interleaved and the medians
compared instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perf.lib import perf_analyzer as pa  # noqa: E402
from perf.lib.deployment import server_deployment  # noqa: E402

DIRECT = "text_embedding"
ROUTED = "text_embedding_routed"


def copy_repository(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name == "__pycache__":
            continue
        if p.is_dir():
            copy_repository(p, dst / p.name)
        elif p.suffix == ".onnx":
            os.symlink(p.resolve(), dst / p.name)
        else:
            shutil.copy2(p, dst / p.name)


def add_routed_ensemble(repo: Path) -> None:
    """text_embedding's routed form (ops/rollout.py puts it in front during a rollout) as a model of its own."""
    from ops.configs import config_from_disk, config_text
    from python_backends.routing.ensemble import routed_form

    config = routed_form(config_from_disk(repo, DIRECT, None))
    config["name"] = ROUTED
    (repo / ROUTED / "1").mkdir(parents=True)
    (repo / ROUTED / "config.pbtxt").write_text(config_text(config))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--request-count", type=int, default=2000, help="perf_analyzer requests per window")
    p.add_argument("--precision", default="int8")
    p.add_argument("--input-data", type=Path, default=ROOT / "perf" / "data" / "sentences_16tok.json")
    p.add_argument(
        "--no-router-metrics",
        action="store_true",
        help="router parameter metrics=false: what its two metric updates per call cost",
    )
    args = p.parse_args(argv)
    binary, env = pa.check()
    out = ROOT / "build" / time.strftime("router-cost-%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix="router-cost-"))
    try:
        repo = tmp / "model_repository"
        copy_repository(ROOT / "model_repository", repo)
        add_routed_ensemble(repo)
        if args.no_router_metrics:
            config = repo / "text_encoder_router" / "config.pbtxt"
            config.write_text(config.read_text() + 'parameters { key: "metrics" value: { string_value: "false" } }\n')
        results: dict[str, list[pa.Measurement]] = {ROUTED: [], DIRECT: []}
        with server_deployment((ROUTED, DIRECT), tmp / "work", model_repository=repo, model_config_name=args.precision) as server:
            for r in range(args.rounds):
                for model in (DIRECT, ROUTED):
                    settings = pa.Settings(
                        model=model,
                        url=server.grpc_url,
                        protocol="grpc",
                        concurrency=args.concurrency,
                        input_data=args.input_data,
                        request_count=args.request_count,
                        stability_percent=999,
                        max_trials=3,
                        timeout_s=300,
                    )
                    m = pa.measure(
                        settings, out / f"{model}-r{r}.csv", log_path=out / f"{model}-r{r}.log", binary=binary, env=env
                    )
                    results[model].append(m)
                    print(
                        f"round {r + 1} {model:24s} {m.throughput:7.1f} infer/s  p50 {m.p50_ms:6.1f} ms  p99 {m.p99_ms:6.1f} ms",
                        flush=True,
                    )
        direct = statistics.median(m.throughput for m in results[DIRECT])
        routed = statistics.median(m.throughput for m in results[ROUTED])
        d99 = statistics.median(m.p99_ms for m in results[DIRECT])
        r99 = statistics.median(m.p99_ms for m in results[ROUTED])
        print(
            f"\nmedian of {args.rounds} rounds, concurrency {args.concurrency}, gRPC, {args.precision}, "
            f"{args.input_data.name}:\n"
            f"| pipeline | infer/s | p99 ms |\n|---|---|---|\n"
            f"| tokenizer -> text_encoder (no router) | {direct:.1f} | {d99:.1f} |\n"
            f"| tokenizer -> text_encoder_router -> text_encoder (BLS) | {routed:.1f} | {r99:.1f} |\n"
            f"| ratio | {routed / direct:.3f} | {r99 / d99:.2f} |\n(files: {out.relative_to(ROOT)})"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
