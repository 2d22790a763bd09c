"""perf.lib.served: what the served config says (parsed as Triton parses it); perf.baselines.limit: its thread layouts (the in-process
measurement: tests/perf/test_limit_smoke.py)."""

from __future__ import annotations

import dataclasses

from perf.baselines import limit
from perf.lib.served import ServedEncoder, served_config

CONFIG = """
instance_group [
  # count: 9 in a comment does not count
  { count: 2 kind: KIND_CPU }
]
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""


def test_instance_count_and_threads_come_from_the_served_config(tmp_path):
    for model, text in (("m", CONFIG), ("bare", 'name: "bare"')):
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.pbtxt").write_text(text)
    config = served_config(tmp_path, "m")
    assert config.instance_count() == 2 and config.param("intra_op_thread_count") == "1"
    assert served_config(tmp_path, "bare").instance_count() == 1


def test_layouts_are_the_served_one_and_one_session_over_all_cores(tmp_path):
    served = ServedEncoder("cpu", "cpu", "int8", tmp_path / "m.onnx", threads=1, instances=2)
    assert limit.layouts(served, cores=2) == [(2, 1), (1, 2)]
    assert limit.layouts(dataclasses.replace(served, threads=2, instances=1), cores=2) == [(1, 2)]
