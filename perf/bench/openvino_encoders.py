"""`python -m perf.bench.openvino_encoders`: the exported encoder files on ONNX Runtime and on OpenVINO, in process.

For each served encoder (``text_encoder``, ``image_classifier``; ``text_cross_encoder`` when it is
exported) and each of its files (``model.onnx`` FP32, ``model.int8.onnx`` the INT8 ONNX Runtime
serves on a CPU), the same batches run on:

- **ort**: ONNX Runtime's CPU provider, ``intra_op_num_threads`` = the CPUs, spinning off (the
  session the export's speed check and the served backend open: export.bench.open_cpu_session);
- **openvino**: OpenVINO's CPU plugin on the same ONNX file (``Core.compile_model``), the same
  threads, its default inference precision (BF16 on CPUs with AVX-512 BF16 or AMX, else FP32),
  ``PERFORMANCE_HINT`` LATENCY (one request at a time, as the served instance runs them).

Rounds interleave every (runtime, file) so a noisy neighbour costs them alike; the figure is the
median over rounds of items per second. Beside it: how close each output is to ONNX Runtime's on
the FP32 file (the gate's reference): minimum cosine for embeddings and logits, top-1 agreement
for the classifier.

    python -m perf.bench.openvino_encoders [--rounds 3] [--seconds 2] [--models text_encoder,image_classifier]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from export.bench import open_cpu_session
from perf.lib.paths import ROOT

REPOSITORY = ROOT / "model_repository"
FILES = {"fp32": "model.onnx", "int8": "model.int8.onnx"}
TEXT_SHAPES = ((16, 16), (64, 16), (64, 64))  # (batch, tokens)
IMAGE_BATCHES = (1, 8, 32)


def ort_runner(path: Path, threads: int) -> Callable[[dict], np.ndarray]:
    session = open_cpu_session(path, threads)
    return lambda feed: session.run(None, feed)[0]


def openvino_runner(path: Path, threads: int) -> Callable[[dict], np.ndarray]:
    import openvino as ov

    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    output = compiled.output(0)
    return lambda feed: request.infer(feed)[output]


def text_feeds(shapes=TEXT_SHAPES, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for batch, tokens in shapes:
        ids = rng.integers(1000, 29000, size=(batch, tokens), dtype=np.int64)
        ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
        feeds[f"{batch}x{tokens}"] = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    return feeds


def image_feeds(batches=IMAGE_BATCHES, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {f"{b} images": {"pixel_values": rng.standard_normal((b, 3, 224, 224), dtype=np.float32)} for b in batches}


def cross_feeds(shapes=((16, 64), (64, 64)), seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    feeds = text_feeds(shapes, seed)
    for feed in feeds.values():
        feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
    return feeds


MODELS: dict[str, Callable[[], dict[str, dict[str, np.ndarray]]]] = {
    "text_encoder": text_feeds,
    "image_classifier": image_feeds,
    "text_cross_encoder": cross_feeds,
}


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
    rows = []
    for model in models:
        folder = REPOSITORY / model / "1"
        files = {name: folder / f for name, f in FILES.items() if (folder / f).is_file()}
        if "fp32" not in files:
            say(f"{model}: not exported ({folder / FILES['fp32']} missing), skipped")
            continue
        feeds = {k: {n: v for n, v in feed.items() if n in _input_names(files["fp32"])} for k, feed in MODELS[model]().items()}
        runners = {}
        for name, path in files.items():
            for runtime, open_ in (("ort", ort_runner), ("openvino", openvino_runner)):
                started = time.perf_counter()
                runners[(runtime, name)] = open_(path, threads)
                say(f"{model}: {runtime} {name} ready in {time.perf_counter() - started:.1f} s")
        reference = {k: runners[("ort", "fp32")](feed) for k, feed in feeds.items()}
        rates: dict[tuple, list[float]] = {}
        for _ in range(rounds):
            for (runtime, name), run in runners.items():
                for k, feed in feeds.items():
                    run(feed)  # warm this shape
                    count, start = 0, time.perf_counter()
                    while count < 3 or time.perf_counter() - start < seconds:
                        run(feed)
                        count += 1
                    items = len(next(iter(feed.values())))
                    rates.setdefault((runtime, name, k), []).append(count * items / (time.perf_counter() - start))
        for (runtime, name, k), values in rates.items():
            row = {
                "model": model,
                "file": FILES[name],
                "runtime": runtime,
                "shape": k,
                "items_per_s": round(statistics.median(values), 1),
                **{m: round(v, 5) for m, v in agreement(model, runners[(runtime, name)](feeds[k]), reference[k]).items()},
            }
            rows.append(row)
            say(f"  {row}")
    return rows


def _input_names(path: Path) -> set[str]:
    import onnx

    return {i.name for i in onnx.load(str(path), load_external_data=False).graph.input}


def markdown(rows: Sequence[dict], threads: int) -> str:
    from python_backends.generation.linear import describe_cpu

    lines = [
        f"{threads} threads; CPU: {describe_cpu()}; items/s, median over rounds",
        "",
        "| model | shape | file | ONNX Runtime | OpenVINO | OpenVINO / ONNX Runtime | OpenVINO vs FP32 ORT |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    by_key = {(r["model"], r["shape"], r["file"], r["runtime"]): r for r in rows}
    for (model, shape, file, runtime), r in by_key.items():
        if runtime != "ort":
            continue
        ov = by_key.get((model, shape, file, "openvino"))
        if ov is None:
            continue
        close = ", ".join(f"{k} {ov[k]}" for k in ("min_cosine", "top1_agreement", "max_abs_diff") if k in ov)
        lines.append(
            f"| {model} | {shape} | {file} | {r['items_per_s']} | {ov['items_per_s']} | "
            f"{ov['items_per_s'] / r['items_per_s']:.2f} | {close} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m perf.bench.openvino_encoders", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="text_encoder,image_classifier,text_cross_encoder")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0, help="per (runtime, file, shape) and round")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    rows = measure(args.models.split(","), args.rounds, args.seconds, args.threads)
    print("\n" + markdown(rows, args.threads))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
