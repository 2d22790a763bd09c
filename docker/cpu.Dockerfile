# The CPU replica image: tritonserver 2.51 from NVIDIA's nvidia-pytriton wheel (as `make serve` runs
# it), CPU PyTorch, ONNX Runtime and OpenVINO, and this repository's code, on Debian 12's Python 3.11.
# (libpython3.11: the python backend stub links it.) No NVIDIA container underneath: docker-compose's CPU profile runs it, one replica per container.
#
# Its entry point is the project's launcher in the replica role (`python -m server --role replica`):
# tritonserver on the container's ports 8000 (HTTP), 8001 (gRPC) and 8002 (metrics), the stub
# watchdog beside it, and the probe port 8003 (/v2/health/ready, /v2/health/live: server/health_port.py),
# which the healthcheck below and Kubernetes' probes read. No doors: the compose front door is in front.
#
# Built from the repository root (.dockerignore admits the packages copied below):
#   docker build -f docker/cpu.Dockerfile -t triton-cpu .
#   docker build -f docker/cpu.Dockerfile --build-arg BASE_IMAGE=local/debian:bookworm .   # no registry
# The models are not in the image: they are exported on the host (`make export`) and mounted at
# /opt/project/model_repository (read-only is enough: the export rendered the priority lanes).
ARG BASE_IMAGE=debian:bookworm-slim

# Debian's Python 3.11 (and libpython3.11, which the python backend stub links); packages unpinned: a
# stable release's point updates replace them on the mirror.
FROM ${BASE_IMAGE} AS python
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv libpython3.11 ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# The virtualenv, built in a stage of its own: what docker/local/ hands in (the torch wheel, the CA
# bundle) stays in this stage's layers and never reaches the image.
FROM python AS venv
# CPU wheels of PyTorch (2.13.0+cpu: a few hundred MB; PyPI's default build carries CUDA's libraries).
# What docker/local/ holds is used first (docker/local/README.md): a torch wheel is installed instead of
# asking this index, and ca.crt is the CA bundle pip trusts.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# What the replica imports, at the versions constraints.txt pins for the whole project (torch first,
# so that the second install finds it satisfied and does not fetch PyPI's CUDA build).
WORKDIR /build
COPY constraints.txt constraints.txt
COPY docker/local/ local/
RUN python3 -m venv /opt/venv \
 && if [ -f local/ca.crt ]; then export PIP_CERT="$PWD/local/ca.crt"; fi \
 && if ls local/torch-*.whl >/dev/null 2>&1; then \
      /opt/venv/bin/pip install --no-cache-dir -c constraints.txt local/torch-*.whl; \
    else \
      /opt/venv/bin/pip install --no-cache-dir -c constraints.txt --index-url "${TORCH_INDEX_URL}" torch; \
    fi \
 && /opt/venv/bin/pip install --no-cache-dir -c constraints.txt \
      nvidia-pytriton "tritonclient[grpc,http]" numpy onnx onnxruntime tokenizers transformers safetensors \
      llguidance gguf openvino openvino-genai openvino-tokenizers pillow redis async-timeout pyyaml

FROM python
COPY --from=venv /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY contract /opt/project/contract
COPY python_backends /opt/project/python_backends
COPY server /opt/project/server
COPY export /opt/project/export
COPY ops /opt/project/ops
COPY openai_gateway /opt/project/openai_gateway
COPY clients /opt/project/clients
# tritonserver is laid out (copied from the wheel, with its python backend stub) into /var/lib/triton
# at each start, as the launcher does locally; the repository token and the rollout state live there too
# unless mounted elsewhere.
RUN find /opt/project -name __pycache__ -type d -prune -exec rm -rf {} + \
 && useradd --system --uid 10002 --user-group --home-dir /var/lib/triton --create-home triton
# (TRITON_REPOSITORY_TOKEN_FILE is where the token is read, not the token)
# hadolint ignore=DL3064
ENV PYTHONPATH=/opt/project \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TRITON_ROLE=replica \
    TRITON_HOST=0.0.0.0 \
    TRITON_PROBE_PORT=8003 \
    TRITON_REPOSITORY_TOKEN_FILE=/var/lib/triton/repository-token \
    ROLLOUT_STATE_FILE=/var/lib/triton/rollout/state.json
WORKDIR /opt/project
USER 10002

EXPOSE 8000 8001 8002 8003
HEALTHCHECK --interval=5s --timeout=3s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8003/v2/health/ready', timeout=2)"]
ENTRYPOINT ["python", "-m", "server", "--workdir", "/var/lib/triton/work"]
