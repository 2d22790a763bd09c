"""`python -m perf.bench.image_bench` (`make image-bench`): the served image ensembles against ONNX Runtime in-process.

For each ensemble given with ``--ensembles`` (default: ``image_classification``, the default
model, and ``image_classification_resnet50``; one that the repository lacks is skipped with a
note), its steps are read from its config.pbtxt: the preprocessing step (the one fed IMAGE),
the classifier (the onnxruntime step) and the postprocessing step. ``--precision`` is resolved
as the server resolves it (export/variants.py): one ``--model-config-name`` for the server,
and per classifier the variant, hence the .onnx file, it serves.

Two systems run the same pipeline on the same photos, preprocessing and postprocessing
included in both (JPEG bytes in, top-5 out):

  served      one tritonserver (no front door, no response cache: nothing answers from memory)
              loading every ensemble; an asyncio HTTP client keeps ``--concurrency`` requests in
              flight, each carrying ``batch`` images ([batch, 1] BYTES), for ``--duration``
              seconds after ``--warmup``; every latency is kept (P50, P99, max). Triton's
              statistics around each window give the classifier's mean executed batch.
  in-process  the same .onnx file in an ONNX Runtime session (OpenVINO for the openvino variant) with the served config's intra-op
              threads, spinning off; python_backends.image's preprocessing configured from the
              served preprocessing config and its top-k from the postprocessing config; the
              same batches of the same photos, for ``--inprocess-seconds``. Two layouts: one
              thread doing decode -> model -> top-k in a loop, and the served layout (as many
              threads as the preprocessing step has instances, at most as many model runs at
              once as the classifier has instances); the faster one is the in-process figure.

Before measuring, each photo goes once through both and their top-5 classes must agree (the
same model, the same preprocessing), or the run stops. Windows are interleaved: per round, per
ensemble and batch size, the served window then the in-process one; figures are medians over
``--rounds`` (max: the largest). Ratios: served / in-process per ensemble and batch, and the
first ensemble over each other one (throughput) in-process and served.

The photos are the classifier's evaluation photos (export/image_data.EVALUATION_PHOTOS),
whole, JPEG-encoded once at quality 90. Writes image_bench.md (the tables), image_bench.csv
(every window) and tritonserver.log under perf/results/image-bench-<UTC time>/ (``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from perf.bench.image_measure import InProcess, MachineMeter, Window, check_same, measure_inprocess, measure_served
from perf.bench.image_measure import image_body as image_body
from perf.bench.image_pipelines import DEFAULT_ENSEMBLES, JPEG_QUALITY, Pipeline, photo_jpegs, resolve
from perf.bench.image_pipelines import batch_of as batch_of
from perf.bench.image_pipelines import ensemble_steps as ensemble_steps
from perf.bench.image_report import _f, machine, markdown, points
from perf.lib.harness import write_csv
from perf.lib.paths import REPOSITORY
from perf.lib.paths import RESULTS as DEFAULT_RESULTS
from perf.lib.report import load_average, progress

# --------------------------------------------------------------------------- run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.image_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--ensembles",
        default=",".join(DEFAULT_ENSEMBLES),
        help="comma-separated image ensembles, the first compared with each other one "
        f"(default {','.join(DEFAULT_ENSEMBLES)}; missing ones are skipped)",
    )
    p.add_argument(
        "--precision",
        default="cpu",
        help="as PRECISION of `make serve`: cpu (the variant a CPU serves), fp32, cpu_opt, int8 (default cpu)",
    )
    p.add_argument("--batches", default="1,8", help="images per request / per in-process call (default 1,8)")
    p.add_argument("--concurrency", default="8,4", help="requests in flight, one per batch size or one for all (default 8,4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per served window (default 5)")
    p.add_argument(
        "--min-requests",
        type=int,
        default=10,
        help="a served window lasts until this many requests completed in it, at most 6 x --duration (default 10)",
    )
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of load before each served window (default 1)")
    p.add_argument("--inprocess-seconds", type=float, default=3.0, help="seconds per in-process window and layout (default 3)")
    p.add_argument(
        "--no-model-only",
        dest="model_only",
        action="store_false",
        help="skip the in-process classifier-alone figure (pixels made beforehand)",
    )
    p.add_argument("--repository", type=Path, default=REPOSITORY, help="model repository (default model_repository)")
    p.add_argument("--out", type=Path, help="results folder (default perf/results/image-bench-<UTC time>)")
    p.add_argument("--no-export", action="store_true", help="never export, even when model files are missing")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.ensemble_list = [e.strip() for e in args.ensembles.split(",") if e.strip()]
    try:
        args.batch_list = [int(b) for b in args.batches.split(",")]
        conc = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error("--batches and --concurrency take comma-separated integers")
    if len(conc) == 1:
        conc *= len(args.batch_list)
    if len(conc) != len(args.batch_list):
        p.error("--concurrency needs one value, or one per batch size")
    args.concurrency_of = dict(zip(args.batch_list, conc))
    if not args.ensemble_list or min(args.batch_list + conc) < 1 or args.rounds < 1:
        p.error("ensembles, batch sizes, concurrency and rounds must be given and positive")
    if args.duration <= 0 or args.warmup < 0 or args.inprocess_seconds <= 0:
        p.error("--duration and --inprocess-seconds must be > 0, --warmup >= 0")
    return args


def ensure_exported(repo: Path, pipes: Sequence[Pipeline], no_export: bool, say: Callable[[str], None]) -> bool:
    """Export the classifiers whose served file is missing (`python -m export --model <classifier>
    --no-speed`). Returns whether anything was exported (the variants may then differ)."""
    missing = [
        p.classifier for p in pipes if not p.model_path.is_file() or not (repo / p.postprocess / "1" / "labels.txt").is_file()
    ]
    if not missing or no_export:
        return False
    from export import __main__ as export_main

    say(f"perf.bench.image_bench: exporting {', '.join(missing)} (model files missing)")
    args = ["--no-speed", "--repository", str(repo)]
    for name in dict.fromkeys(missing):
        args += ["--model", name]
    try:
        export_main.main(args)
    except SystemExit as exc:  # an exporter that does not know the model: said, and the run reports the file
        say(f"perf.bench.image_bench: export {' '.join(args)} exited with {exc.code}")
    return True


def run(args: argparse.Namespace) -> int:
    from perf.lib.deployment import server_deployment
    from server.process import ServerError

    say = progress()

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or DEFAULT_RESULTS / f"image-bench-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    repo = args.repository.resolve()
    load_avg = load_average()
    present = [e for e in args.ensemble_list if (repo / e / "config.pbtxt").is_file()]
    notes = [f"{e} is not in the repository: skipped" for e in args.ensemble_list if e not in present]
    for note in notes:
        say(f"perf.bench.image_bench: {note}")
    if not present:
        say("perf.bench.image_bench: no ensemble to measure")
        return 1
    config_name, pipes = resolve(repo, present, args.precision)
    if ensure_exported(repo, pipes, args.no_export, say):
        config_name, pipes = resolve(repo, present, args.precision)
    photos = photo_jpegs()
    blobs = [b for _, b in photos]
    described = ", ".join(f"{p.ensemble} ({p.classifier}: {p.variant}, {p.model_path.name})" for p in pipes)
    say(
        f"perf.bench.image_bench: {described}"
        f"; --model-config-name={config_name or '(none)'}; {len(photos)} photos, {sum(map(len, blobs)) // 1024} KiB"
    )
    models = [p.ensemble for p in pipes]
    workdir = Path(tempfile.mkdtemp(prefix="perf-image-bench-"))
    server = server_deployment(models, workdir, model_repository=repo, model_config_name=config_name, front_door=False)
    windows: list[Window] = []
    failure = ""
    agreement: dict[str, float] = {}
    try:
        runners = {p.ensemble: InProcess(p, repo, config_name) for p in pipes}
        model_only = {e: r.model_only(blobs) for e, r in runners.items()} if args.model_only else {}
        server.start()
        try:
            server.wait_ready(timeout=300)
        except ServerError as exc:
            raise RuntimeError(f"{exc}\n{exc.log_tail}") from None
        say(f"tritonserver ready on {server.http_url} ({', '.join(models)})")
        for pipe in pipes:
            agreement[pipe.ensemble] = check_same(server.http_url, runners[pipe.ensemble], photos)
            say(
                f"{pipe.ensemble}: served and in-process top-5 agree on every photo "
                f"(largest score difference {agreement[pipe.ensemble]:.1e})"
            )
        for rnd in range(1, args.rounds + 1):
            for pipe in pipes:
                for b in args.batch_list:
                    if b > pipe.max_batch_size:
                        continue
                    conc = args.concurrency_of[b]
                    w = Window("served", pipe.ensemble, b, rnd, f"c{conc}")
                    meter = MachineMeter()
                    measure_served(server.http_url, pipe, blobs, b, conc, args.warmup, args.duration, w, args.min_requests)
                    meter.stop(w)
                    windows.append(w)
                    say(
                        f"r{rnd} {pipe.ensemble:32} b{b:<3} served     {w.layout:4} {_f(w.images_per_s):>7} images/s  "
                        f"P50 {_f(w.p50_ms):>7}  P99 {_f(w.p99_ms):>7}  max {_f(w.max_ms):>7} ms  classifier batch "
                        f"{_f(w.classifier_batch)}  client {_f(w.client_cores, 2)} machine {_f(w.machine_cores, 2)} cores  "
                        f"errors {w.errors}" + (f" ({w.first_error})" if w.first_error else "")
                    )
                    layouts: list[tuple[str, int, Callable[[Sequence[bytes]], object]]] = [
                        ("in-process", t, runners[pipe.ensemble]) for t in sorted({1, pipe.preprocess_instances})
                    ]
                    if args.model_only:
                        layouts.append(("model only", 1, model_only[pipe.ensemble]))
                    for system, threads, runner in layouts:
                        w = Window(system, pipe.ensemble, b, rnd, f"{threads}t")
                        meter = MachineMeter()
                        measure_inprocess(runner, blobs, b, threads, args.inprocess_seconds, w)
                        meter.stop(w)
                        windows.append(w)
                        say(
                            f"r{rnd} {pipe.ensemble:32} b{b:<3} {system:10} {w.layout:4} {_f(w.images_per_s):>7} "
                            f"images/s  P50 {_f(w.p50_ms):>7}  P99 {_f(w.p99_ms):>7}  max {_f(w.max_ms):>7} ms  "
                            f"this process {_f(w.client_cores, 2)} machine {_f(w.machine_cores, 2)} cores  "
                            f"errors {w.errors}" + (f" ({w.first_error})" if w.first_error else "")
                        )
    except Exception as exc:  # noqa: BLE001 - reported with what was measured
        failure = f"{type(exc).__name__}: {exc}"
        say(f"perf.bench.image_bench stopped: {failure}")
    finally:
        server.stop(logs_to=out)
        shutil.rmtree(workdir, ignore_errors=True)

    results = points(windows)
    header = [
        "# Image classification: served ensembles against ONNX Runtime in-process",
        "",
        f"- {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}; load average before {load_avg}, "
        f"after {load_average()}",
        f"- command: `{' '.join(['python -m perf.bench.image_bench', *args.argv])}`",
        f"- precision {args.precision}: --model-config-name={config_name or '(none)'}; "
        + "; ".join(
            f"{p.classifier} serves {p.variant} ({p.model_path.name}, {p.threads} intra-op threads x "
            f"{p.classifier_instances} instance(s); weights {p.weights or 'unknown'}), {p.preprocess} "
            f"{p.preprocess_instances} instance(s)"
            for p in pipes
        ),
        (
            f"- {len(photos)} photos (the evaluation photos, whole, JPEG quality {JPEG_QUALITY}), batches "
            f"cycling through them; served: tritonserver without front door or response cache, HTTP (binary tensors), "
            f"{', '.join(f'batch {b} at concurrency {c}' for b, c in args.concurrency_of.items())}, {args.warmup:g} s "
            f"warm-up (and until as many requests as in flight completed) + {args.duration:g} s per window (longer "
            f"until {args.min_requests} requests completed in it, at most {6 * args.duration:g} s); in-process: "
            f"{args.inprocess_seconds:g} s (at least 3 calls) per layout "
            f"(`1t`: one thread; `2t`: the served layout, threads = preprocessing instances, model runs at once <= "
            f"classifier instances), the faster shown; {args.rounds} interleaved round(s), medians (max: the largest)"
        ),
        "- both systems: JPEG bytes in, top-5 out (decode, resize, crop, normalise, the classifier, softmax and top-k); "
        "latency is per request (served) or per call (in-process) of `batch` images; classifier batch: the served "
        "classifier's mean executed batch (Triton's statistics); cores, this process: the load generator's CPU "
        "(served) or the pipeline's own (in-process); machine: busy cores of the whole machine, neighbours included; "
        "model only: the classifier's session alone on pixels made beforehand (what decoding and top-k leave); n: "
        "requests (served) or calls (in-process) measured over all rounds; with few, P99 is the max",
    ]
    if agreement:
        header.append(
            "- served and in-process top-5 classes agree on every photo; largest score difference "
            + ", ".join(f"{e} {d:.1e}" for e, d in agreement.items())
        )
    header += [f"- {n}" for n in notes]
    if failure:
        header.append(f"- stopped early: {failure.splitlines()[0]}")
    errors = sum(w.errors for w in windows)
    if errors:
        header.append(f"- {errors} failed requests; first: {next(w.first_error for w in windows if w.errors)}")
    table = markdown(header, pipes, results)
    (out / "image_bench.md").write_text(table)
    write_csv(out / "image_bench.csv", [w.record() for w in windows])
    print("\n" + table, flush=True)
    say(f"perf.bench.image_bench: results in {out}")
    expected = sum(len([b for b in args.batch_list if b <= p.max_batch_size]) for p in pipes) * (3 if args.model_only else 2)
    complete = len(results) == expected and all(p.images_per_s for p in results)
    return 0 if not failure and not errors and complete else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
