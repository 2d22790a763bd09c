"""The cluster's repository API: one load or unload through the front door acts on every replica.

``serve-cluster``'s nginx sends ``/v2/repository/`` and ``/v2/cluster/`` here (a loopback port
of the cluster process) instead of to one replica:

- ``POST /v2/repository/models/<m>/load`` and ``.../unload``: the caller's body and repository
  token go to each replica in turn (``ops.repository.ReplicatedRepositoryClient``): all replicas
  or none. When replica k refuses, the replicas before it are put back as they were and the
  caller gets replica k's status with its message, naming the replica. A replica that is down
  is skipped (it comes back with its startup models and the rollout state); the answer's
  ``skipped`` lists it.
- ``POST /v2/repository/index``: the first live replica's answer (every replica has the same
  repository).
- ``GET /v2/cluster/replicas``: the replicas' own HTTP and metrics addresses and states, so that
  ``ops.rollout`` pointed at the front door acts on and judges every replica. It needs the
  repository token, like the repository API.

Each replica checks the token itself; this door also refuses a call without the right one
(401), so that the replica list is not public. A cluster started without a token checks none.

docker-compose runs it as a service of its own (``python -m server.repository_door --listen
0.0.0.0:8004 --probe-port 8003 --replica triton-upstream-1 --replica triton-upstream-2``, the token
from ``$TRITON_REPOSITORY_TOKEN``), its front door sending ``/v2/repository/`` here and ``/v2/cluster/``
to a replica: ops.rollout on the host reaches the replicas through the front door only, so it
acts through this door (every replica) and judges on the front door's metrics. With the replicas'
probe port it also answers the front door's ``GET /v2/health/ready`` (no token): 200 while one
replica's probe port says ready, each replica's answer listed.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import re
import signal
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ops.repository import TOKEN_HEADER, ReplicatedRepositoryClient, RepositoryClient, RepositoryError, http
from server.health_port import READY_PATH
from server.replica_probes import probe_answer

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024  # a config override with files stays far below this
_MODEL_CALL = re.compile(r"^/v2/repository/models/([^/]+)/(load|unload)$")


class ReplicaAddress:
    """One replica as the door sees it: its name, tritonserver's HTTP and metrics addresses, and
    (docker-compose) its probe port's readiness URL."""

    def __init__(self, name: str, http_url: str, metrics_url: str, state: str, probe_url: str | None = None):
        self.name, self.http_url, self.metrics_url, self.state = name, http_url, metrics_url, state
        self.probe_url = probe_url

    def as_dict(self) -> dict:
        return {"name": self.name, "http": self.http_url, "metrics": self.metrics_url, "state": self.state}


class RepositoryDoor:
    """A threaded HTTP server on ``host:port``; ``replicas()`` is asked on every call."""

    def __init__(
        self, replicas: Callable[[], Sequence[ReplicaAddress]], token: str | None, host: str = "127.0.0.1", port: int = 0
    ):
        self.replicas = replicas
        self.token = token or ""
        door = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # nginx logs the calls
                log.debug("repository door: " + fmt, *args)

            def do_GET(self):
                door.handle(self, "GET")

            def do_POST(self):
                door.handle(self, "POST")

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> RepositoryDoor:
        self._thread = threading.Thread(target=self.server.serve_forever, name="repository-door", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- one call
    def handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        try:
            status, body = self.answer(request, method)
        except Exception as exc:  # a bug here must not kill the thread without an answer
            log.exception("repository door: %s %s", method, request.path)
            status, body = 500, {"error": f"repository door: {type(exc).__name__}: {exc}"}
        raw = json.dumps(body).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(raw)))
        request.end_headers()
        request.wfile.write(raw)

    def ready(self) -> tuple[int, dict]:
        """The front door's readiness (docker-compose): 200 while at least one replica's probe port
        says ready (nginx takes requests to it), each replica's answer listed; 503 when none does."""
        probe_urls = {r.name: r.probe_url for r in self.replicas() if r.probe_url}
        if not probe_urls:
            return 404, {"error": f"{READY_PATH}: this door was started without the replicas' probe ports"}
        answers = {name: probe_answer(url, 2.0)[0] for name, url in probe_urls.items()}
        ready = [name for name, status in answers.items() if status == 200]
        return (200 if ready else 503), {"ready": bool(ready), "replicas": answers}

    def answer(self, request: BaseHTTPRequestHandler, method: str) -> tuple[int, dict]:
        length = request.headers.get("Content-Length") or "0"
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return 413, {"error": f"Content-Length {length[:20]!r}: a repository call's body is at most {MAX_BODY_BYTES} bytes"}
        body = request.rfile.read(int(length)) if int(length) else b""
        path = request.path.split("?", 1)[0]
        if method == "GET" and path == READY_PATH:  # open, as tritonserver's is
            return self.ready()
        token = request.headers.get(TOKEN_HEADER) or ""
        if self.token and not hmac.compare_digest(token.encode(), self.token.encode()):
            return 401, {"error": f"the repository API needs the header {TOKEN_HEADER} (the repository token)"}
        replicas = list(self.replicas())
        if method == "GET" and path == "/v2/cluster/replicas":
            return 200, {"replicas": [r.as_dict() for r in replicas]}
        if method != "POST":
            return 405, {"error": f"{method} {path}: the repository API takes POST"}
        clients = [RepositoryClient(r.http_url, token=token) for r in replicas]
        if path == "/v2/repository/index":
            for client in clients:
                status, raw = http(client.base + path, "POST", body or b"{}", {TOKEN_HEADER: token})
                if status != 0:
                    return status, json.loads(raw) if raw.strip().startswith((b"[", b"{")) else {
                        "error": raw.decode(errors="replace")
                    }
            return 503, {"error": "no replica answers"}
        match = _MODEL_CALL.match(path)
        if match is None:
            return 404, {
                "error": f"{path}: not a repository call (POST /v2/repository/index or /v2/repository/models/<model>/load|unload)"
            }
        model, action = match.groups()
        replicated = ReplicatedRepositoryClient(clients, [r.name for r in replicas])
        try:
            skipped = replicated.post(model, action, body or b"{}")
        except RepositoryError as exc:
            status = exc.status if 400 <= exc.status < 600 else 503
            return status, {"error": str(exc)}
        log.info(
            "repository door: %s of %s on %d replica(s)%s",
            action,
            model,
            len(replicas) - len(skipped),
            f", skipped (down): {', '.join(skipped)}" if skipped else "",
        )
        return 200, {"replicas": len(replicas) - len(skipped), "skipped": skipped} if skipped else {}


def _listen_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--listen {text!r}: HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    from server.frontdoor import Upstream

    p = argparse.ArgumentParser(
        prog="python -m server.repository_door",
        description="The repository API of several tritonservers: one load or unload acts on every replica.",
    )
    p.add_argument("--listen", type=_listen_address, default=("0.0.0.0", 8004), help="HOST:PORT (default 0.0.0.0:8004)")
    p.add_argument(
        "--probe-port",
        type=int,
        default=None,
        help="the replicas' probe port (the launcher's replica role, 8003): GET /v2/health/ready then answers "
        "200 while one of them is ready (the front door's readiness)",
    )
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="HOST[:HTTP:GRPC:METRICS]",
        help="a tritonserver (repeat for each replica; ports default 8000:8001:8002)",
    )
    args = p.parse_args(argv)
    try:
        upstreams = [Upstream.parse(text) for text in args.replica]
    except ValueError as exc:
        p.error(f"--replica: {exc}")
    token = os.environ.get("TRITON_REPOSITORY_TOKEN", "").strip()
    if not token:
        p.error("$TRITON_REPOSITORY_TOKEN is empty: the replicas refuse repository calls without it")
    if args.probe_port is not None and not 0 < args.probe_port < 65536:
        p.error(f"--probe-port {args.probe_port}: 1-65535")
    probe = f":{args.probe_port}{READY_PATH}" if args.probe_port else None
    replicas = [
        ReplicaAddress(
            u.host,
            f"http://{u.host}:{u.http}",
            f"http://{u.host}:{u.metrics}/metrics",
            "listed",
            f"http://{u.host}{probe}" if probe else None,
        )
        for u in upstreams
    ]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    host, port = args.listen
    door = RepositoryDoor(lambda: replicas, token, host=host, port=port).start()
    log.info("repository door on %s:%d for %s", host, door.port, ", ".join(r.name for r in replicas))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    door.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
