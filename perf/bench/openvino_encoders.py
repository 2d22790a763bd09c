"""`python -m perf.bench.openvino_encoders`: the exported encoder files on ONNX Runtime and on OpenVINO, in process.

Each served encoder (``text_encoder``, ``image_classifier``, ``text_cross_encoder`` when exported)
and each of its files (``model.onnx`` FP32, ``model.int8.onnx``) runs the same batches on **ort**
and **openvino** (its CPU plugin, the same threads, its default precision: BF16 on CPUs with AVX-512
BF16 or AMX, else FP32), each opened as the server opens it (export.bench.open_session). Rounds
interleave every (runtime, file); the figure is the median items/s, beside the agreement with ONNX
Runtime on the FP32 file (minimum cosine, top-1 agreement for the classifier, max abs difference of
a cross-encoder's logit).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from export.bench import open_session
from perf.lib import options, report
from perf.lib.paths import REPOSITORY
from perf.lib.stats import median

FILES = {"fp32": "model.onnx", "int8": "model.int8.onnx"}
MODELS = ("text_encoder", "image_classifier", "text_cross_encoder")
Feeds = dict[str, dict[str, np.ndarray]]


def runner(runtime: str, path: Path, threads: int) -> Callable[[dict], np.ndarray]:
    """One file's session as the server opens it (export.bench.open_session): ONNX Runtime, or OpenVINO's CPU plugin."""
    session = open_session(runtime, path, threads)
    return lambda feed: session.run(None, feed)[0]


def feeds(model: str, seed: int = 0) -> Feeds:
    """The batches each model runs: (batch x tokens) of random ids, or batches of random images."""
    rng = np.random.default_rng(seed)
    if model == "image_classifier":
        return {f"{b} images": {"pixel_values": rng.standard_normal((b, 3, 224, 224), dtype=np.float32)} for b in (1, 8, 32)}
    out = {}
    for batch, tokens in ((16, 64), (64, 64)) if model == "text_cross_encoder" else ((16, 16), (64, 16), (64, 64)):
        ids = rng.integers(1000, 29000, size=(batch, tokens), dtype=np.int64)
        ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
        out[f"{batch}x{tokens}"] = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return out


def agreement(model: str, out: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    a, b = out.reshape(len(out), -1).astype(np.float64), ref.reshape(len(ref), -1).astype(np.float64)
    if a.shape[1] == 1:  # a cross-encoder's one logit per pair
        return {"max_abs_diff": float(np.max(np.abs(a - b)))}
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    row = {"min_cosine": float(cos.min())}
    if model == "image_classifier":
        row["top1_agreement"] = float(np.mean(a.argmax(1) == b.argmax(1)))
    return row


def measure(models: Sequence[str], rounds: int, seconds: float, threads: int, say=print) -> list[dict[str, object]]:
    import onnx

    rows = []
    for model in models:
        folder = REPOSITORY / model / "1"
        files = {name: folder / f for name, f in FILES.items() if (folder / f).is_file()}
        if "fp32" not in files:
            say(f"{model}: not exported ({folder / FILES['fp32']} missing), skipped")
            continue
        inputs = {i.name for i in onnx.load(str(files["fp32"]), load_external_data=False).graph.input}
        batches = {k: {n: v for n, v in feed.items() if n in inputs} for k, feed in feeds(model).items()}
        runners = {}
        for name, path in files.items():
            for runtime in ("ort", "openvino"):
                started = time.perf_counter()
                runners[(runtime, name)] = runner(runtime, path, threads)
                say(f"{model}: {runtime} {name} ready in {time.perf_counter() - started:.1f} s")
        reference = {k: runners[("ort", "fp32")](feed) for k, feed in batches.items()}
        rates: dict[tuple, list[float]] = {}
        for _ in range(rounds):
            for (runtime, name), run in runners.items():
                for k, feed in batches.items():
                    run(feed)  # warm this shape
                    count, start = 0, time.perf_counter()
                    while count < 3 or time.perf_counter() - start < seconds:
                        run(feed)
                        count += 1
                    items = len(next(iter(feed.values())))
                    rates.setdefault((runtime, name, k), []).append(count * items / (time.perf_counter() - start))
        for (runtime, name, k), values in rates.items():
            close = agreement(model, runners[(runtime, name)](batches[k]), reference[k])
            figures = {"items_per_s": round(median(values) or 0.0, 1)} | {m: round(v, 5) for m, v in close.items()}
            rows.append({"model": model, "file": FILES[name], "runtime": runtime, "shape": k} | figures)
            say(f"  {rows[-1]}")
    return rows


def markdown(rows: Sequence[dict], threads: int) -> str:
    by = {(r["model"], r["shape"], r["file"], r["runtime"]): r for r in rows}
    lines = []
    for (model, shape, file, runtime), r in by.items():
        if runtime == "ort" and (ov := by.get((model, shape, file, "openvino"))) is not None:
            close = ", ".join(f"{k} {ov[k]}" for k in ("min_cosine", "top1_agreement", "max_abs_diff") if k in ov)
            ratio = report.fmt(ov["items_per_s"] / r["items_per_s"], 2)
            lines.append([model, shape, file, r["items_per_s"], ov["items_per_s"], ratio, close])
    from python_backends.generation.linear import describe_cpu

    columns = ["model", "shape", "file", "ONNX Runtime", "OpenVINO", "OpenVINO / ONNX Runtime", "OpenVINO vs FP32 ORT"]
    return f"{threads} threads; CPU: {describe_cpu()}; items/s, median over rounds\n\n{report.table(columns, lines, left=3)}\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = options.parser("perf.bench.openvino_encoders", __doc__)
    p.add_argument("--models", type=options.choices(MODELS), default=list(MODELS), help=f"a subset of {','.join(MODELS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0, help="per (runtime, file, shape) and round")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    rows = measure(args.models, args.rounds, args.seconds, args.threads)
    print("\n" + markdown(rows, args.threads))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
