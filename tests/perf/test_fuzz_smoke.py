"""A short run of tests.fuzz: the perf tier's server (text_embedding and its steps, behind the
front door), a few hundred endpoint cases, a short atheris run of every decoding target.

Asserts the oracles themselves (zero 5xx, zero refusals that name no field, zero dropped
connections, no stub gone, the same known-good answers after the run), and that the oracle
can fail: the same hostile request sent to tritonserver's internal port, past the front door,
is counted as a 5xx. The 10,000-case run is ``make fuzz`` (docs/fuzzing.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np
import pytest

from tests.fuzz import endpoints as fuzz

pytestmark = pytest.mark.perf

CASES = 600


def test_endpoint_fuzz_finds_no_5xx_no_unnamed_refusal_no_crash(triton):
    tally = fuzz.Tally()
    names = fuzz.repository_models(triton.triton_http_url, triton.options.repository_token)
    args = argparse.Namespace(cases=CASES, seed=13)
    health = fuzz.fuzz_server(
        triton.http_url, triton.grpc_url, triton.process.pid, names, args, print, tally, log_path=triton.log_path
    )
    print(fuzz.table(tally))
    assert tally.total() >= CASES
    assert {"http_json", "http_binary", "http_generate", "grpc_typed", "grpc_raw", "grpc_stream_raw"} <= set(tally.counts)
    assert not tally.bad(), (tally.bad(), tally.findings[:5])
    ok = sum(c["2xx"] + c["grpc:OK"] for c in tally.counts.values())
    assert 0 < ok < tally.total(), "every case passed or every case failed: the mutations are not working"
    assert health.alive and health.stubs_before and not health.crashed_stubs and not health.log_lines
    assert health.answers_ok and all(health.answers_ok.values()), health.answers_ok


def test_the_oracle_counts_a_5xx_past_the_front_door(triton):
    model = fuzz.served_models(triton.http_url, ["text_embedding"])[0]
    req = fuzz.base_request(model, 1, 8, np.random.default_rng(0))
    req.parameters["priority"] = -1  # tritonserver 2.51 alone: 500 "Unable to parse 'priority'"
    req.names.add("priority")
    tally = fuzz.Tally()
    for url, endpoint in ((triton.triton_http_url, "direct"), (triton.http_url, "front door")):
        conn = fuzz.HTTP(url)
        answer = conn.post("/v2/models/text_embedding/infer", fuzz.encode_json(req))
        conn.close()
        fuzz.classify_http(endpoint, answer[0], answer[1], req, tally)
    assert tally.counts["direct"]["5xx:500"] == 1, tally.counts
    assert tally.counts["front door"]["4xx:400"] == 1, tally.counts


def test_atheris_targets_run_without_a_crash(tmp_path):
    tally = fuzz.Tally()
    fuzz.atheris_fuzz(200, tmp_path, print, tally, max_time=30)
    listed = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.targets", "--list"], capture_output=True, text=True, check=True, cwd=fuzz.ROOT
    ).stdout.split()
    assert set(listed) == set(fuzz.ATHERIS_TARGETS)
    assert set(tally.counts) == {f"atheris:{t}" for t in listed}
    for target, counts in tally.counts.items():
        assert counts["cases"] >= 200 and not counts["crash"], (target, counts, tally.findings)
