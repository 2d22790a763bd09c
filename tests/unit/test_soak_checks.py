"""perf.drills.soak's verdicts on made-up samples: a leak fails, a flat line and one noisy interval pass;
perf.lib.processes reads a stub's model from its command line."""

from __future__ import annotations

import os

import pytest

from perf.drills import soak
from perf.lib import processes


def rss_rows(name: str, values_mib, step: float = 60.0) -> list[dict]:
    return [{"time_s": k * step, "process": name, "group": name, "rss_mib": v} for k, v in enumerate(values_mib)]


def test_a_steady_leak_fails_and_a_flat_process_passes():
    samples = rss_rows("leaky", [100 + 3 * k for k in range(11)]) + rss_rows("flat", [2000, 2001, 2000, 2002, 2001] * 2)
    verdict = {r["process"]: r for r in soak.rss_checks(samples, warmup=60, pct=5, floor_mib=20)}
    # 3 MiB a minute for 9 minutes after the warm-up: 27 MiB > max(5 % of 103, 20).
    assert not verdict["leaky"]["ok"] and verdict["leaky"]["fitted_growth_mib"] == pytest.approx(27.0)
    assert verdict["leaky"]["slope_mib_per_min"] == pytest.approx(3.0)
    assert verdict["flat"]["ok"] and verdict["flat"]["limit_mib"] == pytest.approx(100.05)  # 5 % of 2,001 MiB


def test_growth_during_the_warm_up_is_not_counted():
    samples = rss_rows("warming", [50, 150, 151, 151, 152, 151])
    (verdict,) = soak.rss_checks(samples, warmup=60, pct=5, floor_mib=20)
    assert verdict["ok"] and verdict["rss_start_mib"] == 150


def test_too_few_samples_after_the_warm_up_fail():
    (verdict,) = soak.rss_checks(rss_rows("short", [10, 10, 10]), warmup=60, pct=5, floor_mib=20)
    assert not verdict["ok"] and "2 samples" in verdict["note"]


def latency_rows(name: str, p99s, count: int = 100) -> list[dict]:
    return [{"time_s": 60.0 * (k + 1), "workload": name, "p99_ms": v, "count": count} for k, v in enumerate(p99s)]


def test_a_rising_p99_fails_and_one_spike_does_not():
    rows = latency_rows("rising", [20, 40, 60, 80, 100, 120, 140, 160, 180, 200]) + latency_rows(
        "spiky", [30, 31, 29, 30, 900, 30, 31, 30, 29, 30]
    )
    verdict = {r["workload"]: r for r in soak.p99_checks(rows, warmup=60, factor=1.0)}
    assert not verdict["rising"]["ok"] and verdict["rising"]["fitted_rise_ms"] == pytest.approx(160.0)
    assert verdict["spiky"]["ok"], verdict["spiky"]


def test_intervals_with_few_answers_are_left_out_of_the_trend():
    rows = latency_rows("sparse", [10, 500, 900, 1500], count=2)
    (verdict,) = soak.p99_checks(rows, warmup=0, factor=1.0)
    assert verdict["ok"] and "no trend" in verdict["note"]


def test_mix_parsing_names_unknown_workloads():
    assert soak._mix("embed=1")["embed"] == 1 and soak._mix("embed=1")["image"] == 0
    with pytest.raises(Exception, match="unknown workload 'pictures'"):
        soak._mix("pictures=3")


def test_stub_identity_reads_model_and_instance():
    args = [
        "/x/backends/python/triton_python_backend_stub",
        "/repo/model_repository/text_encoder/1/model.onnx",
        "shm",
        "16777216",
        "16777216",
        "123",
        "/x/backends/python",
        "336",
        "text_encoder_0_1",
        "/x/onnxruntime",
    ]
    assert processes.stub_identity(args) == ("text_encoder", "text_encoder_0_1")
    assert processes.stub_identity(["/usr/sbin/nginx", "-c", "x"]) is None


def test_this_process_is_sampled():
    (me,) = processes.deployment()
    assert me.group == "load generator" and me.pid == os.getpid() and processes.alive(me)
    snap = processes.snapshot([me])
    assert snap["load generator"].rss_bytes > 1 << 20 and snap["load generator"].cpu_s > 0
