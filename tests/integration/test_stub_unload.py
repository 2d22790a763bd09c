"""Unloading a BLS model, and stopping the server, must not kill its python backend stubs by a signal.

The stubs of text_encoder_router and text_embedding_cached used to segfault on every unload
(kernel log: ``triton_python_b[PID]: segfault at 60``): their pb_utils.Metric and MetricFamily
objects were deleted in the stub's own teardown, after its IPC state was gone. Deleting them
in finalize instead aborted the server on a reload (two families sharing a series: heap
corruption), so the test also reloads the cache model under traffic and checks the server
lives and exits cleanly. A stub's exit status is seen only by tritonserver, so the check reads
the kernel log for the stubs' own PIDs, only the lines written since the test began (PIDs are
reused, and other servers on the machine may have left lines under the same numbers): it is
skipped, saying why, where dmesg is not readable.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

BLS_MODELS = ("text_encoder_router", "text_embedding_cached")


def kernel_log() -> list[str]:
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"dmesg cannot run here ({exc}): a stub's death by a signal cannot be seen")
    if out.returncode != 0 or not out.stdout.strip():
        pytest.skip(f"the kernel log is not readable here (dmesg: {out.stderr.strip() or 'no output'})")
    return out.stdout.splitlines()


def stubs(server_pid: int) -> dict[int, str]:
    """{pid: model} of the server's python backend stubs (its children running the stub)."""
    found = {}
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:  # the thread ended between the listing and the read
            continue
        for pid in children:
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if args and args[0].endswith(b"triton_python_backend_stub"):
                model = next((Path(a.decode()).parent.parent.name for a in args if a.endswith(b"model.py")), "?")
                found[int(pid)] = model
    return found


def stamp(line: str) -> float:
    """The kernel log line's time since boot (``[63104.428650] ...``), 0 where it has none."""
    head = line.partition("]")[0].lstrip("[ ")
    try:
        return float(head)
    except ValueError:
        return 0.0


def crashes(lines: list[str], pids: dict[int, str], since: float) -> list[str]:
    """Kernel log lines after ``since`` saying one of ``pids`` died by a signal (segfault, general protection, ...)."""
    marks = ("segfault", "general protection", "trap ")
    fresh = [line for line in lines if stamp(line) > since]
    return [line for line in fresh for pid in pids if f"[{pid}]:" in line and any(m in line for m in marks)]


def embed(client, model: str, texts: list[str]) -> np.ndarray:
    data = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
    inp = httpclient.InferInput("TEXT", list(data.shape), "BYTES")
    inp.set_data_from_numpy(data)
    return client.infer(model, [inp]).as_numpy("EMBEDDING")


def wait_gone(pids, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists()]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def test_bls_stubs_exit_cleanly_on_unload_and_on_stop(start_triton):
    # Skips early where the log is unreadable. Older lines may name the same, reused PIDs.
    since = max((stamp(line) for line in kernel_log()), default=0.0)
    # The router is off text_embedding's path outside a rollout: it is loaded and called directly.
    with start_triton("triton-unload-", ("text_embedding", "text_embedding_cached", "text_encoder_router")) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        try:
            # Create every metric series: the cache's at load, the router's at its first flush.
            ids = np.array([[101, 1037, 2158, 102]], dtype=np.int64)  # [CLS] a man [SEP]
            router_inputs = []
            for name in ("input_ids", "attention_mask"):
                router_inputs.append(httpclient.InferInput(name, list(ids.shape), "INT64"))
                router_inputs[-1].set_data_from_numpy(ids if name == "input_ids" else np.ones_like(ids))
            for i in range(3):
                assert embed(client, "text_embedding_cached", [f"unload check {i}"]).shape == (1, 384)
                assert client.infer("text_encoder_router", router_inputs).as_numpy("sentence_embedding").shape == (1, 384)
                time.sleep(0.6)
            bls = {p: m for p, m in stubs(server.process.pid).items() if m in BLS_MODELS}
            assert sorted(set(bls.values())) == sorted(BLS_MODELS), f"stubs found: {bls}"

            # Reloads of the cache model under traffic: new instances share the old ones' series.
            for cycle in range(3):
                client.unload_model("text_embedding_cached")
                client.load_model("text_embedding_cached")
                for i in range(30):
                    assert embed(client, "text_embedding_cached", [f"reload {cycle}: {i % 4}"]).shape == (1, 384)
                bls.update({p: m for p, m in stubs(server.process.pid).items() if m in BLS_MODELS})
                assert server.process.poll() is None, "tritonserver died on a reload:\n" + server.log_tail(20)

            router = [p for p, m in bls.items() if m == "text_encoder_router"]
            client.unload_model("text_encoder_router")
            assert wait_gone(router) == [], "the router's stubs did not exit after its unload"
            time.sleep(0.5)  # the kernel log line follows the death
            after_unload = crashes(kernel_log(), bls, since)
            assert after_unload == [], "stubs died by a signal on unload:\n" + "\n".join(after_unload)
        finally:
            client.close()
        # The server stops (the fixture's finally); the cache model's stubs go with it.
    time.sleep(0.5)
    after_stop = crashes(kernel_log(), bls, since)
    assert after_stop == [], "BLS stubs died by a signal on server stop:\n" + "\n".join(after_stop)
    log = server.log_tail(400)
    assert "Signal (6)" not in log and "malloc()" not in log, log
    assert server.process.returncode == 0, f"tritonserver exited with {server.process.returncode}"
