"""perf.bench.trace_report on a hand-made Triton trace: the slow requests' breakdown and the idle gaps."""

from __future__ import annotations

import json

import pytest

from perf.bench import trace_report


def _ts(**ns):
    return [{"name": k, "ns": v} for k, v in ns.items()]


def make_trace(tmp_path):
    ms = 1_000_000
    records = []
    tid = 1
    # Ten ensemble requests; each has a tokenizer step and an encoder step (one execution each,
    # the encoder's executions back to back), except request 9, whose encoder execution starts
    # 500 ms after the previous one ended while it had been queued since then.
    for i in range(10):
        start = i * 20 * ms
        delay = 500 * ms if i == 9 else 0
        top, tok, enc = tid, tid + 1, tid + 2
        tid += 3
        end = start + 12 * ms + delay
        records.append(
            {
                "id": top,
                "model_name": "text_embedding",
                "model_version": 1,
                "timestamps": _ts(REQUEST_START=start, REQUEST_END=end),
            }
        )
        records.append({"id": tok, "parent_id": top, "model_name": "text_tokenizer", "model_version": 1})
        records.append(
            {
                "id": tok,
                "timestamps": _ts(
                    REQUEST_START=start,
                    QUEUE_START=start,
                    COMPUTE_START=start + ms,
                    COMPUTE_END=start + 2 * ms,
                    REQUEST_END=start + 2 * ms,
                ),
            }
        )
        records.append(
            {
                "id": enc,
                "parent_id": top,
                "model_name": "text_encoder",
                "model_version": 1,
                "timestamps": _ts(
                    REQUEST_START=start + 2 * ms,
                    QUEUE_START=start + 2 * ms,
                    COMPUTE_START=start + 2 * ms + delay,
                    COMPUTE_END=end,
                    REQUEST_END=end,
                ),
            }
        )
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(records))
    return path


def test_report_finds_the_slow_request_and_the_stall(tmp_path):
    spans = trace_report.load(make_trace(tmp_path))
    r = trace_report.analyse(spans)
    assert r.requests == 10 and r.max_ms == pytest.approx(512.0)
    assert r.slowest_parts["text_encoder queue"] == pytest.approx(500.0)
    assert r.median_parts["text_encoder compute"] == pytest.approx(10.0)
    assert r.executions["text_encoder"]["executions"] == 10
    # The encoder sat idle for 500 ms with request 9 in its queue (queued at 182 ms, after
    # request 8's execution ended at 172 ms; executed at 682 ms).
    assert r.executions["text_encoder"]["max_gap_ms"] == pytest.approx(500.0)
    text = trace_report.markdown(r)
    assert "| text_encoder | 10 |" in text and "500.0 |" in text


def test_a_trace_without_the_model_is_refused(tmp_path):
    (tmp_path / "t.json").write_text("[]")
    with pytest.raises(ValueError, match="no complete text_embedding request"):
        trace_report.analyse(trace_report.load(tmp_path / "t.json"))


def test_cli_reads_an_existing_trace(tmp_path, capsys):
    out = tmp_path / "report.md"
    assert trace_report.main(["--trace-file", str(make_trace(tmp_path)), "--out", str(out)]) == 0
    assert "10 traced requests" in capsys.readouterr().out and out.is_file()
    with pytest.raises(SystemExit):
        trace_report.main(["--encoder-layout", "2by1"])
