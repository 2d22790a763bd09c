"""text_encoder batches requests of different lengths together (allow_ragged_batch) and each
gets the embedding it gets alone; a malformed request in such a batch fails alone."""

from __future__ import annotations

import time

import gevent
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def _inputs(ids, mask=None):
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.ones_like(ids) if mask is None else np.asarray(mask, dtype=np.int64)
    a = httpclient.InferInput("input_ids", list(ids.shape), "INT64")
    a.set_data_from_numpy(ids)
    m = httpclient.InferInput("attention_mask", list(mask.shape), "INT64")
    m.set_data_from_numpy(mask)
    return [a, m]


def _stats(client):
    (stats,) = client.get_inference_statistics("text_encoder")["model_stats"]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_mixed_lengths_batch_together_and_match_their_single_runs(http_client, triton):
    rng = np.random.default_rng(7)
    rows = []
    for n in rng.integers(8, 129, size=24):
        rows.append([101, *rng.integers(1000, 30000, size=int(n) - 2).tolist(), 102])
    alone = [http_client.infer("text_encoder", _inputs([r])).as_numpy("sentence_embedding")[0] for r in rows[:6]]
    # a padded request (the tokenizer's bucket) and a two-row request of different lengths
    padded = np.zeros((1, 128), np.int64)
    padded[0, : len(rows[0])] = rows[0]
    pair_width = max(len(rows[1]), len(rows[2]))
    pair = np.zeros((2, pair_width), np.int64)
    for k, r in enumerate(rows[1:3]):
        pair[k, : len(r)] = r
    # Two requests of max_batch_size long rows first, one per instance (they cannot merge with
    # anything), so the burst behind them queues for certain: on a fast machine, requests sent
    # one after another each finished before the next arrived and none merged.
    blocker = np.tile(np.asarray([101, *range(2000, 2126), 102], np.int64), (64, 1))
    before = _stats(http_client)
    burst = httpclient.InferenceServerClient(triton.http_url, concurrency=len(rows) + 4)
    blockers = [burst.async_infer("text_encoder", _inputs(blocker)) for _ in range(2)]
    gevent.sleep(0.05)  # the client's greenlets send the blockers; both instances start on them
    jobs = [burst.async_infer("text_encoder", _inputs([r])) for r in rows]
    extra = [
        burst.async_infer("text_encoder", _inputs(padded, (padded != 0).astype(np.int64))),
        burst.async_infer("text_encoder", _inputs(pair, (pair != 0).astype(np.int64))),
    ]
    got = [j.get_result().as_numpy("sentence_embedding")[0] for j in jobs]
    extra_results = [e.get_result() for e in extra]
    assert all(b.get_result().as_numpy("sentence_embedding").shape == (64, 384) for b in blockers)
    burst.close()
    for k in range(6):
        np.testing.assert_allclose(got[k], alone[k], atol=1e-4)
    np.testing.assert_allclose(extra_results[0].as_numpy("sentence_embedding")[0], alone[0], atol=1e-4)
    np.testing.assert_allclose(extra_results[1].as_numpy("sentence_embedding"), np.stack(alone[1:3]), atol=1e-4)
    # Triton records an execution's statistics after its responses are sent: wait for them.
    deadline = time.monotonic() + 10
    while True:
        after = _stats(http_client)
        inferences, executions = after[0] - before[0], after[1] - before[1]
        if inferences >= 27 + 128 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    # 27 rows of 26 different lengths behind the two blockers: without ragged batching every
    # request would run alone (26 executions); queued, they merge into a few batches.
    print(f"burst: 27 rows in {executions - 2} executions")
    assert inferences == 27 + 128 and executions - 2 <= 13, (inferences, executions)
    assert "ragged batches of at most" in triton.log_path.read_text()


def test_mismatched_mask_fails_alone_in_a_mixed_batch(http_client):
    good = [[101, 7592, 2088, 102], [101, 7592, 2088, 1010, 2088, 1010, 2088, 102]]
    jobs = [http_client.async_infer("text_encoder", _inputs([good[i % 2]])) for i in range(8)]
    bad = http_client.async_infer("text_encoder", _inputs([[101, 7592, 2088, 102]], [[1, 1, 1]]))
    with pytest.raises(InferenceServerException, match="attention_mask.*differs from input_ids"):
        bad.get_result()
    expected = [http_client.infer("text_encoder", _inputs([g])).as_numpy("sentence_embedding") for g in good]
    for i, job in enumerate(jobs):
        np.testing.assert_allclose(job.get_result().as_numpy("sentence_embedding"), expected[i % 2], atol=1e-4)
