"""perf_analyzer, the load driver of the KServe benchmarks: one measurement (one load level) and what it reports.

The binary comes with ``tritonclient[all]==2.50.0`` (the venv's ``bin/``). It links ``libcudart.so.12``
even without a GPU, so its environment puts the ``nvidia-cuda-runtime-cu12`` wheel's lib folder on
``LD_LIBRARY_PATH``; it also needs ``libb64.so.0d`` (Debian's ``libb64-0d``). Which levels, retries and
the time budget belong to the caller (perf.lib.harness), so each level's CSV is its own file.

The CSV is in microseconds, :class:`Measurement` in milliseconds. For an ensemble the CSV's server
columns are the ensemble's own; each step's queue, compute and batch come from Triton's statistics
(perf.lib.triton_stats, the one reading of server-side figures), not from perf_analyzer's text output.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

BINARY_NAME = "perf_analyzer"
# Shared libraries perf_analyzer 2.50 needs that a plain machine may lack, and where they come from.
LIBRARY_HINTS = {
    "libcudart.so.12": "pip install nvidia-cuda-runtime-cu12 (pinned in requirements-perf.txt)",
    "libb64.so.0d": "apt-get install libb64-0d (scripts/setup.sh does it)",
}
BINARY_HINT = "pip install 'tritonclient[all]==2.50.0' (the last wheel that ships perf_analyzer for glibc 2.36)"
PROTOCOLS = ("grpc", "http")


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer could not run or gave no result; ``output``: its stdout and stderr, ``command``: the argv."""

    def __init__(self, message: str, output: str = "", command: Sequence[str] = ()):
        super().__init__(message)
        self.output = output
        self.command = list(command)

    def output_tail(self, lines: int = 30) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-lines:])


class PerfAnalyzerNotAvailable(PerfAnalyzerError):
    """The binary or one of its shared libraries is missing; the message says what to install."""


class PerfAnalyzerUnstable(PerfAnalyzerError):
    """No stable measurement within --max-trials windows (common on small shared machines)."""


class PerfAnalyzerTimeout(PerfAnalyzerError):
    """The wall-clock limit of one measurement ran out; the process was killed."""


def find_binary() -> Path:
    """The perf_analyzer to run: $PERF_ANALYZER, else the one beside this Python, else PATH."""
    override = os.environ.get("PERF_ANALYZER")
    if override:
        path = Path(override)
        if not path.is_file():
            raise PerfAnalyzerNotAvailable(f"PERF_ANALYZER={override} is not a file")
        return path
    # Not resolved: the venv's python is a symlink to the system one, the binary is in the venv.
    beside = Path(sys.executable).parent / BINARY_NAME
    if beside.is_file():
        return beside
    found = shutil.which(BINARY_NAME)
    if found:
        return Path(found)
    raise PerfAnalyzerNotAvailable(f"{BINARY_NAME} not found beside {sys.executable} nor on PATH; {BINARY_HINT}")


def cuda_runtime_lib_dir() -> Path | None:
    """lib folder of the nvidia-cuda-runtime-cu12 wheel (holds libcudart.so.12), if installed."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except ModuleNotFoundError:  # no `nvidia` namespace at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        lib = Path(location) / "lib"
        if (lib / "libcudart.so.12").exists():
            return lib
    return None


def environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default os.environ) with the CUDA runtime wheel's lib folder first on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    lib = cuda_runtime_lib_dir()
    if lib is not None:
        parts = [str(lib)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != str(lib)]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(parts)
    return env


def missing_libraries(binary: Path, env: Mapping[str, str]) -> list[str]:
    """Shared libraries ``ldd`` cannot resolve for ``binary`` under ``env`` ([] when ldd is absent)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    try:
        out = subprocess.run([ldd, str(binary)], env=dict(env), capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({m.group(1) for m in re.finditer(r"^\s*(\S+) => not found", out, re.M)})


def _missing_message(binary: Path, libraries: Sequence[str]) -> str:
    hints = [f"  {lib}: {LIBRARY_HINTS.get(lib, 'install the package that provides it')}" for lib in libraries]
    return f"{binary} cannot start, shared libraries missing:\n" + "\n".join(hints)


def check(binary: Path | None = None, env: Mapping[str, str] | None = None) -> tuple[Path, dict[str, str]]:
    """(binary, env) with the binary's libraries resolving; PerfAnalyzerNotAvailable names what to install."""
    binary = binary or find_binary()
    env = dict(env) if env is not None else environment()
    missing = missing_libraries(binary, env)
    if missing:
        raise PerfAnalyzerNotAvailable(_missing_message(binary, missing))
    return binary, env


@dataclass(frozen=True)
class Settings:
    """Flags of one perf_analyzer measurement (one concurrency level)."""

    model: str
    url: str  # host:port of the chosen protocol's endpoint
    protocol: str = "grpc"
    concurrency: int = 1
    input_data: Path | None = None  # perf_analyzer JSON; None = random data
    batch_size: int = 1
    request_count: int = 200  # --measurement-request-count: requests per window
    stability_percent: float = 50.0  # -s: loose, small shared machines rarely meet the default 10
    max_trials: int = 5  # --max-trials: windows before giving up
    timeout_s: float = 180.0  # wall clock for the whole process
    verbose_csv: bool = True  # adds "Avg latency" and the client's request/response split
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.concurrency < 1 or self.batch_size < 1 or self.request_count < 1 or self.max_trials < 1:
            raise ValueError("concurrency, batch_size, request_count and max_trials must be >= 1")

    def command(self, binary: Path, csv_path: Path) -> list[str]:
        cmd = [
            str(binary),
            "-m", self.model,
            "-u", self.url,
            "-i", self.protocol,
            "-b", str(self.batch_size),
            "--concurrency-range", str(self.concurrency),
            # Count windows instead of time windows: on a noisy 2-core machine the default
            # time-window stabilisation often never converges (seen on these shared 2-core machines).
            "--measurement-mode", "count_windows",
            "--measurement-request-count", str(self.request_count),
            "-s", f"{self.stability_percent:g}",
            "--max-trials", str(self.max_trials),
            "-f", str(csv_path),
        ]  # fmt: skip
        if self.input_data is not None:
            cmd += ["--input-data", str(self.input_data)]
        if self.verbose_csv:
            cmd.append("--verbose-csv")
        return cmd + list(self.extra_args)


@dataclass(frozen=True)
class ModelStats:
    """Server-side figures of one model over a measurement (perf.lib.triton_stats; times in ms per request)."""

    name: str
    version: str = ""
    inference_count: int = 0
    execution_count: int = 0
    success_count: int = 0
    avg_request_latency_ms: float | None = None
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # overhead, queue, compute input, ...
    cache_hit_count: int = 0  # Triton's response cache (reported when the server has one)
    cache_miss_count: int = 0

    @property
    def avg_batch(self) -> float | None:
        """Inferences per execution: how well the dynamic batcher formed batches."""
        return self.inference_count / self.execution_count if self.execution_count else None


@dataclass(frozen=True)
class Measurement:
    """One row of perf_analyzer's CSV (times in ms), plus the server's figures."""

    throughput: float  # inferences per second
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    concurrency: int | None = None
    request_rate: float | None = None
    avg_ms: float | None = None  # with --verbose-csv
    client_send_ms: float | None = None
    client_recv_ms: float | None = None
    network_server_send_recv_ms: float | None = None
    server_queue_ms: float | None = None
    server_compute_input_ms: float | None = None
    server_compute_infer_ms: float | None = None
    server_compute_output_ms: float | None = None
    client_request_response_ms: float | None = None  # with --verbose-csv
    client_response_wait_ms: float | None = None  # with --verbose-csv
    extra: dict[str, str] = field(default_factory=dict)  # CSV columns not mapped above
    # Server side, from Triton's statistics around the run (perf.lib.triton_stats; perf.lib.harness.measure):
    server: ModelStats | None = None  # the measured model
    composing: dict[str, ModelStats] = field(default_factory=dict)  # every other model that served requests

    def as_row(self) -> dict[str, object]:
        """Flat dict for a summary CSV: the scalar fields, then each composing model's queue/infer/batch."""
        row: dict[str, object] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "server", "composing")
        }
        for name, stats in sorted(self.composing.items()):
            row[f"{name}_queue_ms"] = stats.breakdown_ms.get("queue")
            row[f"{name}_compute_infer_ms"] = stats.breakdown_ms.get("compute infer")
            row[f"{name}_avg_batch"] = None if stats.avg_batch is None else round(stats.avg_batch, 2)
        return row


# CSV header -> (field, is a time in microseconds). Headers of perf_analyzer 2.50.
_CSV_COLUMNS: dict[str, tuple[str, bool]] = {
    "Concurrency": ("concurrency", False),
    "Request Rate": ("request_rate", False),
    "Inferences/Second": ("throughput", False),
    "Client Send": ("client_send_ms", True),
    "Network+Server Send/Recv": ("network_server_send_recv_ms", True),
    "Server Queue": ("server_queue_ms", True),
    "Server Compute Input": ("server_compute_input_ms", True),
    "Server Compute Infer": ("server_compute_infer_ms", True),
    "Server Compute Output": ("server_compute_output_ms", True),
    "Client Recv": ("client_recv_ms", True),
    "p50 latency": ("p50_ms", True),
    "p90 latency": ("p90_ms", True),
    "p95 latency": ("p95_ms", True),
    "p99 latency": ("p99_ms", True),
    "Avg latency": ("avg_ms", True),
    "request/response": ("client_request_response_ms", True),
    "response wait": ("client_response_wait_ms", True),
}
_REQUIRED = ("throughput", "p50_ms", "p90_ms", "p95_ms", "p99_ms")


def parse_csv(text: str) -> list[Measurement]:
    """perf_analyzer's ``-f`` CSV, one Measurement per row (load level). Columns are matched by name, so
    ``--verbose-csv`` and newer versions' columns shift nothing (unknown ones land in ``extra``); ValueError
    when throughput or a percentile is missing or a value is not a number."""
    # With --collect-metrics further tables follow a blank line; the latency table is the first.
    block = text.strip().split("\n\n", 1)[0]
    reader = csv.DictReader(io.StringIO(block))
    header = [h.strip() for h in reader.fieldnames or []]
    known = {_CSV_COLUMNS[h][0] for h in header if h in _CSV_COLUMNS}
    absent = [name for name in _REQUIRED if name not in known]
    if absent:
        raise ValueError(f"perf_analyzer CSV lacks columns for {', '.join(absent)}; header: {header}")
    rows = []
    for line_no, raw in enumerate(reader, start=2):
        values: dict[str, object] = {}
        extra: dict[str, str] = {}
        for key, value in raw.items():
            key = (key or "").strip()
            value = (value or "").strip() if isinstance(value, str) else ""
            if key not in _CSV_COLUMNS:
                if key:
                    extra[key] = value
                continue
            name, is_time = _CSV_COLUMNS[key]
            if value == "":
                continue
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"perf_analyzer CSV line {line_no}: {key}={value!r} is not a number") from None
            if name == "concurrency":
                values[name] = int(number)
            else:
                values[name] = number / 1000.0 if is_time else number
        missing = [name for name in _REQUIRED if name not in values]
        if missing:
            raise ValueError(f"perf_analyzer CSV line {line_no} has no value for {', '.join(missing)}")
        rows.append(Measurement(extra=extra, **values))  # type: ignore[arg-type]
    return rows


def measure(
    settings: Settings,
    csv_path: Path,
    *,
    log_path: Path | None = None,
    binary: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Measurement:
    """perf_analyzer once with ``settings``: its CSV to ``csv_path``, its text output to ``log_path``. Raises
    PerfAnalyzerNotAvailable, PerfAnalyzerTimeout, PerfAnalyzerUnstable (no stable window) or PerfAnalyzerError."""
    binary, env = check(binary, env)
    csv_path = Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    csv_path.unlink(missing_ok=True)  # a stale file must not pass for this run's result
    cmd = settings.command(binary, csv_path)
    log.info("running %s", " ".join(cmd))
    started = time.monotonic()
    process = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=settings.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        _write_log(log_path, cmd, output)
        message = f"perf_analyzer ran past {settings.timeout_s:.0f} s at concurrency {settings.concurrency}; killed"
        raise PerfAnalyzerTimeout(message, output, cmd) from None
    finally:
        if process.poll() is None:  # KeyboardInterrupt and friends
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    _write_log(log_path, cmd, output)
    log.info("perf_analyzer finished in %.1f s (exit %s)", time.monotonic() - started, process.returncode)
    if m := re.search(r"error while loading shared libraries: (\S+?):", output):
        raise PerfAnalyzerNotAvailable(_missing_message(binary, [m.group(1)]), output, cmd)
    if "Failed to obtain stable measurement" in output:
        message = (
            f"no stable measurement at concurrency {settings.concurrency} within {settings.max_trials} windows of "
            f"{settings.request_count} requests (-s {settings.stability_percent:g}); raise the request count, "
            "the stability percentage or --max-trials"
        )
        raise PerfAnalyzerUnstable(message, output, cmd)
    if process.returncode != 0 or not csv_path.is_file():
        last = output.strip().splitlines()[-1] if output.strip() else "no output"
        raise PerfAnalyzerError(f"perf_analyzer exited with code {process.returncode}: {last}", output, cmd)
    rows = parse_csv(csv_path.read_text())
    if len(rows) != 1:
        raise PerfAnalyzerError(f"expected one result row in {csv_path}, found {len(rows)}", output, cmd)
    return rows[0]


def _write_log(path: Path | None, cmd: Sequence[str], output: str) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("$ " + " ".join(cmd) + "\n" + output)
