"""`python -m perf.bench.sweep` (`make perf`): concurrency and Poisson request-rate sweeps with perf_analyzer.

For each served model (text_embedding and image_classification by default), each input set
and each protocol (gRPC and HTTP):

  1. a concurrency sweep (--concurrency, default 1,2,4,8,16,32);
  2. a Poisson request-rate sweep (--request-distribution poisson, --async) at --rates req/s,
     or by default at --rate-fractions (0.25,0.5,0.7,0.9) of the peak throughput measured in
     that sweep's concurrency sweep.

Inputs: text_embedding with the checked-in perf/data/sentences_16tok.json ("16tok", every
request exactly 16 tokens) and perf/data/sentences_mixed.json ("mixed", real sentences of
about 8, 16, 32, 64 and 128 tokens); image_classification with JPEGs written into the results
folder at run time (export.image_data's evaluation photos, downscaled; synthetic images when
the sample photo packages are absent), one image per request.

One tritonserver (both ensembles loaded) serves the whole sweep and is stopped at the end.
Windows count requests (count_windows); an unstable point is retried once with twice the
requests per window (perf.lib.harness.measure). After the first point of a sweep the window is
sized from the measured throughput (--window-s seconds of requests), so slow models do not
spend minutes per window. --time-budget bounds the whole run: each sweep gets an equal share
of what is left, points that no longer fit are recorded as skipped.

Writes under perf/results/sweep-<UTC time>/: perf_analyzer's CSV and log per point,
sweep.csv (every point, one row each), summary.md, and PNG plots: throughput vs concurrency
and P50/P99 latency vs throughput, one of each per model and input set.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from perf.lib import harness
from perf.lib import perf_analyzer as pa
from perf.lib.harness import int_list
from perf.lib.paths import DATA, REPOSITORY
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.report import load_average
from perf.lib.stats import measured

TEXT_MODEL = "text_embedding"
IMAGE_MODEL = "image_classification"
MODELS = (TEXT_MODEL, IMAGE_MODEL)
TEXT_DATA = {"16tok": DATA / "sentences_16tok.json", "mixed": DATA / "sentences_mixed.json"}
# The model file each ensemble needs before a server can load it (the export writes them).
REQUIRED_FILES = {
    TEXT_MODEL: ("text_tokenizer/1/tokenizer.json", "text_encoder/1/model.onnx"),
    IMAGE_MODEL: ("image_classifier/1/model.onnx",),
}
EXPORT_NAMES = {TEXT_MODEL: "text_encoder", IMAGE_MODEL: "image_classifier"}
DEFAULT_FRACTIONS = (0.25, 0.5, 0.7, 0.9)
IMAGE_COUNT = 16  # images in the perf_analyzer input, sent round-robin
IMAGE_SIDE = 320  # longest side of the JPEGs: a typical upload, and cheap to decode


@dataclass(frozen=True)
class Workload:
    """One model with one input set."""

    model: str
    data: str  # short name: 16tok, mixed, images
    input_data: Path
    request_count: int  # requests per window of the first point of each sweep

    @property
    def name(self) -> str:
        return f"{self.model}-{self.data}"


@dataclass
class Point:
    """One measured (or skipped) point of a sweep."""

    model: str
    data: str
    protocol: str
    kind: str  # "concurrency" or "rate"
    load: float  # concurrency, or the asked request rate (req/s)
    throughput: float | None = None
    p50_ms: float | None = None
    p90_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    avg_ms: float | None = None
    request_count: int | None = None
    error: str = ""
    note: str = ""
    wall_s: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.throughput is not None and self.throughput > 0 and self.p50_ms is not None

    @property
    def workload(self) -> str:
        return f"{self.model}-{self.data}"

    def record(self) -> dict[str, object]:
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        row["wall_s"] = round(self.wall_s, 1)
        row.update({k: v for k, v in self.extra.items() if k not in row})
        return row


# --------------------------------------------------------------------------- pure helpers


def rates_from_peak(peak: float | None, fractions: Sequence[float]) -> list[float]:
    """Request rates (req/s) at ``fractions`` of ``peak``, rounded to whole requests, at least 1, distinct."""
    if not peak or peak <= 0:
        return []
    rates: list[float] = []
    for fraction in fractions:
        rate = float(max(1, round(fraction * peak)))
        if rate not in rates:
            rates.append(rate)
    return rates


def window_requests(throughput: float | None, window_s: float, lo: int, hi: int) -> int:
    """Requests per count window so one window lasts about ``window_s`` at ``throughput``, in [lo, hi]."""
    if not throughput or throughput <= 0:
        return lo
    return int(min(hi, max(lo, round(throughput * window_s))))


def peak_throughput(points: Sequence[Point], model: str, data: str, protocol: str) -> float | None:
    return max((measured(p.throughput) for p in points if p.ok and p.kind == "concurrency" and p.model == model
                and p.data == data and p.protocol == protocol), default=None)  # fmt: skip


def write_csv(path: Path, points: Sequence[Point]) -> None:
    harness.write_csv(path, [p.record() for p in points])


def _fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def summary_markdown(points: Sequence[Point], header: Sequence[str]) -> str:
    lines = list(header)
    workloads = list(dict.fromkeys(p.workload for p in points))
    for workload in workloads:
        group = [p for p in points if p.workload == workload]
        lines += [
            "",
            f"## {workload}",
            "",
            "| protocol | sweep | load | throughput (infer/s) | p50 (ms) | p99 (ms) | p99/p50 | note |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for p in group:
            load = f"c{p.load:g}" if p.kind == "concurrency" else f"{p.load:g}/s"
            kind = "concurrency" if p.kind == "concurrency" else "Poisson rate"
            if not p.ok:
                lines.append(f"| {p.protocol} | {kind} | {load} | skipped: {p.error} | | | | |")
                continue
            ratio = _fmt(measured(p.p99_ms) / p.p50_ms, 2) if p.p50_ms else ""
            lines.append(
                f"| {p.protocol} | {kind} | {load} | {p.throughput:.1f} | {p.p50_ms:.1f} | {p.p99_ms:.1f} | {ratio} | {p.note} |"
            )
        peaks = []
        for protocol in dict.fromkeys(p.protocol for p in group):
            peak = peak_throughput(group, group[0].model, group[0].data, protocol)
            best = next((p for p in group if p.ok and p.kind == "concurrency" and p.protocol == protocol
                         and p.throughput == peak), None)  # fmt: skip
            if best is not None:
                peaks.append(f"{protocol} {peak:.1f} infer/s at c{best.load:g}")
        if peaks:
            lines += ["", "Peak: " + ", ".join(peaks) + "."]
    return "\n".join(lines) + "\n"


def plot(points: Sequence[Point], out_dir: Path) -> list[Path]:
    """Throughput vs concurrency and P50/P99 vs throughput per model and input set; the PNGs written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for workload in dict.fromkeys(p.workload for p in points):
        group = [p for p in points if p.workload == workload and p.ok]
        if not group:
            continue
        protocols = list(dict.fromkeys(p.protocol for p in group))

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for protocol in protocols:
            conc = sorted((p for p in group if p.kind == "concurrency" and p.protocol == protocol), key=lambda p: p.load)
            if conc:
                ax.plot([p.load for p in conc], [measured(p.throughput) for p in conc], marker="o", label=protocol)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("throughput (inferences/s)")
        ax.set_title(f"{workload}: throughput vs concurrency", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"throughput_vs_concurrency_{workload}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, protocol in enumerate(protocols):
            color = colors[i % len(colors)]
            for kind, marker in (("concurrency", "o"), ("rate", "^")):
                pts = sorted(
                    (p for p in group if p.kind == kind and p.protocol == protocol), key=lambda p: measured(p.throughput)
                )
                if not pts:
                    continue
                label = f"{protocol}, {'concurrency' if kind == 'concurrency' else 'Poisson'}"
                x = [measured(p.throughput) for p in pts]
                ax.plot(x, [measured(p.p50_ms) for p in pts], marker=marker, color=color, linestyle="-", label=f"{label}, p50")
                ax.plot(x, [measured(p.p99_ms) for p in pts], marker=marker, color=color, linestyle="--", label=f"{label}, p99")
        ax.set_yscale("log")
        ax.set_xlabel("throughput (inferences/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{workload}: P50 (solid) and P99 (dashed) vs throughput", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"latency_vs_throughput_{workload}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_image_input(path: Path, count: int = IMAGE_COUNT, side: int = IMAGE_SIDE) -> Path:
    """perf_analyzer input of ``count`` JPEGs: real photos (export.image_data), else synthetic ones."""
    from PIL import Image

    from export import image_data

    try:
        images = [s.image for s in image_data.evaluation_set()[:count]]
    except Exception:  # the sample photos missing: gradients with noise, still real JPEG decoding work
        import numpy as np

        rng = np.random.default_rng(0)
        images = []
        for i in range(count):
            w, h = side, int(side * (0.6 + 0.4 * (i % 3) / 2))
            base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 3), np.float32)
            noisy = np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
            images.append(Image.fromarray(noisy, "RGB"))
    blobs = []
    for image in images:
        image = image.copy()
        image.thumbnail((side, side))
        blobs.append(image_data.encode(image, "JPEG"))
    return image_data.write_perf_analyzer_input(path, blobs)


# --------------------------------------------------------------------------- arguments


def _str_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v for v in text.replace(" ", "").split(",") if v]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(values))

    return parse


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI smoke (about a minute): text_embedding (both input sets) over gRPC, concurrency 1,8, one rate, small windows",
    )
    p.add_argument("--models", type=_str_list(MODELS), help=f"default {','.join(MODELS)} (--quick: {TEXT_MODEL})")
    p.add_argument(
        "--text-data",
        type=_str_list(tuple(TEXT_DATA)),
        help="text input sets: 16tok (exactly 16 tokens), mixed (8-128 tokens); default both",
    )
    p.add_argument("--protocols", type=_str_list(pa.PROTOCOLS), help="default grpc,http (--quick: grpc)")
    p.add_argument("--concurrency", type=int_list, help="default 1,2,4,8,16,32 (--quick: 1,8)")
    p.add_argument("--rates", type=_float_list, help="Poisson request rates in req/s (default: --rate-fractions of peak)")
    p.add_argument(
        "--rate-fractions",
        type=_float_list,
        help="rates as fractions of the concurrency sweep's peak (default 0.25,0.5,0.7,0.9; --quick: 0.7)",
    )
    p.add_argument("--precision", default="cpu", help="as `make serve PRECISION=`: cpu (default), fp32, auto, ...")
    p.add_argument("--time-budget", type=float, help="seconds for the whole run, server start included (default 900, --quick 75)")
    p.add_argument("--request-count", type=int, help="max requests per window (default 500, --quick 60)")
    p.add_argument(
        "--window-s", type=float, help="target seconds per window after a sweep's first point (default 2, --quick 0.5)"
    )
    p.add_argument("--stability-percent", type=float, help="perf_analyzer -s (default 30, --quick 100)")
    p.add_argument("--max-trials", type=int, help="windows before a point is unstable (default 6, --quick 3)")
    p.add_argument("--out-dir", type=Path, help="results folder (default perf/results/sweep-<UTC time>)")
    p.add_argument("--no-export", action="store_true", help="never export, even when model files are missing")
    p.add_argument("--verbose", action="store_true", help="log perf_analyzer command lines")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    q = args.quick
    defaults = dict(
        models=[TEXT_MODEL] if q else list(MODELS),
        text_data=list(TEXT_DATA),
        protocols=["grpc"] if q else list(pa.PROTOCOLS),
        concurrency=[1, 8] if q else [1, 2, 4, 8, 16, 32],
        rate_fractions=[0.7] if q else list(DEFAULT_FRACTIONS),
        time_budget=75.0 if q else 900.0,
        request_count=60 if q else 500,
        window_s=0.5 if q else 2.0,
        stability_percent=100.0 if q else 30.0,
        max_trials=3 if q else 6,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.request_count, args.max_trials) < 1 or args.time_budget <= 0 or args.window_s <= 0:
        p.error("--request-count, --max-trials, --window-s and --time-budget must be positive")
    return args


def workloads(args: argparse.Namespace, out_dir: Path) -> list[Workload]:
    result = []
    for model in args.models:
        if model == TEXT_MODEL:
            # The first window of a sweep is small; later ones are sized from the measured throughput.
            result += [Workload(model, name, TEXT_DATA[name], min(args.request_count, 100)) for name in args.text_data]
        else:
            path = write_image_input(out_dir / "images.json")
            # ResNet-50 on a few CPU cores: tens of images/s; a text-sized first window would take minutes.
            result.append(Workload(model, "images", path, max(10, args.request_count // 25)))
    return result


# --------------------------------------------------------------------------- running


def ensure_exported(args: argparse.Namespace, say: Callable[[str], None]) -> bool:
    missing = [m for m in args.models if not all((REPOSITORY / f).is_file() for f in REQUIRED_FILES[m])]
    if not missing:
        return True
    if args.no_export:
        say(f"perf.bench.sweep: model files of {', '.join(missing)} missing and --no-export given")
        return False
    from export import __main__ as export_main

    export_args = [a for m in missing for a in ("--model", EXPORT_NAMES[m])] + ["--no-speed"]
    say(f"perf.bench.sweep: exporting {', '.join(EXPORT_NAMES[m] for m in missing)} (model files missing)")
    export_main.main(export_args)
    return all((REPOSITORY / f).is_file() for m in missing for f in REQUIRED_FILES[m])


def _point_from_row(point: Point, row: harness.Row, request_count: int) -> Point:
    point.error, point.note, point.wall_s, point.request_count = row.error, row.note, row.wall_s, request_count
    m = row.measurement
    if m is not None:
        point.throughput, point.p50_ms, point.p90_ms, point.p95_ms, point.p99_ms, point.avg_ms = (
            m.throughput,
            m.p50_ms,
            m.p90_ms,
            m.p95_ms,
            m.p99_ms,
            m.avg_ms,
        )
        point.extra = {k: v for k, v in m.as_row().items() if k not in ("throughput", "concurrency", "request_rate")}
        point.error = ""
    return point


def run_sweep(run: harness.Run, w: Workload, protocol: str, url: str) -> list[Point]:
    """Concurrency then Poisson rate sweep of one workload over one protocol, within run.deadline."""
    a = run.args
    points: list[Point] = []
    request_count = w.request_count
    plan: list[tuple[str, float]] = [("concurrency", float(c)) for c in a.concurrency]
    planned_rates = len(a.rates) if a.rates else len(a.rate_fractions)
    total = len(plan) + planned_rates
    done = 0

    def one(kind: str, load: float) -> Point:
        nonlocal done
        done += 1
        point = Point(w.model, w.data, protocol, kind, load)
        label = f"concurrency {load:g}" if kind == "concurrency" else f"Poisson {load:g}/s"
        run.say(
            f"  [{w.name} {protocol} {done}/{total}] {label}, windows of {request_count} requests "
            f"({run.left():.0f} s left for this sweep)"
        )
        if run.left() < 8:
            point.error = "time budget used up"
            run.say("    skipped: time budget used up")
            return point
        key = f"{w.name}-{protocol}-{'c' if kind == 'concurrency' else 'r'}{load:g}"
        base = pa.Settings(
            model=w.model,
            url=url,
            protocol=protocol,
            concurrency=int(load) if kind == "concurrency" else 1,
            input_data=w.input_data,
            request_count=request_count,
            stability_percent=a.stability_percent,
            max_trials=a.max_trials,
        )
        if kind == "rate":
            base = harness.RateSettings(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, request_rate=load)
        # Leave the points after this one at least some seconds each (at most two are reserved).
        row = harness.measure(run, harness.Row(key, w.model, protocol, label), base, min(total - done, 2))
        if row.ok and kind == "rate":
            row.note = f"achieved {measured(row.throughput) / load:.0%} of the asked rate"
            retry_log = run.out_dir / f"{key}-retry.log"
            log_path = retry_log if retry_log.is_file() else run.out_dir / f"{key}.log"
            for warning in harness.rate_warnings(log_path.read_text(errors="replace") if log_path.is_file() else ""):
                row.note += f"; {warning}"
        return _point_from_row(point, row, request_count)

    for kind, load in plan:
        point = one(kind, load)
        points.append(point)
        if point.ok:  # size the next windows from what this point achieved
            request_count = window_requests(point.throughput, a.window_s, 20, a.request_count)
    peak = peak_throughput(points, w.model, w.data, protocol)
    rates = a.rates or rates_from_peak(peak, a.rate_fractions)
    if not rates:
        for fraction in a.rate_fractions:
            done += 1
            points.append(
                Point(w.model, w.data, protocol, "rate", 0.0, error="no peak throughput measured", note=f"{fraction:g} x peak")
            )
    total = len(plan) + len(rates)
    for rate in rates:
        request_count = window_requests(rate, a.window_s, 20, a.request_count)
        points.append(one("rate", rate))
    return points


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    deadline = started + args.time_budget
    try:
        binary, env = pa.check()
    except pa.PerfAnalyzerNotAvailable as exc:
        print(f"perf.bench.sweep: {exc}", flush=True)
        return 2
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or DEFAULT_RESULTS / f"sweep-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    main_run = harness.Run(args, out_dir, deadline, binary, env, started=started)
    say = main_run.say
    if not ensure_exported(args, say):
        return 1

    from export.variants import resolve_precision
    from perf.lib.deployment import server_deployment
    from server.process import ServerError

    config_name, served = resolve_precision(REPOSITORY, [EXPORT_NAMES[m] for m in args.models], args.precision)
    loads = workloads(args, out_dir)
    groups = [(w, protocol) for w in loads for protocol in args.protocols]
    load_avg = load_average()
    say(
        f"perf.bench.sweep: {len(groups)} sweeps ({', '.join(w.name for w in loads)} x {', '.join(args.protocols)}), "
        f"concurrency {args.concurrency}, rates {args.rates or [f'{f:g} x peak' for f in args.rate_fractions]}, "
        f"budget {args.time_budget:.0f} s, load average {load_avg}"
    )

    points: list[Point] = []
    workdir = Path(tempfile.mkdtemp(prefix="perf-sweep-"))
    server = server_deployment(args.models, workdir, model_config_name=config_name)
    say(
        f"tritonserver: starting ({', '.join(args.models)}; --model-config-name={config_name or '(none: FP32)'}; served {served})"
    )
    server.start()
    try:
        try:
            server.wait_ready(timeout=max(min(300.0, main_run.left()), 1.0))
        except ServerError as exc:
            say(f"    {exc}\n{exc.log_tail}")
            return 1
        say(f"tritonserver: ready ({main_run.left():.0f} s of budget left)")
        for i, (w, protocol) in enumerate(groups):
            # An equal share of what is left for each remaining sweep.
            share = main_run.left() / (len(groups) - i)
            sweep_run = harness.Run(args, out_dir, time.monotonic() + share, binary, env, started=started)
            say(f"sweep {i + 1}/{len(groups)}: {w.name} over {protocol} ({share:.0f} s)")
            url = server.grpc_url if protocol == "grpc" else server.http_url
            points += run_sweep(sweep_run, w, protocol, url)
    finally:
        server.stop(logs_to=out_dir)
        shutil.rmtree(workdir, ignore_errors=True)
        say("tritonserver: stopped")

    header = [
        "# perf_analyzer sweep",
        "",
        f"- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average before "
        f"measuring {load_avg}",
        f"- command: `{' '.join(['python -m perf.bench.sweep', *args.argv])}`",
        f"- served: {served} (--model-config-name={config_name or 'none'}), one tritonserver for the whole sweep",
        "- inputs: " + ", ".join(f"{w.name} = {pa.display_path(w.input_data)}" for w in loads) + "; batch size 1 per request",
        f"- count windows of up to {args.request_count} requests (about {args.window_s:g} s each after a sweep's "
        f"first point), -s {args.stability_percent:g}, max trials {args.max_trials}, one retry with twice the "
        "requests; Poisson points with --async",
    ]
    table = summary_markdown(points, header)
    (out_dir / "summary.md").write_text(table)
    write_csv(out_dir / "sweep.csv", points)
    pngs = plot(points, out_dir)
    print("\n" + table, flush=True)
    say(
        f"perf.bench.sweep: {sum(p.ok for p in points)}/{len(points)} points, {len(pngs)} plots, results in "
        f"{pa.display_path(out_dir)} ({time.monotonic() - started:.0f} s)"
    )
    return 0 if points and all(p.ok for p in points) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S"
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
