"""perf.bench.image_bench's summary: the points per system, batch and layout, and the markdown table."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from perf.bench.image_measure import Window
from perf.bench.image_pipelines import Pipeline
from perf.lib.stats import median

# --------------------------------------------------------------------------- summary


@dataclass
class Point:
    """The median over rounds of one system x ensemble x batch (max: the largest)."""

    system: str
    ensemble: str
    batch: int
    layout: str
    images_per_s: float | None
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    classifier_batch: float | None = None
    client_cores: float | None = None
    machine_cores: float | None = None
    errors: int = 0
    rounds: int = 0
    requests: int = 0  # requests (served) or calls (in-process) measured, all rounds


def points(windows: Sequence[Window]) -> list[Point]:
    """Per system, ensemble and batch; in-process: the faster layout (by median images/s)."""
    groups: dict[tuple, list[Window]] = {}
    for w in windows:
        groups.setdefault((w.system, w.ensemble, w.batch, w.layout), []).append(w)
    candidates: dict[tuple, list[Point]] = {}
    for (system, ensemble, batch, layout), ws in groups.items():
        maxes = [w.max_ms for w in ws if w.max_ms is not None]
        candidates.setdefault((system, ensemble, batch), []).append(
            Point(
                system,
                ensemble,
                batch,
                layout,
                median([w.images_per_s for w in ws]),
                median([w.p50_ms for w in ws]),
                median([w.p99_ms for w in ws]),
                max(maxes) if maxes else None,
                median([w.classifier_batch for w in ws]),
                median([w.client_cores for w in ws]),
                median([w.machine_cores for w in ws]),
                sum(w.errors for w in ws),
                len(ws),
                sum(w.requests for w in ws),
            )
        )
    return [max(c, key=lambda p: p.images_per_s or 0.0) for c in candidates.values()]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(header: Sequence[str], pipes: Sequence[Pipeline], results: Sequence[Point]) -> str:
    by = {(p.system, p.ensemble, p.batch): p for p in results}
    batches = sorted({p.batch for p in results})
    lines = list(header) + [
        "",
        "## Served vs in-process (same .onnx file, same photos, preprocessing included in both)",
        "",
        "| ensemble | variant | batch | system | layout | n | images/s | P50 ms | P99 ms | max ms "
        "| classifier batch | cores: this process | machine | served / in-process |",
        "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for pipe in pipes:
        for b in batches:
            served, mine = by.get(("served", pipe.ensemble, b)), by.get(("in-process", pipe.ensemble, b))
            for p in (served, mine, by.get(("model only", pipe.ensemble, b))):
                if p is None:
                    continue
                share = (
                    _f(ratio(served.images_per_s if served else None, mine.images_per_s if mine else None), 2)
                    if p is served
                    else ""
                )
                lines.append(
                    f"| {pipe.ensemble} | {pipe.variant} | {b} | {p.system} | {p.layout} | {p.requests} | "
                    f"{_f(p.images_per_s)} | {_f(p.p50_ms)} | {_f(p.p99_ms)} | {_f(p.max_ms)} | "
                    f"{_f(p.classifier_batch)} | {_f(p.client_cores, 2)} | {_f(p.machine_cores, 2)} | {share} |"
                )
    if len(pipes) > 1:
        first = pipes[0]
        lines += [
            "",
            f"## {first.ensemble} over each other ensemble (images/s ratio, same batch)",
            "",
            "| ensemble | batch | in-process | served |",
            "| --- | ---: | ---: | ---: |",
        ]
        for other in pipes[1:]:
            for b in batches:
                cells = [
                    _f(
                        ratio(
                            getattr(by.get((s, first.ensemble, b)), "images_per_s", None),
                            getattr(by.get((s, other.ensemble, b)), "images_per_s", None),
                        ),
                        2,
                    )
                    for s in ("in-process", "served")
                ]
                lines.append(f"| {first.ensemble} / {other.ensemble} | {b} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import onnxruntime

    from export import bench

    return (
        f"{model or platform.processor() or 'unknown CPU'}, {bench.cpu_threads()} cores usable, no GPU used "
        f"(CPUExecutionProvider), onnxruntime {onnxruntime.__version__}, Python {platform.python_version()}"
    )
