"""perf/bench/sweep.py's pure helpers (no server), its baseline preset and the checked-in mixed-length sentences."""

from __future__ import annotations

import csv
import json

import pytest

from perf.bench import sweep

TOKENIZER = sweep.REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json"


def test_rates_from_peak():
    assert sweep.rates_from_peak(400.0, [0.25, 0.5, 0.7, 0.9]) == [100.0, 200.0, 280.0, 360.0]
    assert sweep.rates_from_peak(2.0, [0.1, 0.2, 0.5]) == [1.0]  # at least 1 req/s, no duplicates
    assert sweep.rates_from_peak(None, [0.5]) == []
    assert sweep.rates_from_peak(0.0, [0.5]) == []


def test_window_requests():
    assert sweep.window_requests(300.0, 2.0, 20, 500) == 500
    assert sweep.window_requests(50.0, 2.0, 20, 500) == 100
    assert sweep.window_requests(3.0, 2.0, 20, 500) == 20
    assert sweep.window_requests(None, 2.0, 20, 500) == 20


def _rows():
    from perf.lib.harness import Row
    from perf.lib.perf_analyzer import Measurement, ModelStats

    def row(kind, level, throughput=None, p50=None, p99=None, **kw):
        load = f"c{level:g}" if kind == "concurrency" else f"Poisson {level:g}/s"
        tags = {"model": "text_embedding", "data": "16tok"}
        return Row(
            f"k{level}", "text_embedding-16tok", "grpc", load, throughput, p50, p99, kind=kind, level=level, tags=tags, **kw
        )

    encoder = ModelStats("text_encoder", "1", 52, 10, 52, 20.0, {"queue": 3.0, "compute infer": 17.0})
    m = Measurement(300.0, 26.0, 30.0, 35.0, 45.0, concurrency=8, composing={"text_encoder": encoder})
    return [
        row("concurrency", 1, 100.0, 8.0, 12.0),
        row("concurrency", 8, 300.0, 26.0, 45.0, measurement=m),
        row("rate", 210, 200.0, 12.0, 36.0, note="achieved 95% of the asked rate"),
        row("rate", 270, error="time budget used up"),
    ]


def test_peak_and_summary():
    rows = _rows()
    assert sweep.peak(rows, "text_embedding-16tok", "grpc") is rows[1]
    assert sweep.peak(rows, "text_embedding-16tok", "http") is None
    md = "\n".join(sweep.summary(rows, ["# title"]))
    assert md.startswith("# title")
    assert "| text_embedding-16tok | grpc | c8 | 300.0 | 26.0 | 45.0 | 1.73 |  |" in md
    assert "| text_embedding-16tok | grpc | Poisson 210/s | 200.0 | 12.0 | 36.0 | 3.00 | achieved 95% of the asked rate |" in md
    assert "| failed: time budget used up |" in md
    assert "Peak of text_embedding-16tok: grpc 300.0 infer/s at c8." in md
    assert "| k8 | text_encoder | 3.0 |  | 17.0 |  | 5.20 |" in md  # the server side, per step


def test_csv_and_plots(tmp_path):
    from perf.lib.harness import write_csv

    rows = _rows()
    write_csv(tmp_path / "sweep.csv", [r.record() for r in rows])
    with (tmp_path / "sweep.csv").open() as f:
        records = list(csv.DictReader(f))
    assert len(records) == 4
    assert records[1]["kind"] == "concurrency" and float(records[1]["throughput"]) == 300.0 and records[1]["data"] == "16tok"
    assert records[1]["text_encoder_avg_batch"] == "5.2" and records[0]["text_encoder_avg_batch"] == ""
    assert records[3]["error"] == "time budget used up"
    pngs = sweep.plot(rows, tmp_path)
    assert sorted(p.name for p in pngs) == [
        "latency_vs_throughput_text_embedding-16tok.png",
        "throughput_vs_concurrency_text_embedding-16tok.png",
    ]
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_parse_args_quick_and_full():
    quick = sweep.parse_args(["--quick"])
    assert quick.models == ["text_embedding"] and quick.protocols == ["grpc"] and quick.concurrency == [1, 8]
    assert quick.rate_fractions == [0.7] and quick.time_budget <= 90
    full = sweep.parse_args([])
    assert full.models == ["text_embedding", "image_classification"] and full.protocols == ["grpc", "http"]
    assert full.concurrency == [1, 2, 4, 8, 16, 32] and full.rate_fractions == [0.25, 0.5, 0.7, 0.9]
    with pytest.raises(SystemExit):
        sweep.parse_args(["--models", "nope"])
    with pytest.raises(SystemExit):
        sweep.parse_args(["--url", "127.0.0.1:8001"])  # one URL, two protocols


def test_baseline_is_the_minimal_preset_of_the_sweep(monkeypatch, tmp_path):
    from perf.bench import baseline

    seen = []
    monkeypatch.setattr(sweep, "run", lambda args: seen.append(args) or 0)
    assert baseline.main(["--url", "127.0.0.1:8001", "--concurrency", "1,4", "--out-dir", str(tmp_path)]) == 0
    (args,) = seen
    assert args.models == ["text_embedding"] and args.protocols == ["grpc"] and args.text_data == ["16tok"]
    assert args.concurrency == [1, 4] and args.no_rates and args.window_s == 0 and args.request_count == 400
    assert args.url == "127.0.0.1:8001" and args.out_dir == tmp_path


def test_mixed_sentences_cover_several_lengths():
    data = json.loads(sweep.TEXT_DATA["mixed"].read_text())["data"]
    texts = [t for entry in data for t in entry["TEXT"]["content"]]
    assert len(texts) >= 10
    if not TOKENIZER.is_file():
        pytest.skip("tokenizer not exported (make export)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_truncation()
    tok.no_padding()
    lengths = [len(tok.encode(t).ids) for t in texts]  # [CLS] and [SEP] included
    for target in (8, 16, 32, 64, 128):
        assert any(abs(n - target) <= max(1, target // 16) for n in lengths), (target, lengths)
    assert max(lengths) <= 128  # the tokenizer's largest bucket below max_sequence_length
