"""A short run of perf.bench.tail: both servers at once, phases interleaved, every figure present and sane.

Asserts that the benchmark ran and wrote its table, never the size of the figures (these
machines are small and shared); the before/after comparison itself is docs/performance.md.
"""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from perf.bench import tail

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


def test_before_repository_turns_the_generation_admission_window_off(tmp_path):
    repo = tail.before_repository(tail.ROOT / "model_repository", tmp_path / "repo")
    before = (repo / "text_generation" / "config.pbtxt").read_text()
    shipped = (tail.ROOT / "model_repository" / "text_generation" / "config.pbtxt").read_text()
    assert 'key: "admission_window_ms" value: { string_value: "0" }' in before
    assert 'key: "admission_window_ms" value: { string_value: "0" }' not in shipped
    assert before.count("admission_window_ms") == shipped.count("admission_window_ms")


def _point(workload, p50, p99, peak, errors=0, ttft=None):
    ttft_p50, ttft_p99, ttft_max = ttft or (None, None, None)
    return tail.Window(
        "after",
        workload,
        32,
        requests=100,
        errors=errors,
        rps=10.0,
        p50_ms=p50,
        p99_ms=p99,
        max_ms=peak,
        p99_range=(p99, p99),
        client_cores=0.1,
        server_cores=1.0,
        server_wait_cores=0.2,
        machine_cores=1.5,
        ttft_p50_ms=ttft_p50,
        ttft_p99_ms=ttft_p99,
        ttft_max_ms=ttft_max,
    )


def test_targets_table_checks_each_target_and_the_long_window():
    results = [
        _point("text_embedding", 10, 29, 49),
        _point("text_embedding_cached_hits", 3, 51, 60),
        _point("gateway_embeddings_unique", 10, 31, 40),
        _point("text_generation_stream", 1000, 1500, 6000, ttft=(200, 700, 900)),
    ]
    rows = {r["target"]: r for r in tail.targets(results, 32, long=True)}
    met = {k: v["met"] for k, v in rows.items()}
    assert met == {
        "text_embedding, c32: P99 <= 3 x P50": True,
        "text_embedding, c32: max <= 5 x P50 (long window)": True,
        "text_embedding_cached_hits, c32: P99 <= 50 ms": False,
        "text_embedding_cached_hits, c32: max <= 5 x P50 (long window)": False,
        "text_generation_stream, c32: answer P99 <= 3 x P50": True,
        "text_generation_stream, c32: TTFT P99 <= 3 x P50": False,
        "text_generation_stream, c32: max <= 5 x P50 (long window)": False,
        "text_generation_stream, c32: TTFT max <= 5 x P50 (long window)": True,
        "gateway_embeddings_unique, c32: P99 <= 3 x P50": False,
        "gateway_embeddings_unique, c32: max <= 5 x P50 (long window)": True,
    }
    assert not any("long window" in r["target"] for r in tail.targets(results, 32))
    table = tail.targets_table(list(rows.values()))
    assert "| text_generation_stream, c32: TTFT P99 <= 3 x P50 | 3.50 | FAIL |" in table
    assert "machine 1.50" in table
    # An errored point never passes.
    assert not tail.targets([_point("text_embedding", 10, 11, 12, errors=1)], 32)[0]["met"]


def test_long_mode_is_one_window_at_concurrency_32():
    args = tail.parse_args(["--long", "60", "--workloads", "text_embedding"])
    assert (args.rounds, args.duration, args.concurrency_list) == (1, 60, [32])
    assert tail.parse_args(["--long", "5", "--concurrency", "8"]).concurrency_list == [8]


def test_short_tail_run_interleaves_both_phases(tmp_path):
    code = tail.main(
        [
            "--workloads",
            "text_tokenizer,text_embedding_cached_hits",
            "--concurrency",
            "4",
            "--rounds",
            "2",
            "--duration",
            "1",
            "--warmup",
            "0.5",
            "--out-dir",
            str(tmp_path),
        ]
    )
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").is_file() else "(no summary.md)"
    assert code == 0, summary
    with (tmp_path / "tail.csv").open() as f:
        rows = list(csv.DictReader(f))
    # A B, then B A: both phases see the same stretch of the machine.
    assert [(r["workload"], r["round"], r["phase"]) for r in rows] == [
        (w, rnd, p)
        for w in ("text_tokenizer", "text_embedding_cached_hits")
        for rnd, order in (("1", ("after", "before")), ("2", ("before", "after")))
        for p in order
    ], summary
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


def test_gateway_wrk_scripts_carry_the_key_and_the_openai_body():
    work = tail.workloads("n0nce", ["one", "two"], api_key="sk-test")
    unique = tail.wrk_script(work["gateway_embeddings_unique"], ["one", "two"], "n0nce")
    assert "path = '/v1/embeddings'" in unique and "[ [=[Authorization]=] ] = [=[Bearer sk-test]=]" in unique
    assert '\\"model\\": \\"text_embedding\\"' not in unique and '"model": "text_embedding"' in unique
    hits = tail.wrk_script(work["gateway_embeddings_hits"], ["one", "two"], "n0nce")
    assert '[=[{"model": "text_embedding", "input": "two", "encoding_format": "float"}]=]' in hits
    for name in tail.STREAM_WORKLOADS:
        with pytest.raises(ValueError):
            tail.wrk_script(work[name], [], "n0nce")
