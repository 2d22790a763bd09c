"""In-process speed of ONNX variants, measured side by side in one run.

These machines are shared and noisy, so variants are measured in interleaved rounds (A B C,
A B C, ...) and each figure is the median over rounds; ratios between variants of one run
are what the reports compare, never figures across runs or machines.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FeedFn = Callable[[int], dict[str, np.ndarray]]


@dataclass
class Speed:
    latency_ms_b1: float  # median latency of one item (batch 1)
    throughput: dict[int, float] = field(default_factory=dict)  # items/s by batch size

    @property
    def best_batch(self) -> int:
        return max(self.throughput, key=lambda batch: self.throughput[batch])

    @property
    def best_throughput(self) -> float:
        return self.throughput[self.best_batch]

    def as_dict(self) -> dict:
        return {
            "latency_ms_b1": round(self.latency_ms_b1, 3),
            "throughput_items_per_s": {str(b): round(v, 1) for b, v in self.throughput.items()},
            "best_batch": self.best_batch,
            "best_throughput_items_per_s": round(self.best_throughput, 1),
        }


def cpu_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def open_cpu_session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def open_session(variant: str, path: Path, threads: int):
    """What serves ``variant`` on a CPU: OpenVINO for the openvino variant, else ONNX Runtime."""
    if variant == "openvino":
        from python_backends.onnx_engine.openvino_session import DEFAULT_PROPERTIES, OpenVINOSession

        return OpenVINOSession(path, {**DEFAULT_PROPERTIES, "INFERENCE_NUM_THREADS": str(threads)})
    return open_cpu_session(path, threads)


def _time_runs(session, feed: dict[str, np.ndarray], seconds: float, min_runs: int = 3) -> list[float]:
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_runs or time.perf_counter() < deadline:
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return times


def measure_side_by_side(
    models: dict[str, Path],
    feed: FeedFn,
    batches: tuple[int, ...],
    rounds: int = 3,
    seconds: float = 1.0,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Speed]:
    """Latency at batch 1 and throughput per batch size for each model, interleaved."""
    threads = threads or cpu_threads()
    sessions = {name: open_session(name, path, threads) for name, path in models.items()}
    feeds = {b: feed(b) for b in set(batches) | {1}}
    for session in sessions.values():  # warm-up: first runs allocate and pick kernels
        for b in feeds:
            session.run(None, feeds[b])
    latency: dict[str, list[float]] = {n: [] for n in sessions}
    rate: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in sessions}
    for r in range(rounds):
        if progress:
            progress(f"speed round {r + 1}/{rounds}: {', '.join(sessions)}")
        for name, session in sessions.items():
            latency[name].append(statistics.median(_time_runs(session, feeds[1], seconds)) * 1e3)
            for b in batches:
                runs = _time_runs(session, feeds[b], seconds)
                rate[name][b].append(b * len(runs) / sum(runs))
    return {
        name: Speed(statistics.median(latency[name]), {b: statistics.median(rate[name][b]) for b in batches}) for name in sessions
    }
