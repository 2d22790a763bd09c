"""Length-aware grouping of the onnxruntime backend (python_backends.onnx_engine.batching):
token budgets, order restored, rows above the budget, empty and mismatched requests,
failure isolation, and the config that turns it on."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from contract.errors import ConfigError, InputError
from contract.model_config import ModelConfig
from python_backends.onnx_engine.batching import (
    TokenBudget,
    budget_from_config,
    plan_runs,
    row_lengths,
    run_batched,
)

NAMES = ["input_ids", "attention_mask"]


def request(*rows: list[int], width: int | None = None) -> dict[str, np.ndarray]:
    """One request of token-id rows, padded with zeros to ``width`` (default: its longest row)."""
    width = width or max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for k, row in enumerate(rows):
        ids[k, : len(row)] = row
        mask[k, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}


class Recorder:
    """A model: per row, (sum of its real ids, real length, the run's padded width), so a test
    sees that each row got its own tokens back and how it was padded; ids >= 1000 fail the run."""

    def __init__(self) -> None:
        self.feeds: list[dict[str, np.ndarray]] = []

    def __call__(self, feed):
        self.feeds.append(feed)
        if (feed["input_ids"] >= 1000).any():
            raise RuntimeError("id out of range")
        ids, mask = feed["input_ids"], feed["attention_mask"]
        width = np.full(ids.shape[0], ids.shape[1], dtype=np.int64)
        return {"out": np.stack([(ids * mask).sum(axis=1), mask.sum(axis=1), width], axis=1)}

    def padded_tokens(self) -> list[int]:
        return [f["input_ids"].size for f in self.feeds]


def expected(req) -> np.ndarray:
    ids, mask = req["input_ids"], req["attention_mask"]
    return np.stack([(ids * mask).sum(axis=1), mask.sum(axis=1)], axis=1)


def test_row_lengths_are_one_past_the_last_real_token():
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    assert row_lengths(mask).tolist() == [2, 4, 3, 1]  # interior zeros kept; an all-zero row keeps 1
    assert row_lengths(np.zeros((2, 0), dtype=np.int64)).tolist() == [1, 1]


def test_plan_runs_keeps_every_run_within_the_budget_longest_first():
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 129, size=300).tolist()
    for budget in (128, 512, 2048):
        runs = plan_runs(lengths, budget)
        assert sorted(i for run in runs for i in run) == list(range(300))  # each row exactly once
        for run in runs:
            width = lengths[run[0]]
            assert width == max(lengths[i] for i in run)
            assert len(run) * width <= budget or len(run) == 1
        widths = [lengths[run[0]] for run in runs]
        assert widths == sorted(widths, reverse=True)
        # greedy: the next run's first row would not have fitted in the previous run
        for a, _b in itertools.pairwise(runs):
            assert (len(a) + 1) * lengths[a[0]] > budget


def test_plan_runs_row_above_the_budget_runs_alone_and_max_rows_caps():
    assert plan_runs([300, 10, 10], 256) == [[0], [1, 2]]
    assert plan_runs([5] * 10, 1000, max_rows=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert plan_runs([], 100) == []


def test_plan_runs_max_padding_keeps_rows_of_other_lengths_apart():
    lengths = [100, 97, 92, 60, 58, 10]
    assert plan_runs(lengths, 10_000) == [[0, 1, 2, 3, 4, 5]]
    assert plan_runs(lengths, 10_000, max_padding=8) == [[0, 1, 2], [3, 4], [5]]
    assert plan_runs(lengths, 10_000, max_padding=2) == [[0], [1], [2], [3, 4], [5]]
    rng = np.random.default_rng(4)
    lengths = rng.integers(8, 129, size=200).tolist()
    for run in plan_runs(lengths, 2048, max_padding=8):
        assert lengths[run[0]] - min(lengths[i] for i in run) <= 8


def test_ragged_requests_are_trimmed_grouped_and_returned_in_order():
    rng = np.random.default_rng(1)
    requests = []
    for _ in range(20):
        rows = [rng.integers(1, 999, size=int(n)).tolist() for n in rng.integers(8, 129, size=int(rng.integers(1, 4)))]
        requests.append(request(*rows, width=128))  # padded to a bucket, as the tokenizer does
    model = Recorder()
    out = run_batched(requests, NAMES, model, TokenBudget(max_tokens=1024, max_padding=16))
    for req, o in zip(requests, out):
        assert o.error is None
        np.testing.assert_array_equal(o.outputs["out"][:, :2], expected(req))
    assert all(t <= 1024 for t, f in zip(model.padded_tokens(), model.feeds) if f["input_ids"].shape[0] > 1)
    for f in model.feeds:  # no row padded by more than max_padding
        assert (f["attention_mask"].shape[1] - f["attention_mask"].sum(axis=1)).max() <= 16
    # far fewer padded tokens than the requests as sent (every row at 128)
    sent = sum(r["input_ids"].size for r in requests)
    assert sum(model.padded_tokens()) < 0.8 * sent
    # every run is padded to its own longest row: no column is padding in all rows
    for f in model.feeds:
        assert f["attention_mask"][:, -1].any()


def test_one_row_above_the_budget_runs_alone_and_its_neighbours_still_batch():
    long = request(list(range(1, 201)))
    shorts = [request([5] * 10), request([6] * 12, [7] * 9)]
    model = Recorder()
    out = run_batched([shorts[0], long, shorts[1]], NAMES, model, TokenBudget(max_tokens=64))
    assert [o.error for o in out] == [None, None, None]
    assert [f["input_ids"].shape for f in model.feeds] == [(1, 200), (3, 12)]
    np.testing.assert_array_equal(out[1].outputs["out"][:, :2], expected(long))


def test_empty_batch_and_a_request_without_rows():
    model = Recorder()
    assert run_batched([], NAMES, model, TokenBudget(max_tokens=64)) == []
    empty = {"input_ids": np.zeros((0, 4), np.int64), "attention_mask": np.zeros((0, 4), np.int64)}
    out = run_batched([empty, request([1, 2])], NAMES, model, TokenBudget(max_tokens=64))
    assert isinstance(out[0].error, InputError) and "at least one row" in str(out[0].error)
    assert out[1].error is None and out[1].outputs["out"][0, :2].tolist() == [3, 2]


def test_mismatched_rows_fail_only_their_request():
    good = request([1, 2, 3])
    mismatched = {"input_ids": np.ones((1, 5), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    rows_differ = {"input_ids": np.ones((2, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    flat = {"input_ids": np.ones((4,), np.int64), "attention_mask": np.ones((4,), np.int64)}
    missing = {"input_ids": np.ones((1, 4), np.int64)}
    model = Recorder()
    out = run_batched([mismatched, good, rows_differ, flat, missing], NAMES, model, TokenBudget(max_tokens=64))
    assert "attention_mask: shape [1, 4] differs from input_ids's [1, 5]" in str(out[0].error)
    assert "batch size 1 differs" in str(out[2].error)
    assert "expected [batch, sequence]" in str(out[3].error)
    assert "attention_mask: input is missing" in str(out[4].error)
    assert all(isinstance(o.error, InputError) for i, o in enumerate(out) if i != 1)
    assert out[1].error is None and out[1].outputs["out"][0, :2].tolist() == [6, 3]
    assert len(model.feeds) == 1


def test_a_bad_request_fails_alone_and_its_run_neighbours_succeed():
    requests = [request([1] * 10), request([2] * 10, [1500] * 8), request([3] * 9), request([4] * 100)]
    model = Recorder()
    out = run_batched(requests, NAMES, model, TokenBudget(max_tokens=64))
    assert out[1].error is not None and out[1].outputs is None
    for i in (0, 2, 3):
        assert out[i].error is None, out[i].error
        np.testing.assert_array_equal(out[i].outputs["out"][:, :2], expected(requests[i]))


def test_a_failure_outside_the_batch_maps_invalid_argument_to_the_request():
    class InvalidArgument(Exception):
        pass

    def run(feed):
        raise InvalidArgument("index out of range")

    out = run_batched([request([1, 2])], NAMES, run, TokenBudget(max_tokens=64))
    assert isinstance(out[0].error, InputError) and "index out of range" in str(out[0].error)


def test_trimming_matches_the_padded_run_on_a_real_encoder():
    """Equal embeddings whether a row runs padded to 128 or trimmed beside other lengths."""
    from perf.baselines import limit

    served = limit.served_encoder("fp32")
    if not served.model_path.is_file():
        pytest.skip(f"{served.model_path} missing: run `make export`")
    from export import bench

    session = bench.open_cpu_session(served.model_path, 1)

    def run(feed):
        return {"sentence_embedding": session.run(["sentence_embedding"], feed)[0]}

    rows = limit.token_rows([9, 40, 120, 17])
    requests = [request(r.tolist(), width=128) for r in rows]
    grouped = run_batched(requests, NAMES, run, TokenBudget(max_tokens=256))
    for req, o in zip(requests, grouped):
        alone = run(req)["sentence_embedding"]
        np.testing.assert_allclose(o.outputs["sentence_embedding"], alone, atol=2e-5)


def _config(inputs_ragged=(True, True), params=None, output_dims=("384",)):
    raw = {
        "name": "enc",
        "max_batch_size": 64,
        "input": [
            {"name": n, "data_type": "TYPE_INT64", "dims": ["-1"], **({"allow_ragged_batch": True} if r else {})}
            for n, r in zip(NAMES, inputs_ragged)
        ],
        "output": [{"name": "sentence_embedding", "data_type": "TYPE_FP32", "dims": list(output_dims)}],
        "parameters": {k: {"string_value": v} for k, v in (params or {}).items()},
    }
    return ModelConfig(raw)


def test_budget_from_config():
    assert budget_from_config(_config((False, False))) is None
    budget = budget_from_config(_config(params={"max_batch_tokens": "2048"}))
    assert budget == TokenBudget(2048, "attention_mask", 0)
    budget = budget_from_config(_config(params={"max_batch_tokens": "512", "max_batch_rows": "64", "max_row_padding": "8"}))
    assert (budget.max_rows, budget.max_padding) == (64, 8)


@pytest.mark.parametrize(
    "config, message",
    [
        (_config(), "need parameters max_batch_tokens"),
        (_config((True, False), {"max_batch_tokens": "64"}), "on every input"),
        (_config((False, False), {"max_batch_tokens": "64"}), "needs inputs with allow_ragged_batch"),
        (_config(params={"max_batch_tokens": "0"}), "must be >= 1"),
        (_config(params={"max_batch_tokens": "64"}, output_dims=("-1", "384")), "cannot have a variable dimension"),
        (_config(params={"max_batch_tokens": "64", "ragged_length_input": "mask"}), "'mask' is not an input"),
    ],
)
def test_bad_ragged_configs_fail_the_load(config, message):
    with pytest.raises(ConfigError, match=message):
        budget_from_config(config)
