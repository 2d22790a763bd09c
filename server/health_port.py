"""The replica's probe port: readiness and liveness that tell the truth without a front door.

A replica run as ``python -m server --role replica`` (a container of docker-compose, a
Kubernetes pod) has no nginx of its own to read the stub watchdog's marks, and tritonserver's
``/v2/health/ready`` is strict: false while any model loads, so a probe on it would take a pod
out of its Service at every rollout step, and true while a python backend stub is dead. This
port answers from what serves:

- ``GET /v2/health/ready``: 200 when tritonserver has finished starting (the launcher's
  ``wait_ready``), every served model's ready endpoint answers 200 (a version loading beside the
  served one does not count) and no model is marked unhealthy by the watchdog; else 503 with the
  reasons as JSON (``{"ready": false, "not_ready": [...], "unhealthy": [...]}``);
- ``GET /v2/models/<model>/ready``: 503 while the watchdog marks the model, else tritonserver's
  own answer for it;
- ``GET /v2/health/live``: 200 while tritonserver runs (while it starts, loading models with its
  ports still closed, too), and once started while it answers its live endpoint and the watchdog
  runs; 503 otherwise (a liveness probe restarts the container then).

Everything else is 404: the port serves probes, not inference.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from server.stubs import ANY_UNHEALTHY

log = logging.getLogger(__name__)

# The KServe v2 health paths, as on tritonserver's own port (the probes of compose and Kubernetes).
READY_PATH = "/v2/health/ready"
LIVE_PATH = "/v2/health/live"
MODEL_READY = re.compile(r"^/v2/models/([^/]+)(?:/versions/([0-9]+))?/ready$")


class Probes:
    """What the probe port answers, from the launcher's state (the handler only formats it)."""

    def __init__(
        self,
        models: Sequence[str],
        health_dir: Path,
        triton_status: Callable[[str], int],
        running: Callable[[], bool],
        started: Callable[[], bool],
        watchdog_alive: Callable[[], bool],
    ):
        self.models = tuple(models)
        self.health_dir = health_dir
        self.triton_status = triton_status  # GET a tritonserver path -> its HTTP status (0: no answer)
        self.running = running
        self.started = started
        self.watchdog_alive = watchdog_alive

    def unhealthy(self) -> list[str]:
        try:
            return sorted(p.name for p in self.health_dir.iterdir() if not p.name.startswith("."))
        except OSError:
            return []

    def ready(self) -> tuple[int, dict]:
        if not self.running():
            return 503, {"ready": False, "reason": "tritonserver is not running"}
        if not self.started():
            return 503, {"ready": False, "reason": "tritonserver is starting"}
        unhealthy = self.unhealthy()
        marked = (self.health_dir / ANY_UNHEALTHY).exists()
        not_ready = [m for m in self.models if m not in unhealthy and self.triton_status(f"/v2/models/{m}/ready") != 200]
        if unhealthy or marked or not_ready:
            return 503, {"ready": False, "not_ready": not_ready, "unhealthy": unhealthy}
        return 200, {"ready": True, "models": list(self.models)}

    def model_ready(self, model: str, version: str | None) -> tuple[int, dict]:
        if (self.health_dir / model).exists():
            return 503, {"ready": False, "model": model, "reason": "a dead instance is being reloaded"}
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/ready"
        status = self.triton_status(path)
        return (200, {"ready": True, "model": model}) if status == 200 else (503, {"ready": False, "model": model})

    def live(self) -> tuple[int, dict]:
        if not self.running():
            return 503, {"live": False, "reason": "tritonserver is not running"}
        if not self.started():  # its ports open once the models are loaded: a liveness probe must not restart a load
            return 200, {"live": True, "starting": True}
        if self.triton_status("/v2/health/live") != 200:
            return 503, {"live": False, "reason": "tritonserver does not answer /v2/health/live"}
        if not self.watchdog_alive():
            return 503, {"live": False, "reason": "the stub watchdog is not running"}
        return 200, {"live": True}


class _Handler(BaseHTTPRequestHandler):
    probes: Probes  # set on the server's handler class

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        match = MODEL_READY.match(path)
        if path == READY_PATH:
            status, body = self.probes.ready()
        elif path == LIVE_PATH:
            status, body = self.probes.live()
        elif match:
            status, body = self.probes.model_ready(match.group(1), match.group(2))
        else:
            status, body = 404, {"error": f"{path}: this port answers /v2/health/ready, /v2/health/live and model ready"}
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        log.debug("probe port: " + format, *args)


class ProbePort:
    """The probe port's HTTP server on its own thread."""

    def __init__(self, host: str, port: int, probes: Probes):
        handler = type("ProbeHandler", (_Handler,), {"probes": probes})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="probe-port", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> ProbePort:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
