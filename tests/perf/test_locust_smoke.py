"""The Locust load test (perf/bench/locustfile.py) runs headless against a real server, both protocols."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.perf

LOCUSTFILE = Path(__file__).resolve().parents[2] / "perf" / "bench" / "locustfile.py"


@pytest.mark.parametrize(
    "user, scheme, port_attr", [("TritonHttpUser", "http", "http_port"), ("TritonGrpcUser", "grpc", "grpc_port")]
)
def test_headless_run_sends_requests_without_failures(triton, tmp_path, user, scheme, port_attr):
    host = f"{scheme}://{triton.options.host}:{getattr(triton.options, port_attr)}"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        "4",
        "-r",
        "4",
        "-t",
        "4s",
        "--stop-timeout",
        "5",
        "--host",
        host,
        "--csv",
        str(tmp_path / "run"),
        "--only-summary",
        user,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {r["Name"]: r for r in csv.DictReader((tmp_path / "run_stats.csv").open())}
    stats = rows["text_embedding"]
    assert stats["Type"] == scheme
    assert int(stats["Request Count"]) > 10
    assert int(stats["Failure Count"]) == 0
    assert float(stats["50%"]) > 0 and float(stats["99%"]) >= float(stats["50%"])
