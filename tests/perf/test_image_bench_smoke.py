"""A short run of perf.bench.image_bench: every image ensemble served and in-process, sane figures.

It starts its own tritonserver, checks that the served and in-process pipelines give the same
top-5 on every photo (the run stops otherwise), measures batch 1 and 4 for a second or two
each, and checks the table's structure, that every window served images without an error, and
that the served classifier executed at least the request's batch; never the figures' size,
which depends on the machine.
"""

from __future__ import annotations

import json
import math

import pytest

from perf.bench import image_bench
from perf.bench.image_pipelines import DEFAULT_ENSEMBLES
from perf.lib.paths import REPOSITORY

pytestmark = pytest.mark.perf


def test_short_image_bench_run_measures_both_systems(tmp_path):
    out = tmp_path / "bench"
    code = image_bench.main(
        [
            "--batches",
            "1,4",
            "--concurrency",
            "2,2",
            "--rounds",
            "1",
            "--duration",
            "1.5",
            "--warmup",
            "0.5",
            "--inprocess-seconds",
            "0.5",
            "--out",
            str(out),
        ]
    )
    table = (out / "summary.md").read_text() if (out / "summary.md").is_file() else "(no table)"
    assert code == 0, table
    rows = json.loads((out / "results.json").read_text())["windows"]
    ensembles = [e for e in DEFAULT_ENSEMBLES if (REPOSITORY / e / "config.pbtxt").is_file()]
    assert ensembles and ensembles[0] == "image_classification", ensembles
    seen = {(r["system"], r["ensemble"], int(r["batch"]), r["layout"]) for r in rows}
    for e in ensembles:
        for b in (1, 4):
            assert ("served", e, b, "c2") in seen and ("model only", e, b, "1t") in seen, (e, b, sorted(seen))
            assert ("in-process", e, b, "1t") in seen and ("in-process", e, b, "2t") in seen, (e, b, sorted(seen))
    for r in rows:
        assert int(r["errors"]) == 0 and int(r["images"]) > 0, r
        assert int(r["images"]) == int(r["requests"]) * int(r["batch"]), r
        p50, p99, top = float(r["p50_ms"]), float(r["p99_ms"]), float(r["max_ms"])
        assert 0 < p50 <= p99 <= top < 120_000, r
        assert math.isfinite(float(r["images_per_s"])) and float(r["images_per_s"]) > 0, r
        if r["system"] == "served":
            # A request is never split: the classifier ran at least the request's images per execution.
            assert float(r["classifier_batch"]) >= int(r["batch"]) - 1e-6, r
    # One ratio per ensemble and batch, a number; and the architecture table when there are two ensembles.
    ratios = [line.rsplit("|", 2)[1].strip() for line in table.splitlines() if "| served | c" in line]
    assert len(ratios) == 2 * len(ensembles) and all(float(x) > 0 for x in ratios), table
    assert "served and in-process top-5 classes agree on every photo" in table
    assert ("over each other ensemble" in table) == (len(ensembles) > 1), table
    assert (out / "tritonserver.log").is_file()
