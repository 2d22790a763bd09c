"""python_backends.routing.entry and triton_metrics: the router's load checks, each request's Job,
a batch served and its metrics flushed, without Triton; and its model.py shim with a fake pb_utils."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from contract.errors import ConfigError, InputError, Unavailable, format_error, parse_error
from contract.model_config import ModelConfig
from python_backends.routing.entry import OUTPUT, RouterEntry
from python_backends.routing.router import CALLS_METRIC, LATENCY_METRIC, CallTally
from python_backends.routing.serving import CallError, Outcome
from python_backends.routing.triton_metrics import RouterMetrics
from tests.unit.triton_fakes import (
    Request,
    encoder_repository,
    load_shim,
    make_pb_utils,
    model_config,
    tensor,
    triton_logging,
)

pytestmark = pytest.mark.usefixtures(triton_logging.__name__)


def config_json(weights="1:90,2:10", **parameters):
    return model_config(
        "text_encoder_router",
        [tensor("input_ids", [-1], "TYPE_INT64"), tensor("attention_mask", [-1], "TYPE_INT64")],
        [tensor(OUTPUT, [3], "TYPE_FP32"), tensor("encoder_version", [1], "TYPE_INT32")],
        parameters={"weights": weights, **parameters},
    )


class Encoder:
    """Each version's vectors are its number; ``broken`` versions fail every call."""

    def __init__(self, broken=()):
        self.calls, self.broken = [], set(broken)

    async def __call__(self, version, ids, mask):
        self.calls.append((version, ids.shape[0]))
        if version in self.broken:
            raise CallError(f"version {version} is broken")
        return np.full((ids.shape[0], 3), float(version), np.float32)


class Recorder:
    def __init__(self):
        self.flushes = []

    def flush(self, tally):
        self.flushes.append(tally.drain()[0])


@pytest.fixture
def repo(tmp_path):
    return encoder_repository(tmp_path, versions=(1, 2))


def ids(rows=1, length=4):
    return np.ones((rows, length), np.int64)


def test_load_checks_the_tensors_and_the_weights(repo):
    bad = model_config("text_encoder_router", [tensor("input_ids", [-1], "TYPE_INT32")], [])
    with pytest.raises(ConfigError, match="'input_ids' must be TYPE_INT64"):
        RouterEntry(ModelConfig(bad), repo, lambda *a: True, Encoder())
    with pytest.raises(ConfigError, match="names version 3 of 'text_encoder', which has no folder"):
        RouterEntry(ModelConfig(config_json("1:90,3:10")), repo, lambda *a: True, Encoder())


def test_a_request_becomes_a_job_or_an_input_error(repo):
    entry = RouterEntry(ModelConfig(config_json()), repo, lambda *a: True, Encoder())
    job = entry.job(ids(), ids(), '{"encoder_version": 2}', "r1")
    assert (job.decision.version, job.decision.pinned) == (2, True)
    assert entry.job(ids(), ids(), "{}", "user-42").decision == entry.job(ids(), ids(), {}, "user-42").decision
    with pytest.raises(InputError, match="attention_mask: shape \\[1, 5\\] differs"):
        entry.job(ids(), ids(length=5), "{}")
    with pytest.raises(InputError, match="version 9 is not served"):
        entry.job(ids(), ids(), {"encoder_version": 9})


def test_ready_versions_are_the_folders_triton_reports_ready(repo):
    ready = {"2"}
    entry = RouterEntry(ModelConfig(config_json()), repo, lambda name, v: name == "text_encoder" and v in ready, Encoder())
    assert entry.ready_versions() == [2]
    ready.add("1")
    assert entry.ready_versions() == [1, 2]


def test_a_batch_is_served_and_the_tally_flushed_when_due_and_at_close(repo, caplog):
    encoder = Encoder(broken={2})
    with caplog.at_level(logging.INFO, logger="python_backends.routing.entry"):
        entry = RouterEntry(ModelConfig(config_json()), repo, lambda *a: True, encoder)
    assert "text_encoder_router: routes text_encoder by weights" in caplog.text
    metrics = Recorder()
    entry.use_metrics(metrics)
    entry.tally = entry.server.tally = CallTally(interval_s=3600)
    jobs = {0: entry.job(ids(2), ids(2), {}, "a"), 3: entry.job(ids(), ids(), {"encoder_version": 2}, "b")}
    out = asyncio.run(entry.serve(jobs))
    assert out[0].served == 1 and out[0].vectors.shape == (2, 3)
    assert out[3].error and isinstance(out[3].exception(), Unavailable)  # pinned to a broken version: never moved
    assert metrics.flushes == []  # not due yet
    entry.close()
    assert metrics.flushes == [{(1, "ok"): 1, (2, "error"): 1}]
    entry.tally.interval_s = 0
    asyncio.run(entry.serve({0: entry.job(ids(), ids(), {"encoder_version": 1})}))
    assert metrics.flushes[-1] == {(1, "ok"): 1}
    entry.metrics_on = False
    entry.close()
    assert len(metrics.flushes) == 2


def test_an_outcome_names_its_code_and_its_version_column():
    for outcome, code, field in (
        (Outcome(error="x", invalid=True, internal=True), "invalid_value", "input_ids"),
        (Outcome(error="x", internal=True), "internal", None),
        (Outcome(error="x"), "unavailable", None),
    ):
        data = format_error(outcome.exception())
        assert (parse_error(data).code, parse_error(data).field) == (code, field), data
    column = Outcome(served=2, vectors=np.zeros((3, 4), np.float32)).version_column()
    assert column.dtype == np.int32 and column.tolist() == [[2], [2], [2]]


def test_router_metrics_keep_one_series_per_version_result_and_process():
    pb = make_pb_utils()
    metrics = RouterMetrics(pb, "text_encoder", "text_encoder_router_0_0")
    assert (metrics.calls.name, metrics.latency.name) == (CALLS_METRIC, LATENCY_METRIC + "_bucket")
    tally = CallTally(interval_s=0)
    tally.record(1, "ok", ms=2.5, requests=3)
    tally.record(2, "error", requests=1)
    metrics.flush(tally)
    tally.record(1, "ok", ms=1.0, requests=2)
    metrics.flush(tally)
    series = {(m.labels["version"], m.labels["result"]): m.value for m in metrics.calls.metrics}
    assert series == {("1", "ok"): 5, ("2", "error"): 1} and len(metrics.calls.metrics) == 2
    assert metrics.calls.metrics[0].labels["instance"].startswith("text_encoder_router_0_0/pid")
    le = {m.labels["le"]: m.value for m in metrics.latency.metrics}
    assert (le["1"], le["3"], le["+Inf"]) == (1, 2, 2)
    assert set(map(id, metrics.objects())) == set(
        map(id, [*metrics.calls.metrics, *metrics.latency.metrics, metrics.calls, metrics.latency])
    )


def test_the_shim_routes_each_request_and_answers_each_failure_with_its_code(repo, monkeypatch):
    def bls(request):
        if request.model_version == 2:
            return pb.InferenceResponse(error=pb.TritonError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : bad id"))
        rows = request.inputs["input_ids"].shape[0]
        return pb.InferenceResponse(output_tensors=[pb.Tensor(OUTPUT, np.full((rows, 3), 1.0, np.float32))])

    pb = make_pb_utils(bls)
    shim = load_shim("text_encoder_router", pb, monkeypatch)
    monkeypatch.setattr("python_backends.shim_base.freeze_loaded_objects", lambda: 0)
    args = {"model_config": config_json("1:100"), "model_repository": str(repo / "text_encoder_router"), "model_version": "1"}
    shim.initialize(args)
    batch = [
        Request("a", input_ids=ids(2), attention_mask=ids(2)),
        Request("b", input_ids=ids(), attention_mask=ids(length=3)),
        Request("c", {"encoder_version": 2}, input_ids=ids(), attention_mask=ids()),
        Request("d", {"encoder_version": 7}, input_ids=ids(), attention_mask=ids()),
    ]
    a, b, c, d = asyncio.run(shim.execute(batch))
    assert a.output(OUTPUT).shape == (2, 3) and a.output("encoder_version").tolist() == [[1], [1]]
    assert b.error().code() == d.error().code() == c.error().code() == pb.TritonError.INVALID_ARG
    data = parse_error(c.error().message())
    assert (data.code, data.field) == ("invalid_value", "input_ids")
    assert data.message.startswith("input_ids: text_encoder version 2: ")
    kept = []
    monkeypatch.setattr("python_backends.shim_base.keep_metrics", lambda *objects: kept.extend(objects))
    shim.finalize()  # flushes the last counts first
    results = {(m.labels["version"], m.labels["result"]): m.value for m in shim.metrics.calls.metrics}
    assert results == {("1", "ok"): 1, ("2", "rejected"): 1}
    assert shim.metrics.calls in kept and all(m in kept for m in shim.metrics.calls.metrics)
