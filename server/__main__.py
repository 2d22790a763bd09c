"""`python -m server`: export what is missing, start tritonserver, wait until ready, serve.

Exits 0 after a clean shutdown (Ctrl-C or SIGTERM), non-zero with the tail of the server
log when a model fails to load or the server dies.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path

from python_backends.redaction import redact_url
from server.cli import add_serving_options, env_int, stop_on_signals
from server.deployment import Deployment, DeploymentOptions
from server.frontdoor import FrontDoorError
from server.gateway import GatewayError, GatewayOptions
from server.layout import ROOT, check_home
from server.models import default_models, openai_models
from server.process import ServerError, ServerOptions
from server.repository_prep import RepositoryNotWritable, export_missing, resolve_precision
from server.repository_prep import prepare as prepare_repository


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serving_options(
        p,
        host_help="address to bind (default 127.0.0.1)",
        workdir=ROOT / ".triton",
        workdir_help="where the server is laid out and logs go",
    )
    p.add_argument(
        "--role",
        choices=("all", "replica"),
        default=os.environ.get("TRITON_ROLE", "all"),
        help="all (default): tritonserver behind its doors, with the gateway; replica: one tritonserver on the "
        "public ports with its stub watchdog and the probe port, no doors, no gateway, no export (a container "
        "of docker-compose or a Kubernetes pod, behind a front door of its own; docs/deployment.md)",
    )
    p.add_argument(
        "--probe-port",
        type=int,
        default=env_int("TRITON_PROBE_PORT", 8003),
        help="replica role: readiness and liveness from the served models and the stub watchdog "
        "(server/health_port.py; default 8003, or $TRITON_PROBE_PORT)",
    )
    p.add_argument(
        "--probe-host",
        default=os.environ.get("TRITON_PROBE_HOST") or None,
        help="replica role: the probe port's address (default --host; a pod whose tritonserver listens on its "
        "loopback behind a front door sidecar sets 0.0.0.0 for the kubelet, or $TRITON_PROBE_HOST)",
    )
    p.add_argument(
        "--tritonserver-home",
        type=Path,
        default=Path(os.environ["TRITONSERVER_HOME"]) if os.environ.get("TRITONSERVER_HOME") else None,
        help="an installed tritonserver to run in place, e.g. /opt/tritonserver in NVIDIA's container, with its "
        "native backends (default: the nvidia-pytriton wheel's, or $TRITONSERVER_HOME)",
    )
    p.add_argument(
        "--no-front-door",
        action="store_true",
        help="serve tritonserver itself on the public ports, without the nginx front door that refuses "
        "malformed inference requests (docs/security.md); not for a shared network",
    )
    p.add_argument(
        "--triton-http-port",
        type=int,
        default=env_int("TRITON_INTERNAL_HTTP_PORT", 0),
        help="tritonserver's own HTTP port on 127.0.0.1 behind the front door (default: a free port)",
    )
    p.add_argument("--triton-grpc-port", type=int, default=env_int("TRITON_INTERNAL_GRPC_PORT", 0))
    p.add_argument("--triton-metrics-port", type=int, default=env_int("TRITON_INTERNAL_METRICS_PORT", 0))
    p.add_argument(
        "--summary-latencies",
        action="store_true",
        default=os.environ.get("TRITON_SUMMARY_LATENCIES", "") not in ("", "0", "false"),
        help="Triton's queue/request time quantiles for the P99 alerts (docs/monitoring.md); off by "
        "default: they cost the tail at high request rates",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("EMBEDDING_CACHE_L2_REDIS_URL", ""),
        help="Redis for text_embedding_cached's shared L2 cache, e.g. redis://127.0.0.1:6379/0; "
        "empty = L2 off (default $EMBEDDING_CACHE_L2_REDIS_URL)",
    )
    p.add_argument(
        "--gateway-host",
        default=os.environ.get("GATEWAY_HOST", "127.0.0.1"),
        help="the OpenAI-compatible gateway's address (default 127.0.0.1, whatever --host is)",
    )
    p.add_argument(
        "--gateway-port",
        type=int,
        default=env_int("GATEWAY_PORT", 8080),
        help="the OpenAI-compatible gateway's port (default 8080; docs/openai-gateway.md)",
    )
    p.add_argument("--quiet", action="store_true", help="do not echo the server log (it is still written to --workdir)")
    p.add_argument("--log-verbose", type=int, default=0)
    args = p.parse_args(argv)
    # argparse checks choices and types on the command line only, not on defaults from the environment
    if args.role not in ("all", "replica"):
        p.error(f"--role (or $TRITON_ROLE) {args.role!r}: expected all or replica")
    if args.tritonserver_home is not None:
        try:  # absolute: the laid-out backends link to it from the work folder
            args.tritonserver_home = check_home(args.tritonserver_home.resolve())
        except ValueError as exc:
            p.error(str(exc))
    if args.role == "replica":
        args.no_front_door = args.no_gateway = args.no_export = True
        args.probe_host = args.probe_host or args.host
        public = {args.http_port, args.grpc_port, args.metrics_port}
        if not 0 < args.probe_port < 65536 or args.probe_port in public:
            p.error(
                f"--probe-port (or $TRITON_PROBE_PORT) {args.probe_port}: a free port 1-65535, not the HTTP, gRPC or metrics one"
            )
    return args


def _token_source(args: argparse.Namespace) -> str:
    return "$TRITON_REPOSITORY_TOKEN" if os.environ.get("TRITON_REPOSITORY_TOKEN") else str(args.repository_token_file)


def _rollout_line(path: Path) -> str:
    from ops.rollout import RolloutState
    from python_backends.routing import format_weights

    try:
        state = RolloutState.load(path)
    except ValueError as exc:
        return f"state file unreadable: {exc}"
    if state is None:
        return "no state file: text_encoder_router's configured weights"
    return f"weights {format_weights(state.weights)}, versions {state.loaded} ({state.phase}, from {path})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    if not args.no_export and not export_missing(args.model_repository):
        print("serve: export failed; not starting the server", file=sys.stderr)
        return 1
    models = tuple(args.models or default_models(args.model_repository))
    try:
        config_name, served = resolve_precision(args.model_repository, models, args.precision, args.tritonserver_home)
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    options = ServerOptions(
        model_repository=args.model_repository,
        workdir=args.workdir,
        models=models,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        cache_size_bytes=args.cache_size_mb * 1024 * 1024,
        log_verbose=args.log_verbose,
        model_config_name=config_name,
        env={"EMBEDDING_CACHE_L2_REDIS_URL": args.redis_url} if args.redis_url else {},
        front_door=not args.no_front_door,
        triton_http_port=args.triton_http_port,
        triton_grpc_port=args.triton_grpc_port,
        triton_metrics_port=args.triton_metrics_port,
        max_body_bytes=args.max_body_mb * 1024 * 1024,
        drain_timeout=args.drain_timeout,
        summary_latencies=args.summary_latencies,
        tritonserver_home=args.tritonserver_home,
    )
    from ops.repository import ensure_token

    options.repository_token = ensure_token(args.repository_token_file)
    options.rollout_state = args.rollout_state
    # The lanes rendered and the rollout state read once, before anything starts.
    try:
        repository = prepare_repository(args.model_repository, models, args.rollout_state)
    except RepositoryNotWritable as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    served_openai = [] if args.no_gateway else openai_models(args.model_repository, models)
    gateway_options = None
    if served_openai:
        if not os.environ.get("GATEWAY_API_KEYS", "").strip():
            from openai_gateway.auth import ensure_key_file

            ensure_key_file(args.gateway_api_key_file)
        gateway_options = GatewayOptions(
            triton_grpc_url="",  # tritonserver's own gRPC port, set by the deployment at start
            host=args.gateway_host,
            port=args.gateway_port,
            model_repository=args.model_repository,
            api_key_file=args.gateway_api_key_file,
            workdir=args.workdir,
            drain_timeout=args.drain_timeout,
        )
    deployment = Deployment(DeploymentOptions(options, gateway_options), echo=None if args.quiet else sys.stdout)
    server = deployment.triton
    stop = stop_on_signals(
        "serve",
        f"draining in-flight requests (at most {args.drain_timeout:.0f} s each for the front door and tritonserver), "
        "then stopping",
    )

    started = threading.Event()
    probe_port = None
    if args.role == "replica":
        from server.health_port import ProbePort, Probes
        from server.supervisor import http_status

        probes = Probes(
            models=models,
            health_dir=server.health_dir,
            triton_status=lambda path: http_status(f"http://{server.triton_http_url}{path}", 2.0),
            running=lambda: server.process is not None and server.process.poll() is None,
            started=started.is_set,
            watchdog_alive=lambda: server.watchdog is not None and server.watchdog.alive(),
        )
        probe_port = ProbePort(args.probe_host, args.probe_port, probes).start()
    try:
        deployment.start(repository)
    except FrontDoorError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    gateway = deployment.gateway
    try:
        server.wait_ready(timeout=args.ready_timeout, should_stop=stop.is_set)
    except ServerError as exc:
        deployment.stop()
        if stop.is_set():
            print("serve: stopped before the server was ready", flush=True)
            return 0
        print(f"\nserve: {exc}\n--- last lines of {server.log_path} ---\n{exc.log_tail}", file=sys.stderr)
        return 1
    started.set()
    if gateway is not None:
        try:
            gateway.wait_ready(timeout=60, should_stop=stop.is_set)
        except GatewayError as exc:
            print(f"serve: {exc}", file=sys.stderr)
            deployment.stop()
            return 1
        gateway_line = (
            f"  OpenAI   {gateway.url}/v1  models {', '.join(served_openai)}; API key: Authorization: "
            f"Bearer <key>, key in {gateway.key_source} (docs/openai-gateway.md)\n"
        )
    else:
        gateway_line = (
            "  OpenAI   off (--no-gateway)\n" if args.no_gateway else "  OpenAI   off: no embedding or generation model loaded\n"
        )
    if server.front_door is not None:
        door = (
            f"  front door  nginx checks every HTTP inference request (docs/security.md); "
            f"tritonserver itself on 127.0.0.1 at HTTP {options.triton_http_port}, "
            f"gRPC {options.triton_grpc_port}, metrics {options.triton_metrics_port} (internal)\n"
        )
    elif probe_port is not None:
        door = (
            f"  role     replica: tritonserver on the public ports, no doors (a front door of its own is in front); "
            f"probes http://{args.probe_host}:{probe_port.port}/v2/health/ready and /v2/health/live\n"
        )
    else:
        door = "  front door  OFF (--no-front-door): tritonserver itself on the public ports, undefended\n"
    print(
        "\nserve: ready\n"
        f"  HTTP     http://{server.http_url}  (e.g. curl http://{server.http_url}/v2/models/text_embedding)\n"
        f"  gRPC     {server.grpc_url}\n"
        f"  metrics  {server.metrics_url}  (GET only)\n"
        f"{gateway_line}"
        f"{door}"
        f"  models   {', '.join(options.models)}\n"
        f"  variants {', '.join(f'{m}={v}' for m, v in served.items()) or 'n/a'} (PRECISION={args.precision})\n"
        f"  cache    Triton response cache {args.cache_size_mb} MiB; text_embedding_cached L2 "
        f"{'at ' + redact_url(args.redis_url) if args.redis_url else 'off (no --redis-url)'}\n"
        f"  repository API  needs header triton-repository-token (token in {_token_source(args)})\n"
        f"  rollout  {_rollout_line(args.rollout_state)}\n"
        f"  log      {server.log_path}\n"
        "  Ctrl-C to stop.",
        flush=True,
    )
    while not stop.is_set():
        failure = deployment.failure()
        if failure is not None:
            print(f"serve: {failure}", file=sys.stderr)
            if probe_port is not None:
                probe_port.stop()
            deployment.stop()
            return 1
        stop.wait(0.5)
    stopping_since = time.monotonic()
    if probe_port is not None:
        probe_port.stop()
    code = deployment.stop()
    print(f"serve: tritonserver stopped (exit code {code}) after {time.monotonic() - stopping_since:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
