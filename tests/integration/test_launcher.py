"""`python -m server` as a user runs it: clean start and stop, loud failure on a broken model."""

import re
import signal
import subprocess
import time
from pathlib import Path

from server.layout import ROOT
from server.process import ServerOptions, free_port
from tests.integration.launcher_command import launcher_command

BROKEN_CONFIG = """
name: "broken_encoder"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "sentence_embedding" data_type: TYPE_FP32 dims: [ 384 ] } ]
"""


def _launch(tmp_path: Path, *args: str) -> subprocess.Popen:
    ports = ServerOptions.with_free_ports()
    cmd = launcher_command(
        tmp_path,
        ports,
        "--no-export",
        "--gateway-port",
        str(free_port()),
        "--gateway-api-key-file",
        str(tmp_path / "gateway-api-key"),
        *args,
    )
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_broken_model_fails_the_launch_with_the_log_tail(tmp_path):
    repo = tmp_path / "repo"
    (repo / "broken_encoder" / "1").mkdir(parents=True)  # no model.onnx in it
    (repo / "broken_encoder" / "config.pbtxt").write_text(BROKEN_CONFIG)
    proc = _launch(tmp_path, "--quiet", "--model-repository", str(repo), "--model", "broken_encoder")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, out + err
    assert "before becoming ready" in err
    assert "last lines of" in err
    assert "model.onnx not found (run `make export`)" in err  # the backend's own message, from the log


def test_serves_then_stops_cleanly_on_sigterm(tmp_path):
    proc = _launch(tmp_path, "--quiet")
    deadline = time.monotonic() + 240
    lines = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("serve: ready"):
            break
    assert lines and lines[-1].startswith("serve: ready"), "".join(lines) + (
        proc.stderr.read() if proc.poll() is not None else ""
    )
    ready = "".join(lines)
    while time.monotonic() < deadline and "Ctrl-C to stop" not in ready:
        ready += proc.stdout.readline()
    # The OpenAI gateway is up with the default models, with its key file made private.
    assert "  OpenAI   http://127.0.0.1:" in ready and "text_embedding, text_generation" in ready, ready
    assert (tmp_path / "gateway-api-key").stat().st_mode & 0o777 == 0o600
    # Chats through the gateway just before the stop: their streams end with tritonserver's OK, not
    # a cancellation after the final response, which left text_generation live and unloadable (the
    # exit timeout ran out and tritonserver exited 1).
    from openai import OpenAI

    url = re.search(r"OpenAI\s+(http://\S+/v1)", ready).group(1)
    client = OpenAI(base_url=url, api_key=(tmp_path / "gateway-api-key").read_text().strip(), max_retries=0)
    for question in ("Hi", "Name a colour.", "Say yes."):
        chat = client.chat.completions.create(
            model="text_generation", messages=[{"role": "user", "content": question}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].message.content
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "tritonserver stopped (exit code 0)" in out, out
