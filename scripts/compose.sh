#!/usr/bin/env bash
# docker-compose's CPU profile on a machine without registry access (docs/deployment.md):
#   scripts/compose.sh images   # a Docker engine (installed and started if absent), the local base
#                               # images from Debian's packages, then the project's images
#   scripts/compose.sh up       # images, then the CPU stack (no Grafana: Debian does not package it)
#   scripts/compose.sh down     # the stack, its network and volumes removed
#   scripts/compose.sh env      # the variables that point docker-compose.yml at the local images
# A machine with registry access runs docker-compose.yml as it is (its defaults are the public images).
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${COMPOSE_PROJECT_NAME:-triton-serving}
BASE=local/debian:bookworm
STATE=.cache/compose
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
mkdir -p "$STATE"
say() { echo "compose: $*" >&2; }

# The local stand-ins for the public images docker-compose.yml names (docker/local-bases.Dockerfile).
export CPU_BASE_IMAGE=$BASE
export PYTHON_BASE_IMAGE=local/python:bookworm
export NGINX_IMAGE=local/nginx:bookworm
export REDIS_IMAGE=local/redis:bookworm
export PROMETHEUS_IMAGE=local/prometheus:bookworm
export COMPOSE_PROJECT_NAME=$PROJECT
export TRITON_REPOSITORY_TOKEN=${TRITON_REPOSITORY_TOKEN:-$(cat .triton/repository-token 2>/dev/null || true)}
if [ -z "$TRITON_REPOSITORY_TOKEN" ]; then
  mkdir -p .triton && umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > .triton/repository-token
  TRITON_REPOSITORY_TOKEN=$(cat .triton/repository-token)
fi
export GRAFANA_ADMIN_PASSWORD=${GRAFANA_ADMIN_PASSWORD:-unused-grafana-is-not-started}
SERVICES=(triton-cpu-1 triton-cpu-2 frontdoor-cpu grpc-door gateway redis prometheus)

engine() {
  if docker info >/dev/null 2>&1; then return; fi
  if ! command -v dockerd >/dev/null; then
    say "installing Debian's docker.io"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends docker.io >/dev/null
  fi
  say "starting dockerd (log: $STATE/dockerd.log)"
  $SUDO sh -c "nohup dockerd >'$STATE/dockerd.log' 2>&1 &"
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
  say "dockerd did not start:"; tail -20 "$STATE/dockerd.log" >&2; exit 1
}

base_images() {
  if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || {
      $SUDO apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    }
    root=$(mktemp -d "${TMPDIR:-/tmp}/debian-rootfs.XXXXXX")
    say "debootstrap bookworm -> $BASE"
    $SUDO debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >"$STATE/debootstrap.log" 2>&1 \
      || { tail -20 "$STATE/debootstrap.log" >&2; exit 1; }
    $SUDO tar -C "$root" -c . | docker import - "$BASE" >/dev/null
    $SUDO rm -rf "$root"
  fi
  for target in python nginx redis prometheus; do
    say "building local/$target:bookworm"
    # no build context: these images copy nothing in
    docker build -q --target "$target" --build-arg BASE_IMAGE="$BASE" -t "local/$target:bookworm" - \
      <docker/local-bases.Dockerfile >/dev/null
  done
}

# The host's CPU PyTorch wheel and the CA bundle its pip trusts, for the builds (docker/local/README.md).
build_inputs() {
  local venv=${VENV:-.venv}
  rm -f docker/local/*.whl docker/local/ca.crt
  "$venv/bin/python" -m pip download -q --no-deps "torch==$(grep -oP '^torch==\K.*' constraints.txt)" -d docker/local
  ls docker/local/torch-*+cpu-*.whl >/dev/null 2>&1 || { say "no CPU torch wheel here: the build asks PyTorch's index"; rm -f docker/local/torch-*.whl; }
  local cert
  cert=$("$venv/bin/python" -m pip config get global.cert 2>/dev/null || true)
  cert=${PIP_CERT:-$cert}
  [ -n "$cert" ] && [ -f "$cert" ] && cp "$cert" docker/local/ca.crt || true
}

images() {
  engine
  base_images
  build_inputs
  say "building the project's images"
  docker-compose --profile cpu build "${SERVICES[@]}"
}

case "${1:-}" in
  images) images ;;
  up)
    images
    make compose-config >/dev/null
    docker-compose --profile cpu up -d "${SERVICES[@]}"
    ;;
  down)
    if docker info >/dev/null 2>&1; then docker-compose --profile cpu down -v --remove-orphans; fi
    ;;
  env)
    for v in CPU_BASE_IMAGE PYTHON_BASE_IMAGE NGINX_IMAGE REDIS_IMAGE PROMETHEUS_IMAGE COMPOSE_PROJECT_NAME; do echo "export $v=${!v}"; done
    ;;
  *) sed -n '2,8p' "$0" >&2; exit 2 ;;
esac
