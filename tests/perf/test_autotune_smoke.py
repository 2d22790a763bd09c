"""A --quick run of perf.bench.autotune against its own tritonserver: every candidate is reloaded
through the repository API and measured, a winner is chosen and written as a config."""

from __future__ import annotations

import csv
import json
import re

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from perf.bench import autotune
from perf.lib import perf_analyzer as pa

pytestmark = pytest.mark.perf


def test_quick_autotune_measures_the_grid_and_writes_the_winner(tmp_path):
    try:
        pa.check()
    except pa.PerfAnalyzerNotAvailable as exc:
        pytest.fail(str(exc), pytrace=False)
    code = autotune.main(
        ["--quick", "--concurrency", "8", "--latency-budget-ms", "10000", "--time-budget", "150", "--out-dir", str(tmp_path)]
    )
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").is_file() else "(no summary.md)"
    assert code == 0, summary

    with (tmp_path / "search.csv").open() as f:
        trials = list(csv.DictReader(f))
    first = {(t["max_queue_delay_us"], t["instances"], t["threads"]) for t in trials if t["round"] == "1"}
    # --quick: delays 0 and 2000 us x 1 and 2 instances, each instance count on all cores.
    assert first == {("0", "1", "2"), ("0", "2", "1"), ("2000", "1", "2"), ("2000", "2", "1")}, summary
    # Each trial has a figure or the reason it has none ("unstable" happens on these shared
    # machines, and is what the 1 x 2-thread layout's 0.5 s stalls look like at tiny windows).
    assert all((t["error"] == "") == (t["throughput"] != "") for t in trials), summary
    assert sum(t["throughput"] != "" and float(t["throughput"]) > 0 for t in trials) >= 3, summary
    # The reload really changed the served model: two instances, batches of more than one.
    assert any(t["text_encoder_avg_batch"] and float(t["text_encoder_avg_batch"]) > 1.0 for t in trials), summary
    assert any(t["round"] == "2" for t in trials)  # finalists measured again
    assert "**(winner)**" in summary and "P99 / P50 =" in summary

    # The written config is the winner the summary names, and the winner is a finalist of the grid.
    winner = re.search(r"^Winner: max_queue_delay (\d+) us, [^,]+, (\d+) instance\(s\) x (\d+) thread\(s\)", summary, re.M)
    assert winner, summary
    assert winner.groups() in first, (winner.groups(), summary)
    assert any(
        t["round"] == "2" and (t["max_queue_delay_us"], t["instances"], t["threads"]) == winner.groups() for t in trials
    ), summary
    config = text_format.Parse((tmp_path / "text_encoder.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.name == "text_encoder"
    delay, instances, threads = (int(x) for x in winner.groups())
    assert config.dynamic_batching.max_queue_delay_microseconds == delay
    assert config.instance_group[0].count == instances
    assert int(config.parameters["intra_op_thread_count"].string_value) == threads
    body = json.loads((tmp_path / "override.json").read_text())
    assert json.loads(body["parameters"]["config"])["name"] == "text_encoder"
