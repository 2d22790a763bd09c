"""perf/bench/sweep.py's pure helpers (no server) and the checked-in mixed-length sentences."""

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


def _points():
    P = sweep.Point
    return [
        P("text_embedding", "16tok", "grpc", "concurrency", 1, 100.0, 8.0, 9.0, 10.0, 12.0, 8.5, 60),
        P(
            "text_embedding",
            "16tok",
            "grpc",
            "concurrency",
            8,
            300.0,
            26.0,
            30.0,
            35.0,
            45.0,
            27.0,
            60,
            extra={"text_encoder_avg_batch": 5.2},
        ),
        P(
            "text_embedding",
            "16tok",
            "grpc",
            "rate",
            210,
            200.0,
            12.0,
            20.0,
            25.0,
            36.0,
            14.0,
            60,
            note="achieved 95% of the asked rate",
        ),
        P("text_embedding", "16tok", "grpc", "rate", 270, error="time budget used up"),
    ]


def test_peak_and_summary():
    points = _points()
    assert sweep.peak_throughput(points, "text_embedding", "16tok", "grpc") == 300.0
    assert sweep.peak_throughput(points, "text_embedding", "16tok", "http") is None
    md = sweep.summary_markdown(points, ["# title"])
    assert md.startswith("# title")
    assert "| grpc | concurrency | c8 | 300.0 | 26.0 | 45.0 | 1.73 |  |" in md
    assert "| grpc | Poisson rate | 210/s | 200.0 | 12.0 | 36.0 | 3.00 | achieved 95% of the asked rate |" in md
    assert "skipped: time budget used up" in md
    assert "Peak: grpc 300.0 infer/s at c8." in md


def test_csv_and_plots(tmp_path):
    points = _points()
    sweep.write_csv(tmp_path / "sweep.csv", points)
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert rows[1]["kind"] == "concurrency" and float(rows[1]["throughput"]) == 300.0
    assert rows[1]["text_encoder_avg_batch"] == "5.2" and rows[0]["text_encoder_avg_batch"] == ""
    assert rows[3]["error"] == "time budget used up"
    pngs = sweep.plot(points, tmp_path)
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
