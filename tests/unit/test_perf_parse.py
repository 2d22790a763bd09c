"""perf.lib.perf_analyzer without a server: CSV parsing, command line, failure modes.

The samples were captured from perf_analyzer 2.50 (tritonclient[all]==2.50.0) measuring the
text_embedding ensemble on the local tritonserver 2.51. A fake perf_analyzer (a shell
script) drives measure() through its success and failure paths.
"""

from __future__ import annotations

import json
import stat
import textwrap
from pathlib import Path

import pytest

from perf.lib import perf_analyzer as pa

# `perf_analyzer ... -f out.csv` (no --verbose-csv), concurrency 1.
CSV_PLAIN = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency
1,91.1773,5,3594,1,68,6638,642,3,10326,13670,14475,18131
"""

# Same with --verbose-csv, concurrency 16 (no trailing newline: as perf_analyzer writes it).
CSV_VERBOSE = (
    "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
    "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency,"
    "Avg latency,request/response,response wait\n"
    "16,353.561,3,13049,0,302,29999,1727,1,45432,60456,66217,75630,45084,4,45062"
)

# perf_analyzer's text output for the CSV_VERBOSE run (written to the log; the figures come from the CSV).
REPORT = """\
 Successfully read data for 1 stream/streams with 60 step/steps.
*** Measurement Settings ***
  Batch size: 1
  Service Kind: TRITON
  Using "count_windows" mode for stabilization
  Stabilizing using average latency and throughput
  Minimum number of samples in each window: 300
  Using synchronous calls for inference

Request concurrency: 16
  Client: 
    Request count: 1417
    Throughput: 353.561 infer/sec
    Avg latency: 45084 usec (standard deviation 12187 usec)
    p50 latency: 45432 usec
    p90 latency: 60456 usec
    p95 latency: 66217 usec
    p99 latency: 75630 usec
    Avg gRPC time: 45066 usec ((un)marshal request/response 4 usec + response wait 45062 usec)
  Server: 
    Inference count: 1417
    Execution count: 1417
    Successful request count: 1417
    Avg request latency: 44513 usec (overhead 0 usec + queue 12619 usec + compute 32025 usec)

  Composing models: 
  embedding_pooler, version: 1
      Inference count: 1417
      Execution count: 244
      Successful request count: 1417
      Avg request latency: 6715 usec (overhead 5 usec + queue 4684 usec + compute input 132 usec + compute infer 793 usec + compute output 1100 usec)

  text_encoder, version: 1
      Inference count: 1417
      Execution count: 157
      Successful request count: 1417
      Avg request latency: 34571 usec (overhead 8 usec + queue 6074 usec + compute input 96 usec + compute infer 27924 usec + compute output 468 usec)

  text_tokenizer, version: 1
      Inference count: 1430
      Execution count: 256
      Successful request count: 1430
      Avg request latency: 3376 usec (overhead 5 usec + queue 1861 usec + compute input 73 usec + compute infer 1278 usec + compute output 159 usec)

Inferences/Second vs. Client Average Batch Latency
Concurrency: 16, throughput: 353.561 infer/sec, latency 45084 usec
"""

UNSTABLE = """\
Request concurrency: 4
Failed to obtain stable measurement within 3 measurement windows for concurrency 4. Please try to increase the --measurement-request-count.
Failed to obtain stable measurement.
"""


def test_plain_csv_in_milliseconds():
    (m,) = pa.parse_csv(CSV_PLAIN)
    assert m.concurrency == 1 and isinstance(m.concurrency, int)
    assert m.throughput == pytest.approx(91.1773)
    assert (m.p50_ms, m.p90_ms, m.p95_ms, m.p99_ms) == pytest.approx((10.326, 13.670, 14.475, 18.131))
    assert m.client_send_ms == pytest.approx(0.005) and m.client_recv_ms == pytest.approx(0.003)
    assert m.network_server_send_recv_ms == pytest.approx(3.594)
    assert m.server_queue_ms == pytest.approx(0.001)
    assert m.server_compute_infer_ms == pytest.approx(6.638)
    assert m.avg_ms is None and m.client_response_wait_ms is None  # only with --verbose-csv
    assert m.extra == {} and m.composing == {} and m.server is None


def test_verbose_csv_adds_average_and_client_split():
    (m,) = pa.parse_csv(CSV_VERBOSE)
    assert m.concurrency == 16
    assert m.avg_ms == pytest.approx(45.084)
    assert m.client_request_response_ms == pytest.approx(0.004)
    assert m.client_response_wait_ms == pytest.approx(45.062)
    assert m.p50_ms <= m.p90_ms <= m.p95_ms <= m.p99_ms


def test_columns_matched_by_name_not_position():
    header, row = CSV_PLAIN.strip().splitlines()
    pairs = list(zip(header.split(","), row.split(",")))[::-1] + [("GPU Utilization", "0.5")]
    shuffled = ",".join(h for h, _ in pairs) + "\n" + ",".join(v for _, v in pairs) + "\n"
    (a,), (b,) = pa.parse_csv(CSV_PLAIN), pa.parse_csv(shuffled)
    assert a.as_row() == b.as_row()
    assert b.extra == {"GPU Utilization": "0.5"}


def test_several_rows_and_trailing_metrics_table():
    second = "2,150.5,5,3594,1,68,6638,642,3,11000,14000,15000,19000"
    text = CSV_PLAIN + second + "\n\nGPU metrics\nsomething,else\n1,2\n"
    rows = pa.parse_csv(text)
    assert [r.concurrency for r in rows] == [1, 2]
    assert rows[1].throughput == pytest.approx(150.5)


def test_csv_without_percentiles_is_refused():
    header, row = CSV_PLAIN.strip().splitlines()
    keep = [i for i, h in enumerate(header.split(",")) if h != "p99 latency"]
    cut = lambda line: ",".join(line.split(",")[i] for i in keep)  # noqa: E731
    with pytest.raises(ValueError, match="p99_ms"):
        pa.parse_csv(cut(header) + "\n" + cut(row) + "\n")


def test_csv_with_non_numeric_value_names_the_column():
    with pytest.raises(ValueError, match="p50 latency"):
        pa.parse_csv(CSV_PLAIN.replace("10326", "n/a"))


def test_model_stats_without_executions_has_no_batch():
    assert pa.ModelStats("x").avg_batch is None


def test_as_row_flattens_composing_models():
    (m,) = pa.parse_csv(CSV_VERBOSE)
    composing = {"text_encoder": pa.ModelStats("text_encoder", "1", 1417, 157, 1417, 34.571, {"queue": 6.074})}
    row = pa.Measurement(**{**m.__dict__, "composing": composing}).as_row()
    assert row["p99_ms"] == pytest.approx(75.63)
    assert row["text_encoder_queue_ms"] == pytest.approx(6.074)
    assert row["text_encoder_avg_batch"] == pytest.approx(9.03)
    assert "composing" not in row and "extra" not in row


def test_settings_command_has_the_fixed_flags(tmp_path):
    settings = pa.Settings(model="text_embedding", url="127.0.0.1:8001", concurrency=16, input_data=tmp_path / "d.json")
    cmd = settings.command(Path("/bin/perf_analyzer"), tmp_path / "out.csv")
    joined = " ".join(cmd)
    for flag in (
        "-m text_embedding",
        "-u 127.0.0.1:8001",
        "-i grpc",
        "-b 1",
        "--concurrency-range 16",
        "--measurement-mode count_windows",
        "--measurement-request-count 200",
        "-s 50",
        "--max-trials 5",
        f"-f {tmp_path / 'out.csv'}",
        f"--input-data {tmp_path / 'd.json'}",
        "--verbose-csv",
    ):
        assert flag in joined, flag
    with pytest.raises(ValueError, match="protocol"):
        pa.Settings(model="m", url="u", protocol="rest")
    with pytest.raises(ValueError):
        pa.Settings(model="m", url="u", concurrency=0)


def test_environment_puts_cuda_runtime_first():
    lib = pa.cuda_runtime_lib_dir()
    if lib is None:
        pytest.skip("nvidia-cuda-runtime-cu12 is not installed")
    env = pa.environment({"LD_LIBRARY_PATH": f"/opt/x:{lib}"})
    assert env["LD_LIBRARY_PATH"].split(":") == [str(lib), "/opt/x"]
    assert (lib / "libcudart.so.12").exists()


def test_missing_binary_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(pa.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("PERF_ANALYZER", raising=False)
    with pytest.raises(pa.PerfAnalyzerNotAvailable, match=r"tritonclient\[all\]==2.50.0"):
        pa.find_binary()
    monkeypatch.setenv("PERF_ANALYZER", str(tmp_path / "nope"))
    with pytest.raises(pa.PerfAnalyzerNotAvailable, match="nope"):
        pa.find_binary()


# --------------------------------------------------------------------------- measure() with a fake binary


def fake_binary(tmp_path: Path, body: str) -> Path:
    """A shell script standing in for perf_analyzer; $CSV is the path after -f."""
    path = tmp_path / "perf_analyzer"
    path.write_text(
        '#!/bin/sh\nCSV=""; prev=""\nfor a in "$@"; do [ "$prev" = "-f" ] && CSV="$a"; prev="$a"; done\n' + textwrap.dedent(body)
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def settings(**kw) -> pa.Settings:
    return pa.Settings(model="text_embedding", url="127.0.0.1:1", **{"timeout_s": 30.0, **kw})


def test_measure_reads_csv_and_report(tmp_path):
    (tmp_path / "sample.csv").write_text(CSV_VERBOSE)
    (tmp_path / "report.txt").write_text(REPORT)
    binary = fake_binary(tmp_path, f'cp {tmp_path}/sample.csv "$CSV"\ncat {tmp_path}/report.txt\n')
    log = tmp_path / "logs" / "c16.log"
    m = pa.measure(settings(concurrency=16), tmp_path / "out" / "c16.csv", log_path=log, binary=binary, env={})
    assert m.throughput == pytest.approx(353.561) and m.p99_ms == pytest.approx(75.63)
    assert m.server is None and m.composing == {}  # server figures come from Triton's statistics (perf.lib.harness)
    assert log.read_text().startswith(f"$ {binary} -m text_embedding")
    assert "Composing models" in log.read_text()


def test_measure_unstable(tmp_path):
    (tmp_path / "unstable.txt").write_text(UNSTABLE)
    binary = fake_binary(tmp_path, f"cat {tmp_path}/unstable.txt\nexit 2\n")
    stale = tmp_path / "c4.csv"
    stale.write_text(CSV_PLAIN)  # a previous run's file must not be taken for this run's
    with pytest.raises(pa.PerfAnalyzerUnstable, match="no stable measurement at concurrency 4") as info:
        pa.measure(settings(concurrency=4), stale, binary=binary, env={})
    assert "Failed to obtain stable measurement" in info.value.output
    assert not stale.exists()


def test_measure_failure_keeps_output(tmp_path):
    binary = fake_binary(tmp_path, 'echo "error: failed to get model metadata: Request for unknown model"\nexit 1\n')
    with pytest.raises(pa.PerfAnalyzerError, match="unknown model") as info:
        pa.measure(settings(), tmp_path / "c1.csv", binary=binary, env={})
    assert type(info.value) is pa.PerfAnalyzerError
    assert info.value.command[0] == str(binary)


def test_measure_missing_library_names_the_package(tmp_path):
    binary = fake_binary(
        tmp_path,
        "echo 'perf_analyzer: error while loading shared libraries: libb64.so.0d: "
        "cannot open shared object file: No such file or directory' >&2\nexit 127\n",
    )
    with pytest.raises(pa.PerfAnalyzerNotAvailable, match="apt-get install libb64-0d"):
        pa.measure(settings(), tmp_path / "c1.csv", binary=binary, env={})


def test_measure_timeout_kills_the_process(tmp_path):
    binary = fake_binary(tmp_path, "echo started\nexec sleep 30\n")
    with pytest.raises(pa.PerfAnalyzerTimeout, match="ran past 1 s") as info:
        pa.measure(settings(timeout_s=1.0), tmp_path / "c1.csv", binary=binary, env={})
    assert "started" in info.value.output


# --------------------------------------------------------------------------- input data and summary


def test_sentences_are_distinct_16_token_requests():
    from perf.data import make_sentences as ms

    texts = ms.sentences()
    assert len(set(texts)) == len(texts) >= 50
    text = ms.OUTPUT.read_text(encoding="utf-8")
    assert text == ms.render(texts), "sentences_16tok.json is not in its layout; run python -m perf.data.make_sentences"
    assert all(entry["TEXT"]["shape"] == [1] and len(entry["TEXT"]["content"]) == 1 for entry in json.loads(text)["data"])
    if not ms.TOKENIZER.is_file():
        pytest.skip(f"{ms.TOKENIZER} not exported (make export); token lengths not checked")
    assert ms.problems(texts) == []
    assert ms.problems([*texts[:2], texts[0], "Too short."]) == [
        f"duplicate: {texts[0]!r}",
        "5 tokens (want 16): 'Too short.'",
    ]
