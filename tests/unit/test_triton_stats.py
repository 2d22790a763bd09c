"""perf.lib.triton_stats: per-model figures from two snapshots of Triton's statistics."""

from __future__ import annotations

import pytest

from perf.lib import triton_stats


def entry(name, version, success, success_ns, queue_ns, infer_ns, inferences, executions):
    return {
        "name": name,
        "version": version,
        "inference_count": inferences,
        "execution_count": executions,
        "inference_stats": {
            "success": {"count": success, "ns": success_ns},
            "queue": {"count": success, "ns": queue_ns},
            "compute_infer": {"count": executions, "ns": infer_ns},
            "fail": {"count": 0, "ns": 0},
        },
    }


def test_delta_gives_means_per_request_and_the_mean_batch():
    before = {
        "text_encoder@1": entry("text_encoder", "1", 100, 10**9, 10**8, 5 * 10**8, 100, 50),
        "text_embedding@1": entry("text_embedding", "1", 100, 0, 0, 0, 100, 100),
    }
    after = {
        "text_encoder@1": entry("text_encoder", "1", 300, 3 * 10**9, 5 * 10**8, 15 * 10**8, 300, 75),
        "text_embedding@1": entry("text_embedding", "1", 300, 0, 0, 0, 300, 300),
        "idle@1": entry("idle", "1", 0, 0, 0, 0, 0, 0),
    }
    got = triton_stats.delta(before, after, skip=("text_embedding",))
    assert list(got) == ["text_encoder"]  # the skipped ensemble and the idle model are left out
    enc = got["text_encoder"]
    assert enc.success_count == 200 and enc.avg_batch == 200 / 25
    assert enc.breakdown_ms["queue"] == pytest.approx(4e8 / 200 / 1e6)
    assert enc.breakdown_ms["compute infer"] == pytest.approx(1e9 / 200 / 1e6)
    assert enc.avg_request_latency_ms == pytest.approx(2e9 / 200 / 1e6)


def test_a_version_loaded_in_between_counts_from_zero_and_versions_stay_apart():
    before = {"text_encoder@1": entry("text_encoder", "1", 10, 10**7, 0, 10**7, 10, 10)}
    after = {
        "text_encoder@1": entry("text_encoder", "1", 20, 2 * 10**7, 0, 2 * 10**7, 20, 20),
        "text_encoder@2": entry("text_encoder", "2", 5, 10**7, 0, 10**7, 5, 1),
    }
    got = triton_stats.delta(before, after)
    assert set(got) == {"text_encoder@1", "text_encoder@2"}
    assert got["text_encoder@2"].avg_batch == 5.0 and got["text_encoder@1"].success_count == 10


def test_fetch_delta_never_raises_when_the_server_is_gone():
    assert triton_stats.fetch_delta("127.0.0.1:9", {}) == {}
