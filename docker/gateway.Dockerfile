# The OpenAI-compatible gateway (openai_gateway/) for docker-compose's `gateway` service.
#
# Python 3.11 as in requirements.txt (the gateway is not a python backend model: it does not run
# in the Triton image's Python 3.10). Only what `python -m openai_gateway` imports, pinned as in
# requirements.txt and constraints.txt (tests/unit/test_compose.py checks they agree):
# FastAPI and uvicorn with uvloop and httptools, orjson, prometheus-client, tritonclient's gRPC
# and HTTP clients (the clients/ package imports both), numpy, tokenizers and jinja2 (/tokenize:
# the models' tokenizer files and the chat template).
# Built from the repository root (.dockerignore admits contract/, openai_gateway/, clients/,
# server/, ops/):
#   docker-compose build gateway
# The model repository (its configs and the tokenizer) is mounted, not copied.
# python:3.11-slim-bookworm; a machine without registry access passes a local stand-in
# (docker/local-bases.Dockerfile, scripts/compose.sh).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# docker/local/ca.crt, when there, is the CA bundle pip trusts (docker/local/README.md); the README is
# copied only so that the pattern always matches something.
WORKDIR /opt/embedding
COPY docker/local/README.md docker/local/ca.cr[t] build-local/
RUN if [ -f build-local/ca.crt ]; then export PIP_CERT="$PWD/build-local/ca.crt"; fi \
 && pip install --no-cache-dir "fastapi==0.165.0" "starlette==1.10.0" "pydantic==2.14.4" "uvicorn==0.54.0" \
      "uvloop==0.23.0" "httptools==0.9.0" "orjson==3.13.0" "prometheus-client==0.26.0" \
      "tritonclient[grpc,http]==2.50.0" "grpcio==1.85.3" "protobuf==4.25.9" "aiohttp==3.14.5" \
      "numpy==1.26.4" "tokenizers==0.23.3" "jinja2==3.1.6" "markupsafe==3.0.4" \
 && rm -rf build-local

COPY contract /opt/embedding/contract
COPY clients /opt/embedding/clients
COPY openai_gateway /opt/embedding/openai_gateway
# docker-compose's grpc-door and repository-door services run `python -m server.grpc_door` and
# `python -m server.repository_door` (which acts through ops/repository.py) from this image.
COPY server /opt/embedding/server
COPY ops /opt/embedding/ops
# The key file's folder exists in the image, owned by the gateway's user: a new named volume
# mounted there (docker-compose's gateway-keys) starts with that owner, so the key can be written.
RUN find /opt/embedding -name __pycache__ -type d -prune -exec rm -rf {} + \
 && useradd --system --uid 10001 --user-group --home-dir /var/lib/openai-gateway --create-home gateway \
 && install -d -o gateway -g gateway -m 700 /var/lib/openai-gateway/keys
ENV PYTHONPATH=/opt/embedding \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/embedding
USER 10001

EXPOSE 8080
ENTRYPOINT ["python", "-m", "openai_gateway"]
