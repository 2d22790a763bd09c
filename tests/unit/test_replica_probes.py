"""server/replica_probes.py against real HTTP servers on loopback: a replica is starting while its probe
port answers anything but 200 or does not answer, and no longer once it answers 200."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from server.replica_probes import ReplicaProbes
from server.supervisor import free_port


def _probe_port(status: list[int]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(status[0])
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _until(predicate, timeout: float = 5.0) -> bool:
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
