"""The command line of ``python -m server`` (make serve, one tritonserver) and ``python -m
server.cluster`` (make serve-cluster, a pool of replicas): the options both take (the public
ports, the models and their variant, the caches, the repository token and rollout state, the
body limit, the drain and readiness waits, the gateway's port and key file, and export), each
with its default from the same environment variable in both (a bad value in the environment
stops the command naming the variable), and ``run``, the one main both are presets of: export,
a Deployment (server/deployment.py) started, its first screen, watched until Ctrl-C or SIGTERM
or a part that died for good, then stopped in order."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from export.variants import PRECISION_CHOICES
from server.deployment import Deployment, DeploymentOptions
from server.gateway import GatewayOptions
from server.layout import ROOT
from server.models import DEFAULT_MODELS
from server.process import DEFAULT_CACHE_SIZE_MB, ServerError


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


def add_serving_options(
    p: argparse.ArgumentParser, *, host_help: str, workdir: Path, workdir_help: str, gateway_port_help: str
) -> None:
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
    p.add_argument("--gateway-port", type=int, default=env_int("GATEWAY_PORT", 8080), help=gateway_port_help)
    p.add_argument("--no-gateway", action="store_true", help="do not start the OpenAI-compatible gateway")
    p.add_argument("--no-export", action="store_true", help="do not export missing models")


def deployment_fields(args: argparse.Namespace, models: tuple[str, ...], config_name: str | None) -> dict[str, Any]:
    """DeploymentOptions' fields from the options both commands take."""
    return dict(
        model_repository=args.model_repository,
        workdir=args.workdir,
        models=models,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        model_config_name=config_name,
        cache_size_bytes=args.cache_size_mb << 20,
        rollout_state=args.rollout_state,
        max_body_bytes=args.max_body_mb << 20,
        drain_timeout=args.drain_timeout,
        ready_timeout=args.ready_timeout,
    )


def gateway_options(args: argparse.Namespace, **more) -> GatewayOptions:
    """The gateway's options from the options both commands take; ``triton_grpc_url`` is the
    deployment's to set at start."""
    return GatewayOptions(
        triton_grpc_url="",
        port=args.gateway_port,
        model_repository=args.model_repository,
        api_key_file=args.gateway_api_key_file,
        drain_timeout=args.drain_timeout,
        **more,
    )


class Stoppable(Protocol):
    def stop(self) -> object: ...


@dataclass
class Preset:
    """What one command makes of ``run``: its name in messages, its Deployment's options from its
    arguments (with the models and the variant chosen), the line SIGTERM prints, the first screen
    and the last line."""

    prog: str
    options: Callable[[argparse.Namespace, tuple[str, ...], str | None], DeploymentOptions]
    stopping: Callable[[argparse.Namespace], str]
    screen: Callable[[Deployment, argparse.Namespace, Mapping[str, str]], str]
    stopped: Callable[[int | None, float], str]
    echo: Callable[[argparse.Namespace], TextIO | None] = lambda args: None
    # Started before the deployment and stopped after it (the replica role's probe port).
    companion: Callable[[argparse.Namespace, Deployment], Stoppable | None] | None = None
    tritonserver_home: Callable[[argparse.Namespace], Path | None] = lambda args: None


def run(args: argparse.Namespace, preset: Preset) -> int:
    """Export what is missing, start the deployment, wait until ready, serve until stopped.
    Exits 0 after a clean stop (Ctrl-C or SIGTERM), 1 when a part fails or dies for good with
    nothing to restart it, 2 for a bad choice of models or variant."""
    from ops.repository import ensure_token
    from server.frontdoor import FrontDoorError
    from server.prometheus import PrometheusError
    from server.redis_process import RedisError
    from server.repository_prep import RepositoryNotWritable, export_missing, resolve_precision
    from server.repository_prep import prepare as prepare_repository

    prog = preset.prog
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    if not args.no_export and not export_missing(args.model_repository):
        print(f"{prog}: export failed; not starting the server", file=sys.stderr)
        return 1
    from server.models import default_models

    models = tuple(args.models or default_models(args.model_repository))
    try:
        config_name, served = resolve_precision(args.model_repository, models, args.precision, preset.tritonserver_home(args))
        # The lanes rendered and the rollout state read before anything starts (and again
        # before each start of a replica: the state may move on).
        prepare_repository(args.model_repository, models, args.rollout_state)
        options = preset.options(args, models, config_name)
    except (ValueError, RepositoryNotWritable) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    options.repository_token = ensure_token(args.repository_token_file)
    stop = stop_on_signals(prog, preset.stopping(args))

    def event(message: str) -> None:
        now = time.time()
        print(f"{prog}: {time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1000) % 1000:03d} {message}", flush=True)

    deployment = Deployment(options, echo=preset.echo(args), on_event=event)
    companion = preset.companion(args, deployment) if preset.companion is not None else None

    def stop_all() -> int | None:
        code = deployment.stop()
        if companion is not None:
            companion.stop()
        return code

    try:
        deployment.start()
        deployment.wait_ready(timeout=args.ready_timeout, should_stop=stop.is_set)
    except (ServerError, FrontDoorError, PrometheusError, RedisError, OSError) as exc:
        stop_all()
        if stop.is_set():
            print(f"{prog}: stopped before the deployment was ready", flush=True)
            return 0
        tail, where = getattr(exc, "log_tail", ""), getattr(exc, "log_path", None) or "the logs"
        print(f"\n{prog}: {exc}" + (f"\n--- last lines of {where} ---\n{tail}" if tail else ""), file=sys.stderr)
        return 1
    print(preset.screen(deployment, args, served), flush=True)
    while not stop.is_set():
        failure = deployment.failure()
        if failure is not None:
            print(f"{prog}: {failure}", file=sys.stderr)
            stop_all()
            return 1
        stop.wait(0.5)
    stopping_since = time.monotonic()
    code = stop_all()
    print(preset.stopped(code, time.monotonic() - stopping_since), flush=True)
    return 0
