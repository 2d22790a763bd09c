"""server/replica_probes.py against real HTTP servers on loopback: a replica is starting while its probe
port answers anything but 200 or does not answer, and no longer once it answers 200."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from server.replica_probes import ReplicaProbes
from server.supervisor import free_port


def _probe_port(status: list[int], body: list[bytes] | None = None) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802 - http.server's name
            raw = body[0] if body else b""
            self.send_response(status[0])
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _until(predicate, timeout: float = 30.0) -> bool:  # 50 ms polls: generous for a busy machine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_replica_is_starting_until_its_probe_answers_200():
    first, second = [200], [503]
    a, b = _probe_port(first), _probe_port(second)
    silent = f"http://127.0.0.1:{free_port()}/v2/health/ready"  # nothing listens: a replica down
    urls = [f"http://127.0.0.1:{s.server_address[1]}/v2/health/ready" for s in (a, b)]
    probes = ReplicaProbes([*urls, silent], poll_s=0.05, timeout_s=0.5).start()
    try:
        assert _until(lambda: probes.not_ready() == sorted([urls[1], silent]))
        assert probes.starting()
        probes2 = ReplicaProbes(urls, poll_s=0.05, timeout_s=0.5).start()
        try:
            assert _until(probes2.starting)
            second[0] = 200  # the second replica has loaded what it deferred
            assert _until(lambda: not probes2.starting())
            first[0] = 503  # the first restarts
            assert _until(lambda: probes2.not_ready() == [urls[0]])
        finally:
            probes2.stop()
    finally:
        probes.stop()
        a.shutdown()
        b.shutdown()


def test_the_repository_doors_readiness_is_the_replicas_probe_ports():
    """docker-compose's front door asks the repository door for /v2/health/ready: 200 while one replica's
    probe port says ready, each replica listed; 503 when none does; no token needed, unlike the rest."""
    import json
    import urllib.error
    import urllib.request

    from server.repository_door import ReplicaAddress, RepositoryDoor

    first, second = [503], [503]
    a, b = _probe_port(first), _probe_port(second)
    replicas = [
        ReplicaAddress(
            name,
            "http://127.0.0.1:1",
            "http://127.0.0.1:1/metrics",
            "listed",
            f"http://127.0.0.1:{s.server_address[1]}/v2/health/ready",
        )
        for name, s in (("triton-upstream-1", a), ("triton-upstream-2", b))
    ]
    door = RepositoryDoor(lambda: replicas, "the-token").start()

    def get(path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{door.port}{path}", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        assert get("/v2/health/ready") == (
            503,
            {"ready": False, "replicas": {"triton-upstream-1": 503, "triton-upstream-2": 503}},
        )
        second[0] = 200
        assert get("/v2/health/ready") == (200, {"ready": True, "replicas": {"triton-upstream-1": 503, "triton-upstream-2": 200}})
        b.shutdown()
        b.server_close()  # replica 2 down: its probe does not answer
        status, body = get("/v2/health/ready")
        assert status == 503 and body["replicas"]["triton-upstream-2"] == 0
        assert get("/v2/cluster/replicas")[0] == 401  # the rest still needs the token
    finally:
        door.stop()
        a.shutdown()
    plain = RepositoryDoor(lambda: [ReplicaAddress("r", "http://127.0.0.1:1", "m", "listed")], "t").start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{plain.port}/v2/health/ready", timeout=5):
            raise AssertionError("a door without probe ports answered readiness")
    except urllib.error.HTTPError as e:
        assert e.code == 404
    finally:
        plain.stop()


def test_a_replica_counts_as_not_ready_until_it_answers_and_its_marks_are_read():
    import json

    import pytest

    from server.replica_probes import probe_url

    status, body = [503], [json.dumps({"ready": False, "not_ready": [], "unhealthy": {"text_generation": "stub died"}}).encode()]
    server = _probe_port(status, body)
    url = f"http://127.0.0.1:{server.server_address[1]}/v2/health/ready"
    probes = ReplicaProbes([url], poll_s=0.05, timeout_s=0.5)
    try:
        assert probes.starting()  # before its first answer
        probes.start()
        assert _until(lambda: probes.marked("text_generation") is not None)
        assert "stub died" in probes.marked("text_generation") and probes.marked("text_encoder") is None
        body[0] = json.dumps({"ready": False, "unhealthy": ["text_encoder"]}).encode()  # the probe's list form
        assert _until(lambda: probes.marked("text_encoder") is not None and probes.marked("text_generation") is None)
        status[0], body[0] = 200, b"{}"
        assert _until(lambda: not probes.starting() and probes.marked("text_encoder") is None)
    finally:
        probes.stop()
        server.shutdown()
    assert probe_url("http://triton-upstream-1:8003/v2/health/ready")
    for bad in (
        "triton-upstream-1:8003/v2/health/ready",
        "http://triton-upstream-1/v2/health/ready",
        "ftp://h:1/x",
        "http://:8003/x",
    ):
        with pytest.raises(ValueError, match="want http://HOST:PORT/v2/health/ready"):
            probe_url(bad)
    from server import grpc_door

    with pytest.raises(SystemExit) as done:  # refused where it enters, naming the option
        grpc_door.main(["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--repository", ".", "--replica-probe", "nohost"])
    assert done.value.code == 2
