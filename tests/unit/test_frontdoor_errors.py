"""The front door's error bodies (deploy/frontdoor/infer_check.js) with real nginx before a fake
tritonserver: a model's error, which tritonserver passes on as its words with the data after them
(contract/errors.py), reaches the client with the data as the body's own keys, on infer, on a
decoupled model's generate (its status from the data) and in a generate_stream event cut across
two reads; tritonserver's own errors and successful answers go on untouched."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from contract.errors import MARK, InputError, data_from_body, format_error
from python_backends.generation.scheduler import QueueFull
from server.frontdoor import FrontDoor, FrontDoorPorts
from server.layout import ROOT

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (scripts/setup.sh installs it)")

EMPTY = "in ensemble 'text_embedding', " + format_error(InputError("TEXT[1]", "text is empty"))
FULL = format_error(QueueFull(3, 32, 3))
UNKNOWN = "Request for unknown model: 'nothing' is not found"
TEXT_WITH_MARK = {"model_name": "text_embedding", "outputs": [{"name": "X", "data": [MARK]}]}


class FakeTriton(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.endswith("/generate_stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            piece = b"data: " + json.dumps({"text_output": f"a{MARK}b"}).encode() + b"\n\n"
            error = b"data: " + json.dumps({"error": EMPTY}).encode() + b"\n\n"
            for chunk in (piece + error[:20], error[20:], b""):  # the error event cut across two reads
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                time.sleep(0.05)
            return
        status, body = 400, {"error": EMPTY}
        if "/generate" in self.path:
            body = {"error": FULL}
        elif "/nothing/" in self.path:
            body = {"error": UNKNOWN}
        elif "/ok/" in self.path:
            status, body = 200, TEXT_WITH_MARK
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), FakeTriton)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    http = _free_port()
    ports = FrontDoorPorts("127.0.0.1", http, _free_port(), _free_port(), "127.0.0.1", upstream.server_address[1], 1, 1)
    front = FrontDoor(ports, tmp_path_factory.mktemp("frontdoor"), ROOT / "model_repository").start()
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", http)) == 0:
                    break
            time.sleep(0.05)
        yield f"127.0.0.1:{http}"
    finally:
        front.stop()
        upstream.shutdown()
        upstream.server_close()


def _post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


INFER = {"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "data": ["hello", ""]}]}


def test_a_models_infer_error_has_its_data_as_the_bodys_keys(door):
    status, raw = _post(door, "/v2/models/text_embedding/infer", INFER)
    body = json.loads(raw)
    assert status == 400 and body["error"] == "in ensemble 'text_embedding', TEXT[1]: text is empty", raw
    assert (body["code"], body["field"], body["values"]) == ("invalid_value", "TEXT[1]", {}), raw


def test_a_decoupled_models_whole_answer_gets_the_status_of_its_data(door):
    status, raw = _post(door, "/v2/models/text_generation/generate", {"text_input": "hi"})
    data = data_from_body(json.loads(raw))
    assert status == 503 and data is not None and data.code == "overloaded" and MARK not in data.message, raw
    assert data.values == {"waiting": 3, "max_num_seqs": 32, "max_waiting": 3}


def test_a_stream_error_event_has_its_data_as_the_events_keys(door):
    status, raw = _post(door, "/v2/models/text_generation/generate_stream", {"text_input": "hi"})
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert status == 200 and events[0] == {"text_output": f"a{MARK}b"}, raw  # text is never touched
    assert events[1]["error"].endswith("TEXT[1]: text is empty") and events[1]["code"] == "invalid_value", raw


def test_tritonservers_own_errors_successes_and_the_doors_refusals(door):
    status, raw = _post(door, "/v2/models/nothing/infer", INFER)
    assert (status, json.loads(raw)) == (400, {"error": UNKNOWN})
    status, raw = _post(door, "/v2/models/ok/infer", INFER)
    assert (status, json.loads(raw)) == (200, TEXT_WITH_MARK)
    status, raw = _post(door, "/v2/models/text_embedding/infer", {"inputs": 1})
    assert status == 400 and json.loads(raw) == {
        "error": "inputs must be a non-empty array",
        "code": "invalid_value",
        "field": "inputs",
        "values": {"status": 400},
    }
