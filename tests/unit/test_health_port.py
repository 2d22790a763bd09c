"""server/health_port.py's answers from the launcher's state, over a real HTTP port (the replica role's
probes; tests/integration/test_replica_role.py drives them with a real tritonserver)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from server.health_port import ProbePort, Probes
from server.stubs import ANY_UNHEALTHY


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_probes_follow_the_start_the_served_models_and_the_watchdogs_marks(tmp_path):
    state = {"running": True, "started": False, "watchdog": False, "triton": {"/v2/health/live": 0}}
    probes = Probes(
        models=("text_embedding", "image_classification"),
        health_dir=tmp_path,
        triton_status=lambda path: state["triton"].get(path, 0),
        running=lambda: state["running"],
        started=lambda: state["started"],
        watchdog_alive=lambda: state["watchdog"],
    )
    port = ProbePort("127.0.0.1", 0, probes).start()
    try:
        # loading: not ready, but live (a liveness probe must not restart a load)
        assert _get(port.port, "/v2/health/ready") == (503, {"ready": False, "reason": "tritonserver is starting"})
        assert _get(port.port, "/v2/health/live")[0] == 200
        state.update(started=True, watchdog=True)
        state["triton"] = {"/v2/health/live": 200, "/v2/models/text_embedding/ready": 200}
        status, body = _get(port.port, "/v2/health/ready")
        assert status == 503 and body["not_ready"] == ["image_classification"]
        state["triton"]["/v2/models/image_classification/ready"] = 200
        assert _get(port.port, "/v2/health/ready")[0] == 200
        # a version loading beside the served one: tritonserver's strict ready would say 503; this does not ask it
        assert "/v2/health/ready" not in state["triton"]
        # the watchdog marks a model (and the flag file): 503 naming it, and its own ready
        (tmp_path / "text_embedding").touch()
        (tmp_path / ANY_UNHEALTHY).touch()
        status, body = _get(port.port, "/v2/health/ready")
        assert status == 503 and body["unhealthy"] == ["text_embedding"]
        assert _get(port.port, "/v2/models/text_embedding/ready")[0] == 503
        assert _get(port.port, "/v2/models/image_classification/versions/1/ready")[0] == 503  # not asked: 0
        (tmp_path / "text_embedding").unlink()
        (tmp_path / ANY_UNHEALTHY).unlink()
        assert _get(port.port, "/v2/health/ready")[0] == 200
        # the watchdog thread died: not live; tritonserver gone: neither
        state["watchdog"] = False
        assert _get(port.port, "/v2/health/live")[0] == 503
        state.update(watchdog=True, running=False)
        assert _get(port.port, "/v2/health/live")[0] == 503 and _get(port.port, "/v2/health/ready")[0] == 503
        assert _get(port.port, "/v2/models/text_embedding/infer")[0] == 404
    finally:
        port.stop()
