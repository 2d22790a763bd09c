"""Priority-class lanes rendered from their model (export/lanes.py)."""

import os
import shutil
from pathlib import Path

import pytest

from export.lanes import MARK, Lane, declared_lanes, render_all, render_config

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """# a comment
name: "enc"
backend: "onnxruntime"
max_batch_size: 64
instance_group [
  # two on two cores
  { count: 2 }
]
parameters { key: "lanes" value: { string_value: "interactive:1" } }
parameters { key: "process_nice" value: { string_value: "5" } }
parameters { key: "yield_to_class" value: { string_value: "interactive" } }
parameters { key: "yield_max_ms" value: { string_value: "20" } }
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""


def test_declared_lanes_are_parsed_and_bad_ones_refused():
    assert declared_lanes("enc", CONFIG) == [Lane("enc", "interactive", 1)]
    assert declared_lanes("enc", 'name: "enc"') == []
    for bad in ("interactive", "interactive:0", "Inter:1", "x:y"):
        with pytest.raises(ValueError, match="name:count"):
            declared_lanes("enc", CONFIG.replace("interactive:1", bad))


def test_a_lane_config_differs_only_in_name_instances_lanes_nice_and_yield():
    out = render_config(CONFIG, Lane("enc", "interactive", 1))
    assert out.startswith(MARK)
    assert 'name: "enc_interactive"' in out and 'name: "enc"\n' not in out
    assert "{ count: 1 }" in out and "count: 2" not in out
    assert '"lanes"' not in out and '"process_nice"' not in out
    assert "yield_" not in out  # the lane never waits for its own class
    assert 'key: "intra_op_thread_count"' in out and 'backend: "onnxruntime"' in out


def _model(repo: Path) -> Path:
    src = repo / "enc"
    (src / "1").mkdir(parents=True)
    (src / "configs").mkdir()
    (src / "warmup").mkdir()
    (src / "config.pbtxt").write_text(CONFIG)
    (src / "configs" / "int8.pbtxt").write_text("# for variant 'int8'\n" + CONFIG)
    (src / "1" / "model.onnx").write_bytes(b"onnx")
    (src / "1" / "model.int8.onnx").write_bytes(b"int8")
    return src


def test_render_links_files_follows_new_versions_and_variants(tmp_path):
    src = _model(tmp_path)
    (dst,) = render_all(tmp_path)
    assert dst.name == "enc_interactive"
    assert (dst / "1" / "model.int8.onnx").is_symlink() and (dst / "1" / "model.int8.onnx").read_bytes() == b"int8"
    assert not os.path.isabs(os.readlink(dst / "1" / "model.onnx")), "links are relative (the repository moves)"
    assert "for variant 'int8'" in (dst / "configs" / "int8.pbtxt").read_text()
    assert (dst / "warmup").resolve() == (src / "warmup").resolve()
    # a published version 2 and a removed variant reach the lane on the next render
    (src / "2").mkdir()
    (src / "2" / "model.onnx").write_bytes(b"v2")
    (src / "configs" / "int8.pbtxt").unlink()
    render_all(tmp_path)
    assert (dst / "2" / "model.onnx").read_bytes() == b"v2"
    assert not (dst / "configs" / "int8.pbtxt").exists()
    shutil.rmtree(src / "2")
    render_all(tmp_path)
    assert not (dst / "2").exists()


def test_render_never_overwrites_a_hand_written_model(tmp_path):
    _model(tmp_path)
    (tmp_path / "enc_interactive").mkdir()
    (tmp_path / "enc_interactive" / "config.pbtxt").write_text('name: "enc_interactive"\n')
    with pytest.raises(ValueError, match="not generated"):
        render_all(tmp_path)


def test_the_served_repository_renders_text_encoder_interactive(tmp_path):
    """The real text_encoder config, copied: the lane keeps its inputs, batching and warmup."""
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT / "model_repository" / "text_encoder", repo / "text_encoder", ignore=shutil.ignore_patterns("*.onnx", "*.json")
    )
    (lane,) = render_all(repo)
    text = (lane / "config.pbtxt").read_text()
    source = (repo / "text_encoder" / "config.pbtxt").read_text()
    assert 'name: "text_encoder_interactive"' in text
    for line in source.splitlines():
        if line.startswith(("input", "output", "  { name", "max_batch_size", "model_warmup", "dynamic_batching")):
            assert line in text


def test_a_pinned_lane_serves_only_that_version():
    out = render_config(CONFIG + "version_policy: { latest { num_versions: 1 } }\n", Lane("enc", "interactive", 1), 2)
    assert "version_policy: { specific { versions: [ 2 ] } }" in out and "latest" not in out
    assert "specific { versions: [ 3 ] }" in render_config(CONFIG, Lane("enc", "interactive", 1), 3)
