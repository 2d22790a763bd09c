"""A model re-exported under the same version must change the cache keys (python_backends/cache/identity.py).

The resolver used to fingerprint a version once per process: a new model file under the same
version, loaded by the encoder, kept the old keys, so the cache served the old model's vectors.
"""

from __future__ import annotations

import os
import shutil

import pytest

from python_backends.cache.identity import IdentityResolver, file_fingerprint


@pytest.fixture
def repo(tmp_path):
    enc = tmp_path / "text_encoder"
    (enc / "1").mkdir(parents=True)
    (enc / "configs").mkdir()
    (enc / "config.pbtxt").write_text('name: "text_encoder"\nbackend: "onnxruntime"\n')
    (enc / "1" / "model.onnx").write_bytes(b"weights of the first export")
    return tmp_path


def resolver(repo, ready=lambda name, version: True, config_name=""):
    return IdentityResolver(repo, "text_embedding", "text_encoder", config_name, ready)


def test_a_file_replaced_under_the_same_version_changes_the_identity(repo):
    r = resolver(repo)
    old = r.identity()
    assert r.identity() is old  # unchanged files: the same identity, nothing rehashed
    new_file = repo / "export" / "model.onnx"
    new_file.parent.mkdir()
    new_file.write_bytes(b"weights of the second export")
    os.replace(new_file, repo / "text_encoder" / "1" / "model.onnx")  # an atomic re-export
    new = r.identity()
    assert new.version == old.version == "1"
    assert new.fingerprint != old.fingerprint
    assert new.fingerprint == file_fingerprint(repo / "text_encoder" / "1" / "model.onnx")


def test_a_file_rewritten_in_place_with_the_same_size_changes_the_identity(repo):
    r = resolver(repo)
    path = repo / "text_encoder" / "1" / "model.onnx"
    old = r.identity()
    st = path.stat()
    path.write_bytes(b"weights of the other export")  # same length
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime (cp -p)
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert r.identity().fingerprint != old.fingerprint  # the ctime changed


def test_a_copy_over_keeping_inode_size_and_mtime_is_caught_by_the_ready_transition(repo, tmp_path_factory):
    ready = {"1"}
    r = resolver(repo, lambda name, version: version in ready)
    old = r.identity()
    path = repo / "text_encoder" / "1" / "model.onnx"
    other = tmp_path_factory.mktemp("x") / "model.onnx"
    other.write_bytes(b"weights of the other export")
    shutil.copystat(path, other)
    # What no stat shows: simulate it by poisoning the fingerprint cache for the new content.
    import python_backends.cache.identity as identity_module

    path.write_bytes(other.read_bytes())
    signature = identity_module.file_signature(path)
    identity_module._FINGERPRINTS[(str(path), *signature)] = old.fingerprint
    r._by_version["1"] = (path, r._signature(path), old)
    assert r.identity().fingerprint == old.fingerprint  # stat agrees with the stale entry
    ready.clear()  # unloaded ...
    assert r.identity() is None
    ready.add("1")  # ... and loaded again: hashed afresh
    assert r.identity().fingerprint != old.fingerprint


def test_a_changed_variant_config_changes_the_identity(repo):
    r = resolver(repo, config_name="int8")
    assert r.identity().variant == "fp32"  # no configs/int8.pbtxt: Triton loads config.pbtxt
    (repo / "text_encoder" / "configs" / "int8.pbtxt").write_text(
        '# GENERATED for variant \'int8\'\nname: "text_encoder"\ndefault_model_filename: "model.int8.onnx"\n'
    )
    (repo / "text_encoder" / "1" / "model.int8.onnx").write_bytes(b"int8 weights")
    now = r.identity()
    assert now.variant == "int8"
    assert now.fingerprint == file_fingerprint(repo / "text_encoder" / "1" / "model.int8.onnx")


def test_a_removed_file_gives_an_empty_fingerprint_then_the_new_one(repo):
    r = resolver(repo)
    path = repo / "text_encoder" / "1" / "model.onnx"
    first = r.identity()
    path.unlink()
    assert r.identity().fingerprint == ""
    path.write_bytes(b"weights of the second export")
    assert r.identity().fingerprint not in ("", first.fingerprint)
