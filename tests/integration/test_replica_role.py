"""`python -m server --role replica`, what a container or a pod runs: one tritonserver on the public
ports with no doors, and the probe port (server/health_port.py) telling the truth. A python backend
stub SIGKILLed: readiness and the model's ready answer 503 naming it, and 200 again once the watchdog
has reloaded it, within 30 s; tritonserver's own ready endpoint says 200 throughout (why the probe
port exists). Then SIGTERM stops it cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import tritonclient.http as httpclient

from server.layout import ROOT
from server.process import ServerOptions, free_port
from server.stubs import find_stubs
from tests.integration.launcher_command import launcher_command


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError:
        return 0, {}


def test_the_replica_role_serves_without_doors_and_its_probes_tell_the_truth(tmp_path):
    ports = ServerOptions.with_free_ports()
    probe = free_port()
    cmd = launcher_command(
        tmp_path,
        ports,
        "--role",
        "replica",
        "--model",
        "text_embedding",
        "--probe-port",
        str(probe),
        "--rollout-state",
        str(tmp_path / "no-state.json"),
        "--repository-token-file",
        str(tmp_path / "token"),
        "--quiet",
    )
    log = tmp_path / "launcher.err"  # a file, not a pipe nobody reads while the launcher runs
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    base = f"http://127.0.0.1:{probe}"
    try:
        seen = set()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            status, body = _get(f"{base}/v2/health/ready")
            seen.add(status)
            if status == 200:
                break
            time.sleep(0.25)
        assert status == 200, (status, body, log.read_text())
        assert 503 in seen  # the probe port answered before tritonserver was ready, and said not ready
        out = ""
        while "Ctrl-C to stop" not in out:
            line = proc.stdout.readline()
            assert line, f"the launcher's output ended: {out}{log.read_text()}"
            out += line
        assert "role     replica" in out and "OpenAI   off" in out, out
        # tritonserver itself on the public HTTP port (no front door), serving
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports.http_port}")
        text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([["a replica without doors"]], dtype=object))
        vector = client.infer("text_embedding", [text]).as_numpy("EMBEDDING")
        assert vector.shape == (1, 384) and abs(float(np.linalg.norm(vector)) - 1.0) < 1e-3
        assert _get(f"{base}/v2/health/live")[0] == 200
        assert _get(f"{base}/v2/models/text_embedding/ready")[0] == 200
        assert _get(f"{base}/v2/models/text_embedding/infer")[0] == 404  # probes only

        stubs = [s for s in find_stubs(_tritonserver_pid(proc.pid)) if s.model == "text_encoder" and not s.zombie]
        assert stubs, "no text_encoder stub found"
        os.kill(stubs[0].pid, signal.SIGKILL)
        marked = healed = None
        start = time.monotonic()
        while time.monotonic() - start < 30:
            status, body = _get(f"{base}/v2/health/ready")
            if status == 503 and marked is None:
                marked = time.monotonic() - start
                assert "text_encoder" in body["unhealthy"], body
                assert _get(f"{base}/v2/models/text_encoder/ready")[0] == 503
                # what a probe on tritonserver's own port would have seen
                assert _get(f"http://127.0.0.1:{ports.http_port}/v2/health/ready")[0] == 200
            if status == 200 and marked is not None:
                healed = time.monotonic() - start
                break
            time.sleep(0.1)
        print(f"stub SIGKILLed: readiness 503 after {marked} s, 200 again after {healed} s")
        assert marked is not None and healed is not None, (marked, healed)
        assert _get(f"{base}/v2/models/text_encoder/ready")[0] == 200
        assert client.infer("text_embedding", [text]).as_numpy("EMBEDDING").shape == (1, 384)
        client.close()  # tritonserver's drain waits for every open HTTP connection, idle ones too
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, log.read_text()
    # exit code 0, or -9: the launcher ends a tritonserver whose only models left are those replaced
    # after a stub death (tritonserver 2.51 waits for their dead stub forever; server/process.py)
    assert "tritonserver stopped (exit code 0)" in out or "tritonserver stopped (exit code -9)" in out, out
    assert _get(f"{base}/v2/health/live")[0] == 0  # the probe port went with it


def _tritonserver_pid(launcher: int) -> int:
    children = [int(c) for c in open(f"/proc/{launcher}/task/{launcher}/children").read().split()]
    for pid in children:
        try:
            if "tritonserver" in open(f"/proc/{pid}/cmdline").read():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no tritonserver among {children}")
