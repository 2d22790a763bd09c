"""The router's failure isolation without Triton (python_backends/routing/serving.py): a fake
encoder that refuses ids beyond its vocabulary the way text_encoder does (INVALID_ARG for the
request that holds one), versions that fail, and bugs inside one group."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from python_backends.routing.router import CallTally, Decision
from python_backends.routing.serving import CallError, GroupServer, Job, call_error

VOCAB = 1000


class FakeEncoder:
    """Row vector = [version, sum of ids]; any row with an id >= VOCAB fails the whole call."""

    def __init__(self, broken=(), rejects_all=(), wrong_rows=()):
        self.broken, self.rejects_all, self.wrong_rows = set(broken), set(rejects_all), set(wrong_rows)
        self.calls: list[tuple[int, int]] = []  # (version, rows)

    async def __call__(self, version, ids, mask):
        self.calls.append((version, ids.shape[0]))
        await asyncio.sleep(0)
        if version in self.broken:
            raise CallError(f"version {version} is down")
        if version in self.rejects_all or (ids >= VOCAB).any():
            raise CallError("indices element out of data bounds", invalid=True)
        if version in self.wrong_rows:
            return np.zeros((ids.shape[0] + 1, 2), np.float32)
        return np.stack([np.full(ids.shape[0], version), ids.sum(axis=1)], axis=1).astype(np.float32)


def job(first_id, rows=1, length=4, version=1, pinned=False):
    ids = np.full((rows, length), 1, np.int64)
    ids[:, 0] = first_id + np.arange(rows)
    return Job(ids, np.ones_like(ids), Decision(version, pinned))


def serve(jobs, encoder, weights=None, fallback=True, ready=(1, 2), ready_fn=None):
    tally = CallTally()
    warnings = []
    server = GroupServer(
        "text_encoder",
        weights or {1: 90, 2: 10},
        fallback,
        ready_fn or (lambda: list(ready)),
        encoder,
        tally,
        lambda *a: warnings.append(a),
    )
    out = asyncio.run(server.serve(jobs))
    assert sorted(out) == sorted(jobs)  # exactly one outcome per request
    return out, tally.drain()[0], warnings


def expected(j, version):
    return np.stack([np.full(j.ids.shape[0], version), j.ids.sum(axis=1)], axis=1).astype(np.float32)


def test_one_out_of_vocabulary_row_fails_only_its_request():
    jobs = {i: job(10 * i + 1, rows=2) for i in range(8)}
    jobs[5] = job(VOCAB + 7)  # one id beyond the vocabulary
    encoder = FakeEncoder()
    out, results, _ = serve(jobs, encoder, weights={1: 100}, ready=(1,))
    assert out[5].error and out[5].invalid and "out of data bounds" in out[5].error
    for i in set(jobs) - {5}:
        assert out[i].error is None and out[i].served == 1
        np.testing.assert_array_equal(out[i].vectors, expected(jobs[i], 1))
    assert encoder.calls[0] == (1, 15)  # one call for the group first
    assert sorted(encoder.calls[1:]) == sorted([(1, 2)] * 7 + [(1, 1)])  # then one per request
    # requests, not calls; the client's bad row is no error of the version
    assert results == {(1, "ok"): 7, (1, "rejected"): 1}


def test_a_bad_request_on_the_canary_is_not_a_canary_error_when_the_stable_rejects_it_too():
    jobs = {0: job(1, version=2), 1: job(VOCAB, version=2), 2: job(3, version=1)}
    out, results, warnings = serve(jobs, FakeEncoder())
    assert out[0].served == 2 and out[2].served == 1
    assert out[1].invalid and out[1].served is None
    assert results == {(2, "ok"): 1, (1, "ok"): 1, (2, "rejected"): 1, (1, "rejected"): 1}
    assert warnings == []


def test_a_broken_canary_falls_back_and_counts_one_error_per_request():
    jobs = {i: job(i + 1, version=2) for i in range(5)}
    jobs[9] = job(50, version=2, length=8)  # another group (length)
    out, results, warnings = serve(jobs, FakeEncoder(broken={2}))
    assert all(o.served == 1 and o.error is None for o in out.values())
    np.testing.assert_array_equal(out[3].vectors, expected(jobs[3], 1))
    assert results == {(2, "error"): 6, (1, "ok"): 6}
    assert warnings


def test_pinned_requests_never_move_and_fail_unavailable():
    jobs = {0: job(1, version=2, pinned=True), 1: job(2, version=2, pinned=True)}
    out, results, _ = serve(jobs, FakeEncoder(broken={2}))
    assert all(o.error and not o.invalid and not o.internal and "version 2 is down" in o.error for o in out.values())
    assert results == {(2, "error"): 2}


def test_without_fallback_only_the_version_is_tried():
    encoder = FakeEncoder(broken={2})
    out, results, _ = serve({0: job(1, version=2)}, encoder, fallback=False)
    assert out[0].error and encoder.calls == [(2, 1)] and results == {(2, "error"): 1}


def test_a_canary_that_rejects_what_the_stable_serves_is_tallied_an_error():
    out, results, _ = serve({0: job(1, version=2), 1: job(2, version=2)}, FakeEncoder(rejects_all={2}))
    assert all(o.served == 1 for o in out.values())
    assert results == {(2, "error"): 2, (1, "ok"): 2}


def test_a_reply_with_the_wrong_rows_is_a_failed_call():
    out, results, _ = serve({0: job(1, version=2), 1: job(2, version=2)}, FakeEncoder(wrong_rows={2}))
    assert all(o.served == 1 for o in out.values())
    assert results == {(2, "error"): 2, (1, "ok"): 2}


def test_an_exception_in_one_group_fails_only_that_group():
    def ready():
        raise RuntimeError("boom")  # a bug on the fallback path of version 2's group

    jobs = {
        0: job(1, version=1),
        1: job(2, version=1),
        2: job(3, version=2),
        3: job(4, version=2, length=8),
        4: job(5, version=2, length=8),
    }
    out, results, _ = serve(jobs, FakeEncoder(broken={2}), ready_fn=ready)
    assert out[0].served == 1 and out[1].served == 1  # version 1's group is untouched
    for i in (2, 3, 4):  # a single-request group and a two-request group, both failing inside
        assert out[i].internal and "boom" in out[i].error
    assert results[(1, "ok")] == 2


@pytest.mark.parametrize("failing", ["error", "invalid"])
def test_every_request_is_answered_when_every_version_fails(failing):
    encoder = FakeEncoder(broken={1, 2}) if failing == "error" else FakeEncoder(rejects_all={1, 2})
    out, results, _ = serve({i: job(i + 1) for i in range(3)}, encoder)
    assert all(o.error for o in out.values())
    assert all(o.invalid == (failing == "invalid") for o in out.values())


def test_invalid_input_is_recognised_by_onnx_runtimes_wording():
    assert call_error("x", invalid_code=True).invalid
    assert call_error(
        "text_encoder: inputs: [ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code "
        "returned while running Gather node"
    ).invalid
    assert call_error("onnx runtime error 2: Non-zero status code returned while running Gather node").invalid
    assert not call_error("text_encoder: internal error: [ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : oom").invalid
    assert not call_error("Request for unknown model: 'text_encoder' version 2 is not found").invalid


def test_the_python_onnxruntime_backends_error_data_decides_before_its_words():
    from contract.errors import InputError, Overloaded, format_error

    refused = call_error("in BLS, " + format_error(InputError("input_ids", "token id 99999 is out of range")))
    assert refused.invalid and "#error-data" not in str(refused)
    # Data that says the model was busy wins over words that look like a refusal.
    assert not call_error(format_error(Overloaded("INVALID_ARGUMENT queue full"))).invalid
