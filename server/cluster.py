"""`python -m server.cluster` (``make serve-cluster REPLICAS=2``): several tritonserver replicas on one machine.

Topology (docs/cluster.md)::

    clients -> nginx front door (HTTP 8000, gRPC 8001, metrics 8002, OpenAI 8080)
                 -> replica 0 .. N-1: tritonserver on loopback, each its own ports and work folder
                 -> (8080) gateway 0 .. G-1: the OpenAI gateway on loopback ports
                               -> the front door's gRPC port
    redis-server: text_embedding_cached's shared L2, one for every replica
    Prometheus: scrapes every replica's metrics port (job "triton") and every gateway (job "gateway")

The deployment's supervision loop starts the replicas and the gateways, restarts a dead one
with a bounded backoff (a gateway is back in the front door once its /health/ready answers 200),
and keeps the front door's upstream list in step: a replica alive but failing its readiness is
marked ``down`` and nginx reloaded (SIGHUP), so traffic reaches it again only once its
``/v2/health/ready`` and every model's ready endpoint answer 200. A replica that died stays
listed, without a reload: its ports refuse connections until its restarted tritonserver has
loaded its models, and nginx's passive health checks and retries to the next upstream
(deploy/frontdoor/nginx.conf.template) carry the requests it is sent.

Every child is tied to this process (PR_SET_PDEATHSIG): Ctrl-C stops all of it in order, and a
killed launcher takes its children with it.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # the same Deployment as python -m server, a pool of replicas: server/cluster_cli.py
    from server.cluster_cli import main

    sys.exit(main())
