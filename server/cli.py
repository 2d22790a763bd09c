"""The command-line options that ``python -m server`` (make serve) and ``python -m server.cluster``
(make serve-cluster) share: the public ports, the models and their variant, the caches, the
repository token and rollout state, the body limit, the drain and readiness waits, the gateway's
port and key file, and export. Each takes its default from the same environment variable in
both, and a bad value in the environment stops the command naming the variable."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

from export.variants import PRECISION_CHOICES
from server.layout import ROOT
from server.models import DEFAULT_MODELS
from server.process import DEFAULT_CACHE_SIZE_MB


def env_number(name: str, default, kind=int, expected: str = "an integer"):
    """``$name`` as ``kind`` (int or float), ``default`` when unset or empty; a bad value stops
    the command naming the variable."""
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return kind(value)
    except ValueError:
        raise SystemExit(f"${name} {value!r}: expected {expected}") from None


def env_int(name: str, default: int) -> int:
    return env_number(name, default)


def env_seconds(name: str, default: float) -> float:
    return env_number(name, default, float, "a number of seconds")


def stop_on_signals(prog: str, what: str) -> threading.Event:
    """An Event set by SIGINT or SIGTERM, after a line saying what stopping does (``what``)."""
    stop = threading.Event()

    def on_signal(signum, _frame):
        print(f"\n{prog}: {signal.Signals(signum).name} received; {what}", flush=True)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


def add_serving_options(p: argparse.ArgumentParser, *, host_help: str, workdir: Path, workdir_help: str) -> None:
    """The options both commands take, with the same names, defaults and environment variables."""
    p.add_argument("--host", default=os.environ.get("TRITON_HOST", "127.0.0.1"), help=host_help)
    p.add_argument("--http-port", type=int, default=env_int("TRITON_HTTP_PORT", 8000))
    p.add_argument("--grpc-port", type=int, default=env_int("TRITON_GRPC_PORT", 8001))
    p.add_argument("--metrics-port", type=int, default=env_int("TRITON_METRICS_PORT", 8002))
    p.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    p.add_argument("--workdir", type=Path, default=workdir, help=workdir_help)
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        help=f"model to load (repeatable; default {', '.join(DEFAULT_MODELS)}: those of them in the repository)",
    )
    p.add_argument(
        "--precision",
        default=os.environ.get("PRECISION", "auto"),
        help="model variant to serve: auto (best that passed its gate: cpu or gpu), "
        f"{', '.join(PRECISION_CHOICES[1:])} (default auto, or $PRECISION)",
    )
    p.add_argument(
        "--cache-size-mb",
        type=int,
        default=env_int("TRITON_CACHE_SIZE_MB", DEFAULT_CACHE_SIZE_MB),
        help=f"Triton's local response cache in MiB (each replica's), used by models with response_cache enabled; "
        f"0 = off (default {DEFAULT_CACHE_SIZE_MB}, or $TRITON_CACHE_SIZE_MB)",
    )
    p.add_argument(
        "--repository-token-file",
        type=Path,
        default=Path(os.environ.get("TRITON_REPOSITORY_TOKEN_FILE") or ROOT / ".triton" / "repository-token"),
        help="the repository API (load/unload) needs the header triton-repository-token with this file's token; "
        "created (mode 0600) when missing; $TRITON_REPOSITORY_TOKEN wins (default .triton/repository-token)",
    )
    p.add_argument(
        "--rollout-state",
        type=Path,
        default=Path(os.environ.get("ROLLOUT_STATE_FILE") or ROOT / ".rollout" / "state.json"),
        help="rollout state (python -m ops.rollout): when it exists, text_encoder's versions and the router's "
        "weights are loaded as it records (default .rollout/state.json, or $ROLLOUT_STATE_FILE)",
    )
    p.add_argument(
        "--max-body-mb",
        type=int,
        default=env_int("TRITON_MAX_BODY_MB", 64),
        help="the front door refuses larger request bodies with 413 (default 64)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=env_seconds("TRITON_DRAIN_TIMEOUT", 30.0),
        help="on SIGTERM/Ctrl-C: seconds for in-flight requests to finish before each process is killed (default 30)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=env_seconds("TRITON_READY_TIMEOUT", 300.0),
        help="seconds to wait for readiness (default 300, or $TRITON_READY_TIMEOUT; a GPU's first start builds "
        "TensorRT engines for minutes)",
    )
    p.add_argument(
        "--gateway-api-key-file",
        type=Path,
        default=Path(os.environ.get("GATEWAY_API_KEY_FILE") or ROOT / ".triton" / "gateway-api-key"),
        help="the gateway's API keys when $GATEWAY_API_KEYS is empty; created with a new key (mode 0600) "
        "when missing (default .triton/gateway-api-key)",
    )
    p.add_argument("--no-gateway", action="store_true", help="do not start the OpenAI-compatible gateway")
    p.add_argument("--no-export", action="store_true", help="do not export missing models")
