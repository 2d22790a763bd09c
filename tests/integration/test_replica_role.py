"""`python -m server --role replica`, what a container or a pod runs: one tritonserver on the public
ports with no doors, and the probe port (server/health_port.py) telling the truth. A python backend
stub SIGKILLed: readiness and the model's ready answer 503 naming it, and 200 again once the watchdog
has reloaded it, within 30 s; tritonserver's own ready endpoint says 200 throughout (why the probe
port exists). Then SIGTERM stops it cleanly.

And as a Kubernetes pod runs it (deploy/kubernetes/base/triton.yaml): an installed tritonserver run in
place (--tritonserver-home, laid out as NVIDIA's /opt/tritonserver), tritonserver on loopback and the
probe port on every address, its manifest's probe paths polled through a canary rollout and its
rollback by `python -m ops.rollout`: readiness and liveness 200 throughout, while tritonserver's
strict readiness says no (400) during the loads (the pod would leave its Service at each step)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from server.layout import ROOT, find_pytriton
from server.process import ServerOptions, free_port
from server.stubs import find_stubs
from tests.integration.launcher_command import launcher_command
from tests.integration.test_kubernetes_probes import probe_paths
from tests.integration.versions import versioned_repository


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
    # every thread's children: the deployment's supervision loop thread forks tritonserver
    tasks = Path(f"/proc/{launcher}/task")
    children = [int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()]
    for pid in children:
        try:
            if "tritonserver" in open(f"/proc/{pid}/cmdline").read():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no tritonserver among {children}")


def _installed_tritonserver(home: Path) -> Path:
    """The wheel's tritonserver laid out as NVIDIA's container installs it: bin/, lib/ (the shared
    libraries), caches/ and backends/python with the stub of this Python beside the backend."""
    source, libs = find_pytriton()
    home.mkdir()
    for name, target in (("bin", source / "bin"), ("lib", libs), ("caches", source / "caches")):
        (home / name).symlink_to(target, target_is_directory=True)
    shutil.copytree(source / "backends", home / "backends")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy2(source / "python_backend_stubs" / version / "triton_python_backend_stub", home / "backends" / "python")
    return home


def test_a_pods_probes_stay_ready_through_a_rollout_on_an_installed_tritonserver(tmp_path):
    from ops.rollout import RolloutState

    paths = probe_paths("triton", "triton")
    assert set(paths) == {"startupProbe", "readinessProbe", "livenessProbe"}
    home = _installed_tritonserver(tmp_path / "opt-tritonserver")
    repo = versioned_repository(tmp_path / "model_repository")
    state = tmp_path / "rollout-state.json"
    RolloutState(stable=1, weights={1: 100}, loaded=[1]).save(state)
    ports = ServerOptions.with_free_ports()
    probe = free_port()
    cmd = launcher_command(
        tmp_path,
        ports,
        # the pod's arguments (base/triton.yaml), on this test's ports
        "--role=replica",
        f"--model-repository={repo}",
        "--precision=int8",
        "--host=127.0.0.1",
        "--probe-host=0.0.0.0",
        f"--probe-port={probe}",
        "--drain-timeout=30",
        f"--tritonserver-home={home}",
        "--model",
        "text_embedding",
        "--rollout-state",
        str(state),
        "--repository-token-file",
        str(tmp_path / "token"),
        "--quiet",
    )
    log = tmp_path / "launcher.err"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    base = f"http://{_this_hosts_address()}:{probe}"  # not loopback: the kubelet's way in
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if _get(f"{base}{paths['startupProbe']}")[0] == 200:
                break
            time.sleep(0.25)
        assert _get(f"{base}{paths['startupProbe']}")[0] == 200, log.read_text()
        # tritonserver itself: the installed one, on loopback only, with the install's python backend
        laid_out = tmp_path / "work" / "tritonserver-installed" / "backends"
        assert (laid_out / "python").resolve() == (home / "backends" / "python").resolve()
        assert (laid_out / "onnxruntime" / "model.py").is_file()  # the project's Python-based backend beside it
        cmdline = open(f"/proc/{_tritonserver_pid(proc.pid)}/cmdline").read().split("\0")
        assert cmdline[0] == str(home / "bin" / "tritonserver") and "--http-address=127.0.0.1" in cmdline

        seen: dict[str, set[int]] = {"probe ready": set(), "probe live": set(), "tritonserver strict ready": set()}
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                seen["probe ready"].add(_get(f"{base}{paths['readinessProbe']}")[0])
                seen["probe live"].add(_get(f"{base}{paths['livenessProbe']}")[0])
                seen["tritonserver strict ready"].add(_get(f"http://127.0.0.1:{ports.http_port}/v2/health/ready")[0])
                time.sleep(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        token = (tmp_path / "token").read_text().strip()
        rollout = [sys.executable, "-m", "ops.rollout", "--url", f"127.0.0.1:{ports.http_port}", "--token", token]
        rollout += ["--metrics-url", f"http://127.0.0.1:{ports.metrics_port}/metrics"]
        rollout += ["--state-file", str(state), "--model-repository", str(repo)]
        try:
            for action in (
                ["start", "2", "--steps", "100", "--dwell", "1", "--check-interval", "0.5", "--allow-unjudged"],
                ["rollback"],
            ):
                done = subprocess.run(rollout + action, cwd=ROOT, capture_output=True, text=True, timeout=300)
                print(f"$ rollout {' '.join(action)} -> {done.returncode}\n{done.stdout}{done.stderr}")
                assert done.returncode == 0, done.stdout + done.stderr
        finally:
            stop.set()
            poller.join()
        print(f"answers seen during the rollout and the rollback: {seen}")
        assert seen["probe ready"] == {200} and seen["probe live"] == {200}, seen
        # what the probe port spares the pod: tritonserver's strict readiness said no (400) during the loads
        assert seen["tritonserver strict ready"] - {200}, seen
        assert RolloutState.load(state).phase == "rolled_back"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()


def _this_hosts_address() -> str:
    """An address of this machine other than loopback (what a pod's IP is to the kubelet)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: the route's source address
        return s.getsockname()[0]
