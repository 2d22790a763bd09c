"""perf.bench.autotune's pure parts: the grid, the choice of a winner, the config it writes."""

from __future__ import annotations

import pytest

from perf.bench import autotune
from perf.bench.autotune import Candidate, Score, trial

SERVED = {
    "name": "text_encoder",
    "backend": "onnxruntime",
    "max_batch_size": 64,
    "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": ["-1"]}],
    "output": [{"name": "sentence_embedding", "data_type": "TYPE_FP32", "dims": ["384"]}],
    "dynamic_batching": {"max_queue_delay_microseconds": "2000", "preferred_batch_size": [8], "priority_levels": "2"},
    "instance_group": [{"name": "text_encoder_0", "count": 1, "kind": "KIND_CPU"}],
    "parameters": {"intra_op_thread_count": {"string_value": "0"}, "inter_op_thread_count": {"string_value": "1"}},
}


def score(c: Candidate, *runs: tuple[float, float]) -> Score:
    s = Score(c)
    for i, (throughput, p99) in enumerate(runs):
        s.trials.append(trial(c, i + 1, throughput=throughput, p50_ms=p99 / 2, p99_ms=p99))
    return s


def test_grid_gives_every_instance_count_the_same_cores():
    grid = autotune.candidates([0, 2000], [0, 16, 128], [1, 2, 3], cores=2, max_batch=64)
    assert len(grid) == 2 * 2 * 3  # preferred 128 > max_batch_size is dropped
    assert {(c.instances, c.threads) for c in grid} == {(1, 2), (2, 1), (3, 1)}
    # Instance counts alternate, so a run cut short by its time budget has tried each.
    assert [c.instances for c in grid[:3]] == [1, 2, 3]


def test_pick_takes_the_fastest_within_the_budget():
    fast_but_slow_tail = score(Candidate(0, 0, 1, 2), (700, 300))
    within = score(Candidate(1000, 0, 2, 1), (600, 90), (640, 100), (500, 95))
    slower = score(Candidate(2000, 0, 2, 1), (550, 80))
    assert within.throughput == 600 and within.p99_ms == 95  # medians
    assert autotune.pick([fast_but_slow_tail, within, slower], budget_ms=120) is within


def test_pick_without_a_feasible_candidate_takes_the_lowest_p99():
    a = score(Candidate(0, 0, 1, 2), (700, 300))
    b = score(Candidate(0, 0, 2, 1), (600, 200))
    failed = Score(Candidate(5000, 0, 1, 2), [trial(Candidate(5000, 0, 1, 2), 1, error="unstable")])
    assert autotune.pick([a, b, failed], budget_ms=100) is b
    assert autotune.pick([failed], budget_ms=100) is None


def test_apply_candidate_sets_batching_instances_and_threads_only():
    config = autotune.apply_candidate(SERVED, Candidate(5000, 16, 2, 1))
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "5000"
    assert config["dynamic_batching"]["preferred_batch_size"] == [16]
    assert config["dynamic_batching"]["priority_levels"] == "2"
    assert config["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
    assert config["parameters"]["intra_op_thread_count"] == {"string_value": "1"}
    assert config["parameters"]["inter_op_thread_count"] == {"string_value": "1"}
    assert SERVED["dynamic_batching"]["max_queue_delay_microseconds"] == "2000"  # the input is untouched
    no_pref = autotune.apply_candidate(SERVED, Candidate(0, 0, 1, 2))
    assert "preferred_batch_size" not in no_pref["dynamic_batching"]


def test_winning_config_is_valid_pbtxt():
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = autotune.to_pbtxt(autotune.apply_candidate(SERVED, Candidate(1000, 32, 2, 1)), "# header\n")
    assert text.startswith("# header\n")
    parsed = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert parsed.dynamic_batching.max_queue_delay_microseconds == 1000
    assert list(parsed.dynamic_batching.preferred_batch_size) == [32]
    assert parsed.instance_group[0].count == 2
    assert parsed.parameters["intra_op_thread_count"].string_value == "1"


def test_summary_marks_the_winner_and_the_untried():
    win = score(Candidate(0, 0, 2, 1), (600, 90))
    lose = score(Candidate(0, 0, 1, 2), (500, 150))
    text = autotune.summary_markdown(["# t"], [lose, win], win, 120, [Candidate(9, 0, 1, 2)], None)
    assert "2 instance(s) x 1 thread(s) **(winner)** | 1 | 600.0" in text
    assert "| no |" in text and "| yes |" in text
    assert "Not tried (time budget): max_queue_delay 9 us" in text


@pytest.mark.parametrize(
    "argv",
    [["--instances", "0"], ["--delays", "a,b"], ["--latency-budget-ms", "0"], ["--rate-fraction", "1.5"], ["--finalists", "0"]],
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        autotune.parse_args(argv)
    assert "error:" in capsys.readouterr().err


def test_a_trial_is_a_harness_row_with_the_candidate_as_columns():
    record = trial(Candidate(2000, 16, 2, 1), 3, 8, throughput=500.0).record()
    assert (record["round"], record["max_queue_delay_us"], record["preferred_batch_size"]) == (3, 2000, 16)
    assert (record["instances"], record["threads"], record["throughput"], record["load"]) == (2, 1, 500.0, "concurrency 8")
