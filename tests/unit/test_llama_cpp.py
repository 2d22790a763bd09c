"""perf/baselines/llama_cpp.py: the peers' GGUF is the published file requantized, cached in the
git-ignored .cache/ (making it is `make perf-generate`'s, not a test's)."""

from __future__ import annotations

import subprocess

import pytest

from perf.baselines import llama_cpp
from server.layout import ROOT


def test_the_peers_files_are_cached_git_ignored():
    for path in (llama_cpp.server_path(), llama_cpp.model_path("Q4_0"), llama_cpp.model_path("Q8_0")):
        done = subprocess.run(["git", "check-ignore", "-q", str(path.relative_to(ROOT))], cwd=ROOT)
        assert done.returncode == 0, path


def test_q4_1_is_the_published_file_and_other_types_are_made_from_it():
    assert llama_cpp.model_path("Q4_1") == llama_cpp.source_gguf()
    assert llama_cpp.source_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert llama_cpp.model_path("Q4_0").name == "SmolLM2-135M-Instruct.Q4_0.gguf"


def test_an_unknown_file_type_is_refused_before_any_work():
    with pytest.raises(llama_cpp.LlamaCppError, match="IQ2_XS"):
        llama_cpp.model("IQ2_XS")
