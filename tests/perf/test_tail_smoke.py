"""A short run of perf.tail: both servers at once, phases interleaved, every figure present and sane.

Asserts that the benchmark ran and wrote its table, never the size of the figures (these
machines are small and shared); the before/after comparison itself is docs/performance.md.
"""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from perf import tail

pytestmark = pytest.mark.perf


def test_before_repository_adds_the_stall_settings_only_to_batching_configs(tmp_path):
    repo = tail.before_repository(tail.ROOT / "model_repository", tmp_path / "repo")
    tokenizer = (repo / "text_tokenizer" / "config.pbtxt").read_text()
    assert "priority_levels: 2" in tokenizer and "allow_timeout_override: true" in tokenizer
    assert "priority_levels:" not in (repo / "text_embedding" / "config.pbtxt").read_text()  # an ensemble
    assert (repo / "text_tokenizer" / "1").is_symlink()
    assert "priority_levels:" not in (tail.ROOT / "model_repository" / "text_tokenizer" / "config.pbtxt").read_text()


def test_alt_configs_replace_only_the_configs_given(tmp_path):
    alt = tmp_path / "alt" / "text_tokenizer"
    alt.mkdir(parents=True)
    (alt / "config.pbtxt").write_text("# alt\n")
    repo = tail.before_repository(tail.ROOT / "model_repository", tmp_path / "repo", alt_configs=tmp_path / "alt")
    assert (repo / "text_tokenizer" / "config.pbtxt").read_text() == "# alt\n"
    shipped = (tail.ROOT / "model_repository" / "text_encoder" / "config.pbtxt").read_text()
    assert (repo / "text_encoder" / "config.pbtxt").read_text() == shipped


def test_short_tail_run_interleaves_both_phases(tmp_path):
    code = tail.main(["--workloads", "text_tokenizer,text_embedding_cached_hits", "--concurrency", "4",
                      "--rounds", "2", "--duration", "1", "--warmup", "0.5", "--out-dir", str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").is_file() else "(no summary.md)"
    assert code == 0, summary
    with (tmp_path / "tail.csv").open() as f:
        rows = list(csv.DictReader(f))
    # A B, then B A: both phases see the same stretch of the machine.
    assert [(r["workload"], r["round"], r["phase"]) for r in rows] == [
        (w, rnd, p) for w in ("text_tokenizer", "text_embedding_cached_hits")
        for rnd, order in (("1", ("after", "before")), ("2", ("before", "after"))) for p in order], summary
    client = "wrk" if shutil.which("wrk") else "python"
    for r in rows:
        p50, p99, peak = float(r["p50_ms"]), float(r["p99_ms"]), float(r["max_ms"])
        assert int(r["requests"]) > 0 and int(r["errors"]) == 0, r
        assert 0 < p50 <= p99 <= peak, r
        assert float(r["rps"]) > 0 and r["client"] == client, r
        assert 0 <= float(r["client_cores"]) and 0 < float(r["server_cores"]) <= float(r["machine_cores"]) + 0.5, r
        stats = json.loads(r["stats"])
        assert stats[r["workload"].replace("_hits", "")]["requests"] >= int(r["requests"]), r
    assert "P99 <= 50 ms" in summary and "Where the time goes" in summary
    assert (tmp_path / "tritonserver-after.log").is_file() and (tmp_path / "tritonserver-before.log").is_file()


def test_wrk_scripts_quote_texts_verbatim_and_make_them_unique():
    work = tail.workloads("n0nce", ['say "hi" ]] \\ there'])
    script = tail.wrk_script(work["text_tokenizer"], ['say "hi" ]] \\ there'], "n0nce")
    assert '[=[say \\"hi\\" ]] \\\\ there]=]' in script  # JSON-escaped, in a long bracket that ]] cannot close
    assert "n0nce-' .. tid .. '-' .. n" in script and "/v2/models/text_tokenizer/infer" in script
    assert "math.random(1000, 29999)" in tail.wrk_script(work["text_encoder"], [], "n0nce")
    with pytest.raises(ValueError):
        tail.wrk_script(work["image_classification"], [], "n0nce")
