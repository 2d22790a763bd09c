# Stand-ins for the public images docker-compose.yml names, built from Debian 12's own packages for
# machines that reach Debian's and PyPI's mirrors but no image registry. `make compose-images` builds
# each target on a Debian base made by debootstrap (scripts/compose.sh) and tags it with a local name;
# docker-compose.yml takes those names through its *_IMAGE variables. Users with registry access never
# build these: the defaults are the public images.
#   docker build -f docker/local-bases.Dockerfile --target nginx --build-arg BASE_IMAGE=local/debian:bookworm .
# Debian's packages are not pinned to versions: a stable release's point updates replace them on the
# mirror (security fixes), and a pinned version would stop building; the release pins the major versions.
ARG BASE_IMAGE=debian:bookworm-slim

# python:3.11-slim-bookworm's role (the gateway and the gRPC door): Python 3.11 with pip, `python` on PATH.
FROM ${BASE_IMAGE} AS python
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# nginx:1.27's role (the front door): Debian's nginx 1.22 with njs, the module where the official image
# keeps it (the rendered nginx.conf loads /etc/nginx/modules/ngx_http_js_module.so), curl for the healthcheck.
FROM ${BASE_IMAGE} AS nginx
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx libnginx-mod-http-js curl \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sfn /usr/lib/nginx/modules /etc/nginx/modules \
 && mkdir -p /var/cache/nginx

# redis:7.0-alpine's role (the result cache's L2): Debian's redis-server 7.0, redis-cli for the healthcheck.
FROM ${BASE_IMAGE} AS redis
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
# the package's system user (its uid is given out at install)
# hadolint ignore=DL3066
USER redis
CMD ["redis-server"]

# prom/prometheus:v2.42.0's role: Debian's prometheus 2.42, its entry point and data folder as the
# official image has them (the compose service passes flags only), wget for the healthcheck.
FROM ${BASE_IMAGE} AS prometheus
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o nobody -g nogroup /prometheus
USER 65534
ENTRYPOINT ["/usr/bin/prometheus"]
