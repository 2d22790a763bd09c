"""`python -m perf.bench.sweep` (`make perf`): concurrency and Poisson request-rate sweeps with perf_analyzer.

Per model (text_embedding and image_classification by default), input set (perf/data's "16tok"
and "mixed", or --input-data; sample JPEGs) and protocol (gRPC, HTTP): a concurrency sweep, then
Poisson rates at --rates or --rate-fractions of its peak (--no-rates: none), on one tritonserver or
--url. Windows last about --window-s at the measured throughput; sweeps share --time-budget. Writes
perf_analyzer's CSV and log per point, sweep.csv, summary.md (per-step queue, compute, batch) and
PNG plots (throughput vs concurrency, latency vs throughput) under perf/results/sweep-<UTC time>/.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from perf.lib import harness, options
from perf.lib import perf_analyzer as pa
from perf.lib.harness import Row
from perf.lib.paths import DATA, REPOSITORY
from perf.lib.report import display_path, load_average
from perf.lib.stats import measured

TEXT_MODEL = "text_embedding"
IMAGE_MODEL = "image_classification"
MODELS = (TEXT_MODEL, IMAGE_MODEL)
TEXT_DATA = {"16tok": DATA / "sentences_16tok.json", "mixed": DATA / "sentences_mixed.json"}
# The model files each ensemble needs before a server can load it (the export writes them).
REQUIRED_FILES = {
    TEXT_MODEL: ("text_tokenizer/1/tokenizer.json", "text_encoder/1/model.onnx"),
    IMAGE_MODEL: ("image_classifier/1/model.onnx",),
}
EXPORT_NAMES = {TEXT_MODEL: "text_encoder", IMAGE_MODEL: "image_classifier"}
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


def rates_from_peak(peak: float | None, fractions: Sequence[float]) -> list[float]:
    """Request rates (req/s) at ``fractions`` of ``peak``, rounded to whole requests, at least 1, distinct."""
    return list(dict.fromkeys(float(max(1, round(f * peak))) for f in fractions)) if peak and peak > 0 else []


def window_requests(throughput: float | None, window_s: float, lo: int, hi: int) -> int:
    """Requests per count window so one window lasts about ``window_s`` at ``throughput``, in [lo, hi]."""
    if not throughput or throughput <= 0:
        return lo
    return int(min(hi, max(lo, round(throughput * window_s))))


def peak(rows: Sequence[Row], workload: str, protocol: str) -> Row | None:
    """The concurrency point with the highest throughput of one sweep."""
    conc = [r for r in rows if r.ok and r.kind == "concurrency" and r.system == workload and r.protocol == protocol]
    return max(conc, key=lambda r: measured(r.throughput), default=None)


def summary(rows: Sequence[Row], head: Sequence[str]) -> list[str]:
    lines = [*head, "", *harness.table(rows)]
    for workload in dict.fromkeys(r.system for r in rows):
        best = [(p, b) for p in dict.fromkeys(r.protocol for r in rows) if (b := peak(rows, workload, p)) is not None]
        if best:
            lines += [
                "",
                f"Peak of {workload}: " + ", ".join(f"{p} {b.throughput:.1f} infer/s at {b.load}" for p, b in best) + ".",
            ]
    return lines + harness.breakdown(rows)


def plot(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """Throughput vs concurrency and P50/P99 vs throughput per model and input set; the PNGs written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []

    def save(fig, ax, title: str, path: Path, legend_size: int | None = None) -> None:
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=legend_size)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    for workload in dict.fromkeys(r.system for r in rows):
        group = [r for r in rows if r.system == workload and r.ok]

        def sweep(kind: str, protocol: str, group: list[Row] = group) -> list[Row]:
            return sorted((r for r in group if r.kind == kind and r.protocol == protocol), key=lambda r: measured(r.throughput))

        protocols = list(dict.fromkeys(r.protocol for r in group))
        if not group:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for protocol in protocols:
            if conc := sorted(sweep("concurrency", protocol), key=lambda r: r.level):
                ax.plot([r.level for r in conc], [measured(r.throughput) for r in conc], marker="o", label=protocol)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrency (requests in flight)", ylabel="throughput (inferences/s)")
        ax.set_ylim(bottom=0)
        save(fig, ax, f"{workload}: throughput vs concurrency", out_dir / f"throughput_vs_concurrency_{workload}.png")

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for i, protocol in enumerate(protocols):
            for kind, marker in (("concurrency", "o"), ("rate", "^")):
                pts = sweep(kind, protocol)
                label = f"{protocol}, {'Poisson' if kind == 'rate' else kind}"
                x = [measured(r.throughput) for r in pts]
                style = {"marker": marker, "color": colors[i % len(colors)]}
                ax.plot(x, [measured(r.p50_ms) for r in pts], linestyle="-", label=f"{label}, p50", **style)
                ax.plot(x, [measured(r.p99_ms) for r in pts], linestyle="--", label=f"{label}, p99", **style)
        ax.set_yscale("log")
        ax.set(xlabel="throughput (inferences/s)", ylabel="latency (ms)")
        title = f"{workload}: P50 (solid) and P99 (dashed) vs throughput"
        save(fig, ax, title, out_dir / f"latency_vs_throughput_{workload}.png", legend_size=7)
    return written


def write_image_input(path: Path, count: int = IMAGE_COUNT, side: int = IMAGE_SIDE) -> Path:
    """perf_analyzer input of ``count`` JPEGs: the sample photos the image export uses, downscaled."""
    from export import image_data
    from perf.lib.workload import photos

    blobs = []
    for image in photos(count):
        image = image.copy()
        image.thumbnail((side, side))
        blobs.append(image_data.encode(image, "JPEG"))
    return image_data.write_perf_analyzer_input(path, blobs)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = harness.parser(
        "sweep",
        __doc__,
        "CI smoke (about a minute): text_embedding (both input sets) over gRPC, concurrency 1,8, one rate, small windows",
        time_budget=(900.0, 75.0),
        models=(list(MODELS), [TEXT_MODEL]),
        text_data=(list(TEXT_DATA), list(TEXT_DATA)),
        protocols=(list(pa.PROTOCOLS), ["grpc"]),
        concurrency=([1, 2, 4, 8, 16, 32], [1, 8]),
        rate_fractions=([0.25, 0.5, 0.7, 0.9], [0.7]),
        window_s=(2.0, 0.5),
    )
    p.add_argument("--models", type=options.choices(MODELS), help=f"default {','.join(MODELS)} (--quick: {TEXT_MODEL})")
    p.add_argument(
        "--text-data", type=options.choices(tuple(TEXT_DATA)), help="16tok (exactly 16 tokens), mixed (8-128); default both"
    )
    p.add_argument("--protocols", type=options.choices(pa.PROTOCOLS), help="default grpc,http (--quick: grpc)")
    p.add_argument("--concurrency", type=options.int_list, help="default 1,2,4,8,16,32 (--quick: 1,8)")
    p.add_argument("--rates", type=options.float_list, help="Poisson request rates in req/s (default: --rate-fractions of peak)")
    p.add_argument(
        "--rate-fractions",
        type=options.float_list,
        help="of the concurrency sweep's peak (default 0.25,0.5,0.7,0.9; --quick: 0.7)",
    )
    p.add_argument("--no-rates", action="store_true", help="the concurrency sweep only")
    p.add_argument(
        "--window-s", type=float, help="seconds per window after a sweep's first point (default 2, --quick 0.5; 0: fixed)"
    )
    p.add_argument("--url", metavar="HOST:PORT", help="measure this running server's endpoint for the one protocol asked for")
    args = harness.parse(p, argv)
    if args.window_s < 0:
        p.error("--window-s must not be negative")
    if args.url and len(args.protocols) != 1:
        p.error("--url needs exactly one protocol (--protocols)")
    return args


def workloads(args: argparse.Namespace, out_dir: Path) -> list[Workload]:
    texts = {args.input_data.stem: args.input_data} if args.input_given else {n: TEXT_DATA[n] for n in args.text_data}
    # The first window of a sweep is small when later ones are sized from the measured throughput.
    first = args.request_count if args.window_s == 0 else min(args.request_count, 100)
    result = [Workload(TEXT_MODEL, name, path, first) for name, path in texts.items() if TEXT_MODEL in args.models]
    if IMAGE_MODEL in args.models:
        # ResNet-50 on a few CPU cores: tens of images/s; a text-sized first window would take minutes.
        result.append(
            Workload(IMAGE_MODEL, "images", write_image_input(out_dir / "images.json"), max(10, args.request_count // 25))
        )
    return result


def run_sweep(run: harness.Run, w: Workload, protocol: str, url: str, stats_url: str | None) -> list[Row]:
    """Concurrency then Poisson rate sweep of one workload over one protocol, within run.deadline."""
    a = run.args
    rows: list[Row] = []
    request_count = w.request_count
    total = len(a.concurrency) + (0 if a.no_rates else len(a.rates or a.rate_fractions))

    def one(kind: str, load: float) -> Row:
        label = f"c{load:g}" if kind == "concurrency" else f"Poisson {load:g}/s"
        key = f"{w.name}-{protocol}-{'c' if kind == 'concurrency' else 'r'}{load:g}"
        row = Row(key, w.name, protocol, label, kind=kind, level=load)
        row.tags = {"model": w.model, "data": w.data, "request_count": request_count}
        run.say(f"  [{w.name} {protocol} {len(rows) + 1}/{total}] {label}, windows of {request_count} ({run.left():.0f} s left)")
        if run.left() < 8:
            row.error = "time budget used up"
            return row
        conc, rate = (int(load), None) if kind == "concurrency" else (1, load)
        # Leave the points after this one some seconds each (at most two are reserved).
        steps = min(total - len(rows) - 1, 2)
        settings = {"model": w.model, "input_data": w.input_data, "request_count": request_count}
        return harness.point(run, row, url, concurrency=conc, rate=rate, steps_after=steps, stats_url=stats_url, **settings)

    for c in a.concurrency:
        rows.append(one("concurrency", float(c)))
        if rows[-1].ok and a.window_s:  # size the next windows from what this point achieved
            request_count = window_requests(rows[-1].throughput, a.window_s, 20, a.request_count)
    if a.no_rates:
        return rows
    best = peak(rows, w.name, protocol)
    rates = a.rates or rates_from_peak(best.throughput if best else None, a.rate_fractions)
    if not rates:
        tags: dict[str, object] = {"model": w.model, "data": w.data}
        missing = "no peak throughput measured"
        return rows + [
            Row(f"{w.name}-{protocol}-r{f:g}x", w.name, protocol, f"{f:g} x peak", error=missing, kind="rate", tags=tags)
            for f in a.rate_fractions
        ]
    total = len(a.concurrency) + len(rates)
    for rate in rates:
        request_count = window_requests(rate, a.window_s, 20, a.request_count) if a.window_s else a.request_count
        rows.append(one("rate", rate))
    return rows


def run(args: argparse.Namespace) -> int:
    from export.variants import resolve_precision
    from server.process import ServerError

    state = harness.new_run(args, "sweep")
    if state is None:
        return 2
    files = [REPOSITORY / f for m in args.models for f in REQUIRED_FILES[m]]
    if not args.url and not harness.ensure_exported(args, state.say, [EXPORT_NAMES[m] for m in args.models], files):
        return 1
    config_name, served = resolve_precision(REPOSITORY, [EXPORT_NAMES[m] for m in args.models], args.precision)
    loads = workloads(args, state.out_dir)
    groups = [(w, protocol) for w in loads for protocol in args.protocols]
    load = load_average()
    rates = "none" if args.no_rates else args.rates or [f"{f:g} x peak" for f in args.rate_fractions]
    state.say(
        f"perf.bench.sweep: {len(groups)} sweeps ({', '.join(w.name for w in loads)} x {', '.join(args.protocols)}), "
        f"concurrency {args.concurrency}, rates {rates}, budget {args.time_budget:.0f} s, load average {load}"
    )

    def sweeps(urls: dict[str, str], stats_url: str | None) -> None:
        for i, (w, protocol) in enumerate(groups):
            share = state.left() / (len(groups) - i)  # an equal share of what is left for each remaining sweep
            state.say(f"sweep {i + 1}/{len(groups)}: {w.name} over {protocol} ({share:.0f} s)")
            state.rows += run_sweep(
                dataclasses.replace(state, deadline=time.monotonic() + share), w, protocol, urls[protocol], stats_url
            )

    try:
        if args.url:
            sweeps({args.protocols[0]: args.url}, args.url if args.protocols == ["http"] else None)
        else:
            with harness.triton(state, args.models, config_name, timeout=300.0) as server:
                sweeps({"grpc": server.grpc_url, "http": server.http_url}, server.http_url)
    except ServerError as exc:
        state.say(f"    {exc}\n{exc.log_tail}")
        return 1
    target = args.url or f"{served} (--model-config-name={config_name or 'none'}), one tritonserver for the whole run"
    windows = f"about {args.window_s:g} s each after a sweep's first point" if args.window_s else "fixed"
    head = harness.header(
        "perf_analyzer sweep",
        args,
        "sweep",
        load,
        f"served: {target}",
        "inputs: " + ", ".join(f"{w.name} = {display_path(w.input_data)}" for w in loads) + "; batch size 1 per request",
        f"count windows of up to {args.request_count} requests ({windows}), -s {args.stability_percent:g}, max trials "
        f"{args.max_trials}, one retry with twice the requests; Poisson points with --async",
    )
    harness.finish(state, "sweep", summary(state.rows, head), "sweep.csv", [r.record() for r in state.rows])
    pngs = plot(state.rows, state.out_dir)
    state.say(f"perf.bench.sweep: {sum(r.ok for r in state.rows)}/{len(state.rows)} points, {len(pngs)} plots")
    return 0 if state.rows and all(r.ok for r in state.rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
