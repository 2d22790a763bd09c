"""`python -m perf.bench.image_bench` (`make image-bench`): the served image ensembles against ONNX Runtime in-process.

Each of ``--ensembles`` runs whole (JPEG in, top-5 out) on the evaluation photos, ``--precision``
resolved as the server does: ``served`` (one tritonserver, no front door or response cache, the
shared closed loop at ``--concurrency`` requests of ``batch`` images; the classifier's mean batch from
Triton's statistics) and ``in-process`` (the same file in ONNX Runtime or OpenVINO with the served
preprocessing and top-k, one thread and the served layout, the faster shown; ``model only``: the
classifier alone). Each photo's top-5 must agree first. Windows interleave; figures are medians over
``--rounds``. Writes summary.md, results.json and tritonserver.log to perf/results/image-bench-<UTC time>/.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from perf.bench import image_pipelines as pipelines
from perf.lib import lifecycle, options, processes, report
from perf.lib.load import Tally, call_loop, closed_loop, latency_ms
from perf.lib.options import int_list
from perf.lib.paths import REPOSITORY
from perf.lib.stats import median
from perf.lib.workload import image_request

PROG = "perf.bench.image_bench"
FIGURES = "images_per_s:1 p50_ms:1 p99_ms:1 max_ms:1 classifier_batch:1 client_cores:2 machine_cores:2".split()
COLUMNS = "ensemble|variant|system|layout|batch|n|images/s|P50 ms|P99 ms|max ms|classifier batch|cores: this process|machine"


@dataclass
class Window:
    """One measurement (a system, an ensemble, a batch size, a round); from ``points``, the median
    over a point's rounds (``round``: how many)."""

    system: str  # served, in-process, model only
    ensemble: str
    batch: int
    round: int
    layout: str = ""  # served: "c<concurrency>"; in-process: "<threads>t"
    requests: int = 0  # requests (served) or calls (in-process) of ``batch`` images
    images: int = 0
    seconds: float = 0.0
    errors: int = 0
    first_error: str = ""
    images_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    client_cores: float | None = None  # the load generator's CPU (served) or the pipeline's (in-process)
    classifier_batch: float | None = None  # served: the classifier's mean executed batch (Triton's statistics)
    classifier_compute_ms: float | None = None
    classifier_queue_ms: float | None = None
    machine_cores: float | None = None  # busy cores of the whole machine, neighbours included (/proc/stat)

    def take(self, tally: Tally) -> None:
        """The figures of a load loop's Tally (latencies of ``batch`` images each)."""
        self.requests, self.images, self.seconds = len(tally.ok), len(tally.ok) * self.batch, tally.seconds
        self.errors, self.first_error = tally.errors, tally.first_error
        for key, value in latency_ms(tally.ok).items():
            setattr(self, key, value)
        self.images_per_s = self.images / self.seconds if tally.ok and self.seconds > 0 else None

    def line(self) -> str:
        f, what = report.fmt, f"r{self.round} {self.ensemble} b{self.batch} {self.system} {self.layout}"
        figures = f"{f(self.images_per_s)} images/s, P50 {f(self.p50_ms)} P99 {f(self.p99_ms)} max {f(self.max_ms)} ms"
        return f"{what}: {figures}, classifier batch {f(self.classifier_batch)}; errors {self.errors} {self.first_error}"


MEDIANS = ("images_per_s", "p50_ms", "p99_ms", "classifier_batch", "client_cores", "machine_cores")


def points(windows: Sequence[Window]) -> list[Window]:
    """Per system, ensemble and batch: the medians over rounds of the best layout (by images/s)."""
    groups: dict[tuple, list[Window]] = {}
    for w in windows:
        groups.setdefault((w.system, w.ensemble, w.batch, w.layout), []).append(w)
    best: dict[tuple, Window] = {}
    for ws in groups.values():
        maxes = [w.max_ms for w in ws if w.max_ms is not None]
        p = replace(ws[0], round=len(ws), requests=sum(w.requests for w in ws), errors=sum(w.errors for w in ws))
        for name in MEDIANS:
            setattr(p, name, median([getattr(w, name) for w in ws]))
        p.max_ms = max(maxes) if maxes else None
        key = (p.system, p.ensemble, p.batch)
        if key not in best or (p.images_per_s or 0.0) > (best[key].images_per_s or 0.0):
            best[key] = p
    return list(best.values())


def metered(window: Window, measure: Callable[..., Tally], *args) -> Window:
    """The Tally of ``measure(*args)`` in ``window``, with the window's CPU: this process's and the machine's."""
    busy0, cpu0, wall0 = processes.machine_busy_s(), time.process_time(), time.monotonic()
    window.take(measure(*args, window))
    wall, busy1 = max(time.monotonic() - wall0, 1e-9), processes.machine_busy_s()
    window.client_cores = (time.process_time() - cpu0) / wall
    window.machine_cores = (busy1 - busy0) / wall if busy0 is not None and busy1 is not None else None
    return window


def measure_inprocess(runner: Callable[[Sequence[bytes]], object], blobs, threads: int, seconds: float, window: Window) -> Tally:
    """``threads`` threads each running the pipeline on successive batches for ``seconds``."""

    async def call(n: int) -> None:
        await asyncio.to_thread(runner, pipelines.batch_of(blobs, window.batch, n))

    return asyncio.run(call_loop(call, threads, seconds))


def measure_served(http_url: str, pipe: pipelines.Pipeline, blobs, concurrency: int, args, window: Window) -> Tally:
    """The shared closed loop, again (without warm-up) until ``--min-requests`` answered, at most 6 x --duration."""
    from perf.lib import triton_stats

    bodies = [image_request(*pipelines.batch_of(blobs, window.batch, k)) for k in range(len(blobs))]
    url, before = f"http://{http_url}/v2/models/{pipe.ensemble}/infer", triton_stats.snapshot(http_url)
    tally = Tally()
    while tally.seconds < 6 * args.duration and (not tally.seconds or len(tally.ok) + tally.errors < args.min_requests):
        warm = {"warmup": args.warmup, "warm": bodies[:concurrency]} if not tally.seconds else {}
        tally.merge(asyncio.run(closed_loop(url, lambda n: bodies[n % len(bodies)], concurrency, args.duration, **warm)))
    stats = triton_stats.fetch_delta(http_url, before).get(pipe.classifier)
    if stats is not None:
        window.classifier_batch = stats.avg_batch
        window.classifier_compute_ms = stats.breakdown_ms.get("compute infer")
        window.classifier_queue_ms = stats.breakdown_ms.get("queue")
    return tally


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = options.parser(PROG, __doc__)
    names = ",".join(pipelines.DEFAULT_ENSEMBLES)
    p.add_argument("--ensembles", default=names, help=f"image ensembles, the first compared with the others (default {names})")
    p.add_argument("--precision", default="cpu", help="as PRECISION of `make serve`: cpu, fp32, cpu_opt, int8 (default cpu)")
    p.add_argument("--batches", type=int_list, default=[1, 8], help="images per request / in-process call (default 1,8)")
    p.add_argument("--concurrency", type=int_list, default=[8, 4], help="requests in flight, per batch size or one (default 8,4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per served window (default 5)")
    p.add_argument("--min-requests", type=int, default=10, help="served windows until this many answers, <= 6 x --duration")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of load before each served window (default 1)")
    p.add_argument("--inprocess-seconds", type=float, default=3.0, help="seconds per in-process window and layout (default 3)")
    p.add_argument("--repository", type=Path, default=REPOSITORY, help="model repository (default model_repository)")
    p.add_argument("--out", type=Path, help="results folder (default perf/results/image-bench-<UTC time>)")
    p.add_argument("--no-export", action="store_true", help="never export, even when model files are missing")
    args = options.finish(p, p.parse_args(argv), argv)
    args.ensemble_list = [e.strip() for e in args.ensembles.split(",") if e.strip()]
    conc = args.concurrency * len(args.batches) if len(args.concurrency) == 1 else args.concurrency
    if len(conc) != len(args.batches):
        p.error("--concurrency needs one value, or one per batch size")
    args.concurrency_of = dict(zip(args.batches, conc))
    if not args.ensemble_list or args.warmup < 0 or args.inprocess_seconds <= 0:
        p.error("--ensembles must be given, --inprocess-seconds > 0, --warmup >= 0")
    return args


def ensure_exported(repo: Path, pipes: Sequence[pipelines.Pipeline], say: Callable[[str], None]) -> bool:
    """Export each classifier whose files are missing; whether one was (the variants may then differ)."""
    labels = {p.classifier: repo / p.postprocess / "1" / "labels.txt" for p in pipes}
    missing = [p.classifier for p in pipes if not p.model_path.is_file() or not labels[p.classifier].is_file()]
    if not missing:
        return False
    from export import __main__ as export_main

    args = ["--no-speed", "--repository", str(repo)] + [a for name in dict.fromkeys(missing) for a in ("--model", name)]
    say(f"perf.bench.image_bench: exporting {', '.join(missing)} (model files missing)")
    try:
        export_main.main(args)
    except SystemExit as exc:  # an exporter that does not know the model: said, and the run reports the file
        say(f"perf.bench.image_bench: export {' '.join(args)} exited with {exc.code}")
    return True


def run(args: argparse.Namespace) -> int:
    from perf.lib.deployment import server_deployment

    say, load_before = report.progress(), report.load_average()
    out, repo = report.results_dir(args.out, "image-bench"), args.repository.resolve()
    present = [e for e in args.ensemble_list if (repo / e / "config.pbtxt").is_file()]
    notes = [f"{e} is not in the repository: skipped" for e in args.ensemble_list if e not in present]
    for note in notes:
        say(f"perf.bench.image_bench: {note}")
    if not present:
        return 1
    config_name, pipes = pipelines.resolve(repo, present, args.precision)
    if not args.no_export and ensure_exported(repo, pipes, say):
        config_name, pipes = pipelines.resolve(repo, present, args.precision)
    photos = pipelines.photo_jpegs()
    blobs = [b for _, b in photos]
    say(f"perf.bench.image_bench: {describe(pipes, config_name)}; {len(photos)} photos, {sum(map(len, blobs)) // 1024} KiB")
    workdir = Path(tempfile.mkdtemp(prefix="perf-image-bench-"))
    options = {"model_repository": repo, "model_config_name": config_name, "front_door": False}
    server = server_deployment([p.ensemble for p in pipes], workdir, **options)
    windows: list[Window] = []
    failure = ""
    agreement: dict[str, float] = {}
    try:
        runners = {p.ensemble: pipelines.InProcess(p, repo, config_name) for p in pipes}
        model_only = {e: r.model_only(blobs) for e, r in runners.items()}
        if not lifecycle.wait_ready({"image-bench": server.start()}, say):
            raise RuntimeError("tritonserver did not become ready")
        url = server.http_url
        for pipe in pipes:
            agreement[pipe.ensemble] = pipelines.check_same(url, runners[pipe.ensemble], photos)
            say(f"{pipe.ensemble}: served and in-process top-5 agree (largest score difference {agreement[pipe.ensemble]:.1e})")
        for rnd in range(1, args.rounds + 1):
            for pipe in pipes:
                for b in (b for b in args.batches if b <= pipe.max_batch_size):
                    conc = args.concurrency_of[b]
                    w = metered(Window("served", pipe.ensemble, b, rnd, f"c{conc}"), measure_served, url, pipe, blobs, conc, args)
                    windows.append(w)
                    say(w.line())
                    inproc = [("in-process", t, runners[pipe.ensemble]) for t in sorted({1, pipe.preprocess_instances})]
                    for system, t, runner in [*inproc, ("model only", 1, model_only[pipe.ensemble])]:
                        w = Window(system, pipe.ensemble, b, rnd, f"{t}t")
                        windows.append(metered(w, measure_inprocess, runner, blobs, t, args.inprocess_seconds))
                        say(w.line())
    except Exception as exc:  # noqa: BLE001 - reported with what was measured
        failure = f"{type(exc).__name__}: {exc}"
        say(f"perf.bench.image_bench stopped: {failure}")
    finally:
        server.stop(logs_to=out)
        shutil.rmtree(workdir, ignore_errors=True)

    results = points(windows)
    errors = [w for w in windows if w.errors]
    served = ", ".join(f"batch {b} at concurrency {c}" for b, c in args.concurrency_of.items())
    lines = report.header("Image classification: served ensembles against ONNX Runtime in-process", PROG, args.argv, load_before)
    lines += [
        f"- {machine()}",
        f"- precision {args.precision}: {describe(pipes, config_name)}",
        f"- {len(photos)} photos; served: {served}, {args.warmup:g} s warm-up + {args.duration:g} s windows (until "
        f"{args.min_requests} requests, at most {6 * args.duration:g} s); in-process: {args.inprocess_seconds:g} s per layout; "
        f"{args.rounds} interleaved round(s), medians (max: the largest); n: requests or calls over all rounds",
        "- cores: the load generator's CPU (served) or the pipeline's (in-process); machine: busy cores of the whole machine",
    ]
    if agreement:
        differences = ", ".join(f"{e} {d:.1e}" for e, d in agreement.items())
        lines.append(f"- served and in-process top-5 classes agree on every photo; largest score difference {differences}")
    lines += [f"- {n}" for n in notes]
    if failure:
        lines.append(f"- stopped early: {failure.splitlines()[0]}")
    if errors:
        lines.append(f"- {sum(w.errors for w in errors)} failed requests; first: {errors[0].first_error}")
    data = {"command": args.argv, "error": failure, "windows": list(map(asdict, windows)), "points": list(map(asdict, results))}
    report.write(out, markdown(lines, pipes, results), data, say=say)
    expected = sum(len([b for b in args.batches if b <= p.max_batch_size]) for p in pipes) * 3
    complete = len(results) == expected and all(p.images_per_s for p in results)
    return 0 if not failure and not errors and complete else 1


def describe(pipes: Sequence[pipelines.Pipeline], config_name: str | None) -> str:
    return f"--model-config-name={config_name or '(none)'}; " + "; ".join(
        f"{p.ensemble}: {p.classifier} serves {p.variant} ({p.model_path.name}, {p.threads} threads x {p.classifier_instances} "
        f"instance(s), weights {p.weights or 'unknown'}), {p.preprocess} {p.preprocess_instances} instance(s)"
        for p in pipes
    )


def machine() -> str:
    import onnxruntime

    return f"{report.cpu_model()}, no GPU used, onnxruntime {onnxruntime.__version__}"


def markdown(lines: Sequence[str], pipes: Sequence[pipelines.Pipeline], results: Sequence[Window]) -> str:
    by = {(p.system, p.ensemble, p.batch): p for p in results}
    batches = sorted({p.batch for p in results})

    def ratio(system: str, first: str, b: int, other: str, other_system: str) -> str:
        a, z = (getattr(by.get(key), "images_per_s", None) for key in ((system, first, b), (other_system, other, b)))
        return report.fmt(a / z if a is not None and z else None, 2, missing="-")

    rows = []
    for pipe, b, system in ((pipe, b, s) for pipe in pipes for b in batches for s in ("served", "in-process", "model only")):
        if (p := by.get((system, pipe.ensemble, b))) is not None:
            share = ratio("served", pipe.ensemble, b, pipe.ensemble, "in-process") if system == "served" else ""
            cells = [report.fmt(getattr(p, key), int(digits), missing="-") for key, _, digits in map(str.partition, FIGURES, ":")]
            rows.append([pipe.ensemble, pipe.variant, system, p.layout, b, p.requests, *cells, share])
    parts = ["\n".join(lines), "## Served vs in-process (same .onnx file, same photos, preprocessing included in both)"]
    parts.append(report.table([*COLUMNS.split("|"), "served / in-process"], rows, left=4))
    if len(pipes) > 1:
        first = pipes[0].ensemble
        rows = [
            [f"{first} / {other.ensemble}", b] + [ratio(s, first, b, other.ensemble, s) for s in ("in-process", "served")]
            for other in pipes[1:]
            for b in batches
        ]
        parts.append(f"## {first} over each other ensemble (images/s ratio, same batch)")
        parts.append(report.table(["ensemble", "batch", "in-process", "served"], rows))
    return "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
