#!/usr/bin/env bash
# docker-compose's CPU profile on a machine without registry access (docs/deployment.md):
#   scripts/compose.sh images   # a Docker engine (installed and started if absent), the local base
#                               # images from Debian's packages, then the project's images
#   scripts/compose.sh up       # images, then the CPU stack (no Grafana: Debian does not package it)
#   scripts/compose.sh down     # the stack, its network and volumes removed
#   scripts/compose.sh env      # the variables that point docker-compose.yml at the local images
#   scripts/compose.sh test     # up on test ports, tests/compose/ from the host, down; then nothing may be left
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
if [ -z "$TRITON_REPOSITORY_TOKEN" ]; then  # the launcher's token file (make serve's), made as it makes it
  mkdir -p .triton
  (umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >.triton/repository-token)
  TRITON_REPOSITORY_TOKEN=$(cat .triton/repository-token)
fi
# Grafana is not started here, but the file requires its password: a random one, never a known string.
export GRAFANA_ADMIN_PASSWORD=${GRAFANA_ADMIN_PASSWORD:-$(python3 -c 'import secrets; print(secrets.token_urlsafe(16))')}
SERVICES=(triton-cpu-1 triton-cpu-2 frontdoor-cpu grpc-door repository-door gateway redis prometheus)

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
    root=$(mktemp -d -t debian-rootfs.XXXXXX)
    trap '$SUDO rm -rf "$root"' EXIT
    say "debootstrap bookworm -> $BASE"
    $SUDO debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >"$STATE/debootstrap.log" 2>&1 \
      || { tail -20 "$STATE/debootstrap.log" >&2; exit 1; }
    # debootstrap lists bookworm main only: the images built on it get the point and security updates too
    printf '%s\n' "deb http://deb.debian.org/debian bookworm main" "deb http://deb.debian.org/debian bookworm-updates main" \
      "deb http://deb.debian.org/debian-security bookworm-security main" | $SUDO tee "$root/etc/apt/sources.list" >/dev/null
    $SUDO tar -C "$root" -c . | docker import - "$BASE" >/dev/null
    $SUDO rm -rf "$root"
    trap - EXIT
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

wait_healthy() {
  local deadline=$((SECONDS + ${1:-600})) c status
  for svc in "${SERVICES[@]}"; do
    while :; do
      c=$(docker-compose --profile cpu ps -q "$svc" 2>/dev/null || true)
      status=$( [ -n "$c" ] && docker inspect -f '{{.State.Health.Status}}' "$c" 2>/dev/null || echo missing)
      [ "$status" = healthy ] && break
      if [ $SECONDS -ge $deadline ]; then say "$svc is $status"; [ -z "$c" ] || docker logs --tail 30 "$c" >&2 || true; return 1; fi
      sleep 2
    done
  done
}

# What `down -v` must leave: no container, network or volume of the project.
leftovers() {
  local label="label=com.docker.compose.project=$PROJECT"
  { docker ps -aq --filter "$label"; docker network ls -q --filter "$label"; docker volume ls -q --filter "$label"; } | wc -l
}

compose_test() {
  # A project, ports and an API key of its own: a `make compose-up` stack (its volumes, the gateway's
  # key) or a `make serve` on the default ports is left alone.
  PROJECT=$PROJECT-test
  export COMPOSE_PROJECT_NAME=$PROJECT
  export TRITON_HTTP_PORT=${TRITON_HTTP_PORT:-18000} TRITON_GRPC_PORT=${TRITON_GRPC_PORT:-18001}
  export TRITON_METRICS_PORT=${TRITON_METRICS_PORT:-18002} GATEWAY_PORT=${GATEWAY_PORT:-18080}
  export PROMETHEUS_PORT=${PROMETHEUS_PORT:-19090}
  export GATEWAY_API_KEYS=${GATEWAY_API_KEYS:-compose-test-$(python3 -c 'import secrets; print(secrets.token_hex(8))')}
  # The rollout check publishes a text_encoder version and writes a rollout state: into a copy of the
  # repository (hard links: every write to it replaces a file, never changes one in place) and a
  # state folder of the test's own, which the replicas mount in place of model_repository/ and .rollout/.
  local scratch=$STATE/test
  rm -rf "$scratch" && mkdir -p "$scratch/rollout"
  cp -al model_repository "$scratch/model_repository"
  export MODEL_REPOSITORY_DIR=./$scratch/model_repository ROLLOUT_STATE_DIR=./$scratch/rollout
  local t0=$SECONDS rc=0
  images
  local t_images=$((SECONDS - t0))
  make compose-config >/dev/null
  # whatever happens from here (a failed start, Ctrl-C), the stack goes
  trap 'docker-compose --profile cpu down -v --remove-orphans >/dev/null 2>&1 || true' EXIT
  docker-compose --profile cpu up -d "${SERVICES[@]}" || rc=1
  [ $rc != 0 ] || wait_healthy 600 || rc=1
  local t_up=$((SECONDS - t0 - t_images))
  say "images ${t_images} s, up and healthy ${t_up} s"
  if [ $rc = 0 ]; then
    COMPOSE_HTTP=127.0.0.1:$TRITON_HTTP_PORT COMPOSE_GRPC=127.0.0.1:$TRITON_GRPC_PORT \
      COMPOSE_GATEWAY=127.0.0.1:$GATEWAY_PORT COMPOSE_PROMETHEUS=127.0.0.1:$PROMETHEUS_PORT \
      COMPOSE_METRICS=127.0.0.1:$TRITON_METRICS_PORT COMPOSE_MODEL_REPOSITORY=$scratch/model_repository \
      COMPOSE_ROLLOUT_STATE=$scratch/rollout/state.json \
      "${VENV:-.venv}/bin/python" -m pytest tests/compose -v -s --durations=0 || rc=$?
  fi
  [ $rc = 0 ] || docker-compose --profile cpu logs --tail 40 >&2 || true
  local t_checks=$((SECONDS - t0 - t_images - t_up))
  docker-compose --profile cpu down -v --remove-orphans
  trap - EXIT
  rm -rf "$scratch"
  local left
  left=$(leftovers)
  say "checks ${t_checks} s; after down -v: $left containers, networks and volumes of $PROJECT left"
  [ "$left" = 0 ] || rc=1
  return $rc
}

case "${1:-}" in
  images) images ;;
  up)
    images
    make compose-config >/dev/null
    mkdir -p .rollout  # the replicas mount it (the rollout state); made by the user, not by dockerd as root
    docker-compose --profile cpu up -d "${SERVICES[@]}"
    ;;
  down)
    if docker info >/dev/null 2>&1; then docker-compose --profile cpu down -v --remove-orphans; fi
    ;;
  test) compose_test ;;
  env)
    for v in CPU_BASE_IMAGE PYTHON_BASE_IMAGE NGINX_IMAGE REDIS_IMAGE PROMETHEUS_IMAGE COMPOSE_PROJECT_NAME; do echo "export $v=${!v}"; done
    ;;
  *) sed -n '2,8p' "$0" >&2; exit 2 ;;
esac
