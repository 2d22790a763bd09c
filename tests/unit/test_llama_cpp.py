"""perf/baselines/llama_cpp.py: the build is cached per llama.cpp version and per CPU feature set, in the
git-ignored .cache/ (building it is `make perf-generate`'s, not a test's)."""

from __future__ import annotations

import subprocess

from perf.baselines import llama_cpp
from server.layout import ROOT


def test_the_cache_key_follows_the_cpu_features(monkeypatch):
    monkeypatch.setattr(llama_cpp, "cpu_features", lambda: ["avx", "avx2", "fma"])
    avx2 = llama_cpp.build_key()
    monkeypatch.setattr(llama_cpp, "cpu_features", lambda: ["avx", "avx2", "fma", "avx512f", "avx512_vnni"])
    avx512 = llama_cpp.build_key()
    assert avx2 != avx512 and avx2.startswith(llama_cpp.SDIST.split("==")[1] + "-")
    assert llama_cpp.binary_path().parent.name == avx512


def test_features_are_read_from_this_cpu():
    features = llama_cpp.cpu_features()
    assert set(features) <= set(llama_cpp.FEATURES)


def test_the_cache_is_git_ignored():
    for path in (llama_cpp.binary_path(), llama_cpp.model_path()):
        done = subprocess.run(["git", "check-ignore", "-q", str(path.relative_to(ROOT))], cwd=ROOT)
        assert done.returncode == 0, path
