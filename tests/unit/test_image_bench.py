"""perf.bench.image_bench's parts that need no server: the ensembles' steps, the summary, the request body."""

from __future__ import annotations

import json
import struct

from perf.bench import image_bench, image_pipelines
from perf.bench.image_bench import Window
from perf.lib.load import Tally
from perf.lib.paths import REPOSITORY
from perf.lib.workload import image_request


def test_ensemble_steps_read_from_the_ensemble_config():
    pre, cnn, post = image_pipelines.ensemble_steps(REPOSITORY, "image_classification")
    assert (pre, cnn, post) == ("image_preprocess", "image_classifier", "image_postprocess")


def test_points_take_the_faster_in_process_layout_and_the_largest_max():
    windows = []
    for rnd, (slow, fast) in enumerate(((10.0, 12.0), (11.0, 13.0)), 1):
        for layout, rate, top in (("1t", slow, 50.0 * rnd), ("2t", fast, 40.0 * rnd)):
            w = Window("in-process", "e", 1, rnd, layout, images_per_s=rate, p50_ms=1.0, p99_ms=2.0, max_ms=top)
            windows.append(w)
    (point,) = image_bench.points(windows)
    assert point.layout == "2t" and point.images_per_s == 12.5 and point.max_ms == 80.0 and point.round == 2


def test_window_percentiles_are_nearest_rank():
    w = Window("served", "e", 2, 1)
    w.take(Tally(ok=[i / 1000 for i in range(1, 101)], seconds=2.0))
    assert (w.p50_ms, w.p99_ms, w.max_ms, w.images_per_s, w.images) == (50.0, 99.0, 100.0, 100.0, 200)


def test_image_body_carries_each_image_in_the_binary_extension():
    body, headers = image_request(b"ab", b"cde")
    n = int(headers["Inference-Header-Content-Length"])
    header = json.loads(body[:n])
    assert header["inputs"][0]["shape"] == [2, 1] and header["inputs"][0]["datatype"] == "BYTES"
    raw = body[n:]
    assert header["inputs"][0]["parameters"]["binary_data_size"] == len(raw)
    assert raw == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 3) + b"cde"


def test_batches_cycle_through_the_photos():
    assert image_pipelines.batch_of([b"a", b"b", b"c"], 2, 1) == [b"c", b"a"]
