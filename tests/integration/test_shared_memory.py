"""A killed tritonserver leaves its python backend shared memory regions in /dev/shm (nothing
unlinks them): the launcher gives each server its own region prefix and removes what is left
under it when the server stops or starts again (server/process.py). Without it, a day of
tests and cluster drills left 15 GB of /dev/shm, half the machine's memory."""

from __future__ import annotations

import os
import signal

from server.process import SHM_DIR


def regions(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{prefix}*"))


def test_a_killed_servers_shared_memory_is_released_at_stop(start_triton):
    with start_triton("triton-shm-", ("text_embedding",)) as server:
        held = regions(server.triton.shm_prefix)
        # One region per stub: the tokenizer's (python) and the encoder instances' (the Python-
        # based onnxruntime backend), each under this server's prefix and nowhere else.
        others = [p.name for p in SHM_DIR.glob("triton_*_backend_shm_region_*")]
        print("regions:", held, "default-named:", others)
        assert len(held) >= 2 and not others, (held, others)
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(30)
        assert regions(server.triton.shm_prefix), "the kill removed the regions itself: the test shows nothing"
    assert regions(server.triton.shm_prefix) == []
