"""A 60 s run of perf.drills.chaos: serve-cluster at 70 % of its measured peak while a text_encoder stub,
a replica, a gateway and Redis are SIGKILLed and 60 hostile requests arrive. It must pass its
own checks (no failed request through a retrying client, no failed generation stream (the gRPC
door continues one whose replica died), only clean failures otherwise, every
fault recovered, no server error in the burst) and write every file. `make chaos` runs the
same for 5 minutes.
"""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from perf.drills import chaos

pytestmark = [
    pytest.mark.perf,
    pytest.mark.skipif(
        not (shutil.which("nginx") or shutil.which("/usr/sbin/nginx")) or not shutil.which("redis-server"),
        reason="serve-cluster needs nginx and redis-server (scripts/setup.sh)",
    ),
]


def test_one_minute_chaos_soak_loses_nothing_and_every_fault_recovers(tmp_path):
    out = tmp_path / "chaos"
    code = chaos.main(["--duration", "60", "--peak-seconds", "5", "--hostile", "60", "--out", str(out)])
    summary = (out / "summary.md").read_text() if (out / "summary.md").is_file() else "(no summary)"
    assert code == 0, summary
    assert "Checks: all passed" in summary
    result = json.loads((out / "results.json").read_text())
    assert [f for f in result["faults"]] == [name for name, _ in chaos.SCHEDULE]
    assert all(f["recovered_s"] is not None for f in result["faults"].values()), result["faults"]
    assert result["burst"]["cases"] >= 60 and result["burst"]["server errors"] == 0
    for name in chaos.RETRIED:
        assert result["table"][name]["sent"] > 0 and result["table"][name]["failed"] == 0, result["table"][name]
    state = result["cluster"]
    assert state["replicas"][1]["restarts"] >= 1 and state["gateways"][0]["restarts"] >= 1
    assert state["redis_restarts"] >= 1
    rows = list(csv.DictReader((out / "per_second.csv").open()))
    assert len(rows) == 60 and sum(int(r["ok"]) for r in rows) > 100
    png = (out / "chaos.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
