"""`python -m server`: export what is missing, start tritonserver behind its doors with the
OpenAI gateway, wait until ready, serve (server/cli.py's run with one replica).

Exits 0 after a clean shutdown (Ctrl-C or SIGTERM), non-zero with the tail of the server
log when a model fails to load or the front door dies; a tritonserver or a gateway that dies
is restarted with backoff (the replica role exits instead: its container is restarted).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from python_backends.redaction import redact_url
from server.cli import Preset, add_serving_options, deployment_fields, env_int, gateway_options, run
from server.deployment import Deployment, DeploymentOptions
from server.layout import ROOT, check_home
from server.models import openai_models

if TYPE_CHECKING:
    from server.health_port import ProbePort


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serving_options(
        p,
        host_help="address to bind (default 127.0.0.1)",
        workdir=ROOT / ".triton",
        workdir_help="where the server is laid out and logs go",
        gateway_port_help="the OpenAI-compatible gateway's port (default 8080; docs/openai-gateway.md)",
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


def deployment_options(args: argparse.Namespace, models: tuple[str, ...], config_name: str | None) -> DeploymentOptions:
    served_openai = [] if args.no_gateway else openai_models(args.model_repository, models)
    return DeploymentOptions(
        **deployment_fields(args, models, config_name),
        log_verbose=args.log_verbose,
        redis_url=args.redis_url or None,
        front_door=not args.no_front_door,
        triton_http_port=args.triton_http_port,
        triton_grpc_port=args.triton_grpc_port,
        triton_metrics_port=args.triton_metrics_port,
        summary_latencies=args.summary_latencies,
        tritonserver_home=args.tritonserver_home,
        gateway=gateway_options(args, host=args.gateway_host, workdir=args.workdir) if served_openai else None,
        # A replica's container is restarted by its orchestrator, which the probe port tells.
        restart=args.role != "replica",
    )


def probe_port(args: argparse.Namespace, deployment: Deployment) -> ProbePort | None:
    """The replica role's probe port (server/health_port.py), up before tritonserver starts."""
    if args.role != "replica":
        return None
    from server.health_port import ProbePort, Probes
    from server.supervisor import http_status

    def server():
        return deployment.triton

    probes = Probes(
        models=deployment.options.models,
        health_dir=deployment.health_dir,
        triton_status=lambda path: http_status(f"http://{server().http_url}{path}", 2.0),
        running=lambda: server().process is not None and server().process.poll() is None,
        started=lambda: deployment.replicas[0].state == "ready",
        watchdog_alive=lambda: server().watchdog is not None and server().watchdog.alive(),
    )
    return ProbePort(args.probe_host, args.probe_port, probes).start()


def ready_screen(deployment: Deployment, args: argparse.Namespace, served: Mapping[str, str]) -> str:
    options, server = deployment.options, deployment.triton
    gateway = deployment.gateway
    if gateway is not None:
        names = ", ".join(openai_models(args.model_repository, options.models))
        gateway_line = (
            f"  OpenAI   {gateway.url}/v1  models {names}; API key: Authorization: "
            f"Bearer <key>, key in {gateway.key_source} (docs/openai-gateway.md)\n"
        )
    else:
        gateway_line = (
            "  OpenAI   off (--no-gateway)\n" if args.no_gateway else "  OpenAI   off: no embedding or generation model loaded\n"
        )
    if deployment.front_door is not None:
        o = server.options
        door = (
            f"  front door  nginx checks every HTTP inference request (docs/security.md); "
            f"tritonserver itself on 127.0.0.1 at HTTP {o.http_port}, "
            f"gRPC {o.grpc_port}, metrics {o.metrics_port} (internal)\n"
        )
    elif args.role == "replica":
        door = (
            f"  role     replica: tritonserver on the public ports, no doors (a front door of its own is in front); "
            f"probes http://{args.probe_host}:{args.probe_port}/v2/health/ready and /v2/health/live\n"
        )
    else:
        door = "  front door  OFF (--no-front-door): tritonserver itself on the public ports, undefended\n"
    return (
        "\nserve: ready\n"
        f"  HTTP     http://{deployment.http_url}  (e.g. curl http://{deployment.http_url}/v2/models/text_embedding)\n"
        f"  gRPC     {deployment.grpc_url}\n"
        f"  metrics  {deployment.metrics_url}  (GET only)\n"
        f"{gateway_line}"
        f"{door}"
        f"  models   {', '.join(options.models)}\n"
        f"  variants {', '.join(f'{m}={v}' for m, v in served.items()) or 'n/a'} (PRECISION={args.precision})\n"
        f"  cache    Triton response cache {args.cache_size_mb} MiB; text_embedding_cached L2 "
        f"{'at ' + redact_url(args.redis_url) if args.redis_url else 'off (no --redis-url)'}\n"
        f"  repository API  needs header triton-repository-token (token in {_token_source(args)})\n"
        f"  rollout  {_rollout_line(args.rollout_state)}\n"
        f"  log      {server.log_path}\n"
        "  Ctrl-C to stop."
    )


SERVE = Preset(
    prog="serve",
    options=deployment_options,
    stopping=lambda args: (
        f"draining in-flight requests (at most {args.drain_timeout:.0f} s each for the front door and tritonserver), "
        "then stopping"
    ),
    screen=ready_screen,
    stopped=lambda code, seconds: f"serve: tritonserver stopped (exit code {code}) after {seconds:.1f} s",
    echo=lambda args: None if args.quiet else sys.stdout,
    companion=probe_port,
    tritonserver_home=lambda args: args.tritonserver_home,
)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv), SERVE)


if __name__ == "__main__":
    sys.exit(main())
