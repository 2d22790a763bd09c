"""``python -m server.cluster`` (make serve-cluster): its options (the shared ones from
server/cli.py), its Deployment's options (a pool of replicas, every part restarted when it dies)
and its first screen; server/cli.py's run does the rest."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from server import cluster as cluster_module
from server.cli import Preset, add_serving_options, deployment_fields, env_int, gateway_options, run
from server.deployment import Deployment, DeploymentOptions
from server.deployment_parts import Backoff
from server.layout import ROOT
from server.models import openai_models
from server.prometheus import RULES_DIR


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m server.cluster", description=cluster_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serving_options(
        p,
        host_help="the front door's address",
        workdir=ROOT / ".triton" / "cluster",
        workdir_help="replicas' folders, logs, nginx and Prometheus (default .triton/cluster)",
        gateway_port_help="the front door's OpenAI port (default 8080); the gateways listen on internal ports",
    )
    p.add_argument("--replicas", type=int, default=env_int("REPLICAS", 2), help="tritonserver replicas (default 2)")
    p.add_argument(
        "--redis-url", default=None, help="an existing Redis for the shared L2 (default: start a redis-server for the cluster)"
    )
    p.add_argument("--no-redis", action="store_true", help="no shared L2 cache")
    p.add_argument(
        "--gateways",
        type=int,
        default=env_int("GATEWAYS", 2),
        help="OpenAI gateway processes behind the front door (default 2; 0: none)",
    )
    p.add_argument(
        "--prometheus-port",
        type=int,
        default=env_int("PROMETHEUS_PORT", 0),
        help="Prometheus's port (default 9090 when free, else a free port)",
    )
    p.add_argument("--no-prometheus", action="store_true")
    p.add_argument("--scrape-interval", type=float, default=5.0, help="Prometheus scrape interval in s (default 5)")
    p.add_argument("--max-backoff", type=float, default=30.0, help="longest wait before a restart, s (default 30)")
    p.add_argument("--echo", action="store_true", help="echo every replica's log on stdout")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def first_screen(cluster: Deployment, args: argparse.Namespace, served: Mapping[str, str]) -> str:
    precision = args.precision
    d = cluster.describe()
    door = d["front_door"]
    lines = [
        "",
        f"serve-cluster: ready, {len(cluster.replicas)} replicas behind one front door (docs/cluster.md)",
        f"  HTTP        http://{door['http']}  (e.g. curl http://{door['http']}/v2/models/text_embedding)",
        f"  gRPC        {door['grpc']}",
        f"  metrics     {door['metrics']}  (one replica's; Prometheus scrapes each)",
    ]
    if cluster.gateways:
        lines.append(
            f"  OpenAI      {cluster.gateway_url}/v1  (the front door, {len(cluster.gateways)} gateways behind it; "
            f"key in {cluster.gateway_key_source})"
        )
    else:
        lines.append("  OpenAI      off")
    if cluster.prometheus is not None:
        rules = ", ".join(path.name for path in cluster.rules) or f"none in {RULES_DIR.relative_to(ROOT)}"
        jobs = "triton, gateway" if cluster.gateways else "triton"
        lines.append(f"  Prometheus  {cluster.prometheus.url}  (jobs {jobs}; rules {rules}; log {cluster.prometheus.log_path})")
    lines.append(f"  Redis       {cluster.redis_url or 'off'}  (text_embedding_cached's shared L2)")
    for r in d["replicas"]:
        lines.append(
            f"  replica {r['index']}   HTTP 127.0.0.1:{r['http']}  gRPC {r['grpc']}  metrics {r['metrics']}  "
            f"pid {r['pid']}  log {r['log']}"
        )
    for g in d["gateways"]:
        lines.append(
            f"  gateway {g['index']}   HTTP 127.0.0.1:{g['port']}  pid {g['pid']}  "
            f'(Prometheus job gateway, gateway="{g["index"]}")  log {g["log"]}'
        )
    lines += [
        f"  models      {', '.join(cluster.replicas[0].options.models)}",
        f"  variants    {', '.join(f'{m}={v}' for m, v in served.items()) or 'n/a'} (PRECISION={precision})",
        f"  front door  {door['config']}  log {door['log']}",
        f"  state       {cluster.state_path}  (replicas, pids, restarts)",
        "  Ctrl-C to stop.",
    ]
    return "\n".join(lines)


def deployment_options(args: argparse.Namespace, models: tuple[str, ...], config_name: str | None) -> DeploymentOptions:
    if args.gateways < 0:
        raise ValueError(f"--gateways must be >= 0, not {args.gateways}")
    gateway = not args.no_gateway and args.gateways > 0 and bool(openai_models(args.model_repository, models))
    return DeploymentOptions(
        **deployment_fields(args, models, config_name),
        replicas=args.replicas,
        pool=True,
        redis=not args.no_redis and not args.redis_url,
        redis_url=None if args.no_redis else args.redis_url,
        gateway=gateway_options(args) if gateway else None,
        gateways=args.gateways if gateway else 0,
        prometheus_port=None if args.no_prometheus else args.prometheus_port,
        scrape_interval_s=args.scrape_interval,
        backoff=Backoff(max_s=args.max_backoff),
        restart=True,
    )


CLUSTER = Preset(
    prog="serve-cluster",
    options=deployment_options,
    stopping=lambda args: (
        f"stopping the gateways, the front door (draining at most {args.drain_timeout:.0f} s), the replicas, Prometheus and Redis"
    ),
    screen=first_screen,
    stopped=lambda _code, seconds: f"serve-cluster: stopped after {seconds:.1f} s",
    echo=lambda args: sys.stdout if args.echo else None,
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replicas < 1:
        print(f"serve-cluster: --replicas must be >= 1, not {args.replicas}", file=sys.stderr)
        return 2
    return run(args, CLUSTER)
