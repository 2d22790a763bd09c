"""What the measuring tools share (perf.bench: compare, sweep, autotune, trace_report; CSV writing for most).

A run (deadline, perf_analyzer, results folder), a perf_analyzer measurement retried once
with twice the requests when it does not stabilise, Triton's per-model statistics around it,
model config reloads through the repository API (ops.repository.RepositoryClient, which
sends the repository token), and CSV writing.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, overload

from ops import repository
from ops.repository import RepositoryClient
from perf.lib import perf_analyzer as pa
from perf.lib import report, triton_stats
from perf.lib import served as served_mod
from perf.lib.paths import RESULTS as DEFAULT_RESULTS  # noqa: F401 (perf.bench.trace_report reads it here)

MODEL = "text_embedding"
ENCODER = "text_encoder"


@dataclass(frozen=True)
class RateSettings(pa.Settings):
    """perf_analyzer at a fixed request rate (Poisson arrivals) instead of a fixed concurrency."""

    request_rate: float = 1.0
    distribution: str = "poisson"

    def command(self, binary: Path, csv_path: Path) -> list[str]:
        cmd = super().command(binary, csv_path)
        i = cmd.index("--concurrency-range")
        # --async: open-loop arrivals; with synchronous calls a few client threads cannot
        # keep a Poisson schedule once latency grows (perf_analyzer then delays requests).
        cmd[i : i + 2] = [
            "--request-rate-range",
            f"{self.request_rate:.0f}",
            "--request-distribution",
            self.distribution,
            "--async",
        ]
        return cmd


@dataclass
class Row:
    """One system under one load: a measurement, or the reason there is none."""

    key: str  # short id, used for file names and ratios
    system: str
    protocol: str  # in-process, http, grpc
    load: str
    throughput: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    measurement: pa.Measurement | None = None
    error: str = ""
    note: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.throughput is not None and self.throughput > 0


@dataclass
class Run:
    args: argparse.Namespace
    out_dir: Path
    deadline: float
    binary: Path
    env: dict
    rows: list[Row] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:5.0f} s] {message}", flush=True)


def measure(run: Run, row: Row, settings: pa.Settings, steps_after: int) -> Row:
    """One perf_analyzer measurement into ``row``, retried once (twice the requests) if unstable."""
    started = time.monotonic()
    for attempt in (1, 2):
        # Leave each later measurement at least 10 s of the budget.
        timeout = min(run.left() - 10.0 * steps_after, 300.0)
        if timeout < 5:
            row.error = row.error or "time budget used up"
            break
        settings = dataclasses.replace(settings, timeout_s=timeout)
        stem = row.key if attempt == 1 else f"{row.key}-retry"
        try:
            m = pa.measure(
                settings, run.out_dir / f"{stem}.csv", log_path=run.out_dir / f"{stem}.log", binary=run.binary, env=run.env
            )
        except pa.PerfAnalyzerUnstable as exc:
            row.error = "unstable"
            run.say(f"    {exc}")
            if attempt == 1:
                settings = dataclasses.replace(settings, request_count=settings.request_count * 2)
                run.say(f"    retrying with {settings.request_count} requests per window")
            continue
        except pa.PerfAnalyzerTimeout as exc:
            row.error = "timed out"
            run.say(f"    {exc}")
            break
        except pa.PerfAnalyzerError as exc:
            row.error = str(exc).splitlines()[0]
            run.say(f"    {exc}\n{exc.output_tail(15)}")
            break
        row.measurement, row.error = m, ""
        row.throughput, row.p50_ms, row.p99_ms = m.throughput, m.p50_ms, m.p99_ms
        break
    row.wall_s = time.monotonic() - started
    if row.ok:
        run.say(f"    {row.throughput:.1f} infer/s, p50 {row.p50_ms:.1f} ms, p99 {row.p99_ms:.1f} ms ({row.wall_s:.0f} s)")
    return row


def measure_served(run: Run, row: Row, settings: pa.Settings, steps_after: int, http_url: str) -> Row:
    """measure(), with every model's share from Triton's statistics (BLS-called models too).

    The figures replace perf_analyzer's composing-model list, which only knows ensemble steps;
    they cover the whole perf_analyzer run (all its windows), which only moves means a little.
    """
    try:
        before = triton_stats.snapshot(http_url)
    except OSError:
        before = None
    measure(run, row, settings, steps_after)
    if before is not None and row.measurement is not None:
        served = triton_stats.fetch_delta(http_url, before, skip=(settings.model,))
        if served:
            row.measurement = dataclasses.replace(row.measurement, composing=served)
    return row


def settings_for(run: Run, url: str, protocol: str, concurrency: int) -> pa.Settings:
    a = run.args
    return pa.Settings(
        model=MODEL,
        url=url,
        protocol=protocol,
        concurrency=concurrency,
        input_data=a.input_data,
        request_count=a.request_count,
        stability_percent=a.stability_percent,
        max_trials=a.max_trials,
    )


def skipped(key: str, system: str, protocol: str, load: str, reason: str) -> Row:
    return Row(key, system, protocol, load, error=reason)


def rate_warnings(output: str) -> list[str]:
    """perf_analyzer's warnings that make a request-rate measurement doubtful, in short."""
    warnings = []
    if m := re.search(r"(\d+(?:\.\d+)?)% of the requests were delayed", output):
        if float(m.group(1)) > 5.0:  # a few late sends are harmless; many mean a closed loop in disguise
            warnings.append(f"perf_analyzer sent {m.group(1)} % of the requests late")
    if "Request latency is not stabilizing" in output:
        warnings.append("perf_analyzer: latency did not stabilise")
    return warnings


def http(url: str, method: str = "GET", body: dict | None = None, timeout: float = 120.0) -> tuple[int, bytes]:
    """ops.repository.http, with the repository token on repository API paths."""
    return repository.http(url, method, body, repository.token_headers() if "/v2/repository/" in url else {}, timeout)


def reload_with(http_url: str, model: str, config: dict, ensemble: str = MODEL, timeout: float = 120.0) -> None:
    """Load ``model`` with ``config`` (a config override) and wait until ``ensemble`` is ready."""
    client = RepositoryClient(http_url, timeout=timeout)
    client.load(model, config)
    client.wait_ready(ensemble, timeout=timeout)


def disable_dynamic_batching(http_url: str, model: str = ENCODER, ensemble: str = MODEL, timeout: float = 120.0) -> dict:
    """Reload ``model`` with its served config minus dynamic_batching, through the repository API.

    Returns the config that was served before. Raises RuntimeError (RepositoryError) when
    Triton refuses, the reloaded config still batches, or the ensemble is not ready again
    within ``timeout``.
    """
    client = RepositoryClient(http_url, timeout=timeout)
    before = client.config(model)
    if "dynamic_batching" not in before:
        raise RuntimeError(f"{model} has no dynamic_batching to switch off")
    client.load(model, {k: v for k, v in before.items() if k != "dynamic_batching"})
    if "dynamic_batching" in client.config(model):
        raise RuntimeError(f"{model} still has dynamic_batching after the reload")
    client.wait_ready(ensemble, timeout=timeout)
    return before


def disable_all_dynamic_batching(http_url: str, ensemble: str = MODEL, timeout: float = 120.0) -> list[str]:
    """disable_dynamic_batching() for every loaded model that batches, except ``ensemble``.

    Every step, not only the encoder: a Python step in front of it (the canary router) would
    otherwise still merge requests into one encoder call. Returns the models switched.
    """
    client = RepositoryClient(http_url, timeout=timeout)
    status, raw = http(f"{client.base}/v2/repository/index", "POST", {"ready": True}, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"repository index: HTTP {status} {raw[:200]!r}")
    index = json.loads(raw)
    switched = []
    for name in sorted({m["name"] for m in index if m.get("state", "READY") == "READY"} - {ensemble}):
        if "dynamic_batching" in client.config(name):
            disable_dynamic_batching(http_url, name, ensemble, timeout)
            switched.append(name)
    if not switched:
        raise RuntimeError("no loaded model has dynamic batching to switch off")
    return switched


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers (``1,8,16``)."""
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def write_csv(path: Path, records: Sequence[Mapping[str, object]]) -> None:
    columns: list[str] = []
    for record in records:
        columns += [k for k in record if k not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)


def ensure_exported(served: served_mod.ServedEncoder, args: argparse.Namespace, say: Callable[[str], None]) -> bool:
    tokenizer = served_mod.REPOSITORY / served_mod.TOKENIZER / "1" / "tokenizer.json"
    if served.model_path.is_file() and tokenizer.is_file():
        return True
    if args.no_export:
        say(f"perf.bench.compare: {served.model_path} or {tokenizer} missing and --no-export given")
        return False
    from export import __main__ as export_main

    say("perf.bench.compare: exporting text_encoder (model files missing)")
    export_main.main(["--model", ENCODER, "--no-speed"])
    return tokenizer.is_file() and served_mod.served_encoder(args.precision).model_path.is_file()


RunT = TypeVar("RunT", bound=Run)


@overload
def new_run(args: argparse.Namespace, kind: str) -> Run | None: ...
@overload
def new_run(args: argparse.Namespace, kind: str, run_class: type[RunT]) -> RunT | None: ...
def new_run(args: argparse.Namespace, kind: str, run_class: type[Run] = Run) -> Run | None:
    """A run of ``perf.bench.<kind>`` (a ``run_class``): its deadline, perf_analyzer, and its results folder
    (``--out-dir`` or perf/results/<kind>-<UTC time>). None (said why) without perf_analyzer."""
    deadline = time.monotonic() + args.time_budget
    try:
        binary, env = pa.check()
    except pa.PerfAnalyzerNotAvailable as exc:
        print(f"perf.bench.{kind}: {exc}", flush=True)
        return None
    return run_class(args, report.results_dir(args.out_dir, kind), deadline, binary, env)
