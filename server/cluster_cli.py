"""``python -m server.cluster`` (make serve-cluster): its options (the shared ones from
server/cli.py), the first screen, and the run: a Cluster (server/cluster.py) started, watched
until Ctrl-C or SIGTERM, then stopped in order."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Mapping

from server import cluster as cluster_module
from server.cli import add_serving_options, env_int, stop_on_signals
from server.cluster import Cluster, ClusterError
from server.cluster_parts import Backoff, ClusterOptions
from server.frontdoor import FrontDoorError
from server.layout import ROOT
from server.models import default_models, openai_models
from server.process import ServerError
from server.prometheus import RULES_DIR, PrometheusError
from server.repository_prep import export_missing, resolve_precision


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m server.cluster", description=cluster_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serving_options(
        p,
        host_help="the front door's address",
        workdir=ROOT / ".triton" / "cluster",
        workdir_help="replicas' folders, logs, nginx and Prometheus (default .triton/cluster)",
    )
    p.add_argument("--replicas", type=int, default=env_int("REPLICAS", 2), help="tritonserver replicas (default 2)")
    p.add_argument(
        "--redis-url", default=None, help="an existing Redis for the shared L2 (default: start a redis-server for the cluster)"
    )
    p.add_argument("--no-redis", action="store_true", help="no shared L2 cache")
    p.add_argument(
        "--gateway-port",
        type=int,
        default=env_int("GATEWAY_PORT", 8080),
        help="the front door's OpenAI port (default 8080); the gateways listen on internal ports",
    )
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


def first_screen(cluster: Cluster, served: Mapping[str, str], precision: str) -> str:
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    if not args.no_export and not export_missing(args.model_repository):
        print("serve-cluster: export failed; not starting", file=sys.stderr)
        return 1
    from ops.repository import ensure_token

    models = tuple(args.models or default_models(args.model_repository))
    try:
        config_name, served = resolve_precision(args.model_repository, models, args.precision)
    except ValueError as exc:
        print(f"serve-cluster: {exc}", file=sys.stderr)
        return 2
    if args.gateways < 0:
        print(f"serve-cluster: --gateways must be >= 0, not {args.gateways}", file=sys.stderr)
        return 2
    gateway = not args.no_gateway and args.gateways > 0 and bool(openai_models(args.model_repository, models))
    if gateway and not os.environ.get("GATEWAY_API_KEYS", "").strip():
        from openai_gateway.auth import ensure_key_file

        ensure_key_file(args.gateway_api_key_file)
    options = ClusterOptions(
        replicas=args.replicas,
        model_repository=args.model_repository,
        workdir=args.workdir,
        models=models,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        model_config_name=config_name,
        cache_size_bytes=args.cache_size_mb << 20,
        redis_url=None if args.no_redis else (args.redis_url or ""),
        gateway_port=args.gateway_port if gateway else None,
        gateways=args.gateways if gateway else 0,
        gateway_api_key_file=args.gateway_api_key_file,
        prometheus_port=None if args.no_prometheus else args.prometheus_port,
        scrape_interval_s=args.scrape_interval,
        repository_token=ensure_token(args.repository_token_file),
        rollout_state=args.rollout_state,
        max_body_bytes=args.max_body_mb << 20,
        drain_timeout=args.drain_timeout,
        ready_timeout=args.ready_timeout,
        backoff=Backoff(max_s=args.max_backoff),
        echo=args.echo,
    )
    stop = stop_on_signals(
        "serve-cluster",
        f"stopping the gateways, the front door (draining at most {args.drain_timeout:.0f} s), the replicas, "
        "Prometheus and Redis",
    )

    def event(message: str) -> None:
        now = time.time()
        print(
            f"serve-cluster: {time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1000) % 1000:03d} {message}", flush=True
        )

    cluster = Cluster(options, on_event=event)
    try:
        cluster.start()
        print(
            f"serve-cluster: starting {args.replicas} replicas ({', '.join(models)}) and "
            f"{len(cluster.gateways)} gateways; work folder {args.workdir}",
            flush=True,
        )
        cluster.wait_ready(should_stop=stop.is_set)
    except (ClusterError, PrometheusError, FrontDoorError, ServerError, OSError) as exc:
        cluster.stop()
        if stop.is_set():
            print("serve-cluster: stopped before the cluster was ready", flush=True)
            return 0
        print(f"serve-cluster: {exc}", file=sys.stderr)
        return 1
    print(first_screen(cluster, served, args.precision), flush=True)
    code = 0
    front_door = cluster.front_door
    assert front_door is not None  # cluster.start() made it
    while not stop.is_set():
        if not front_door.running():
            print(f"serve-cluster: the front door (nginx) exited\n{front_door.log_tail()}", file=sys.stderr)
            code = 1
            break
        stop.wait(0.5)
    started = time.monotonic()
    cluster.stop()
    print(f"serve-cluster: stopped after {time.monotonic() - started:.1f} s", flush=True)
    return code
