# Two commands do all set-up on a fresh machine:
#   make serve   - venv + Debian packages, export the models, start tritonserver and the OpenAI gateway (Ctrl-C stops)
#   make test    - the same set-up, then unit and integration tests (and the fuzz smoke) against a real tritonserver
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# GPU=1 adds onnxruntime-gpu; by default it is chosen when nvidia-smi lists a GPU. The stamp
# names the mode, so switching mode reruns the set-up.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
STAMP := $(VENV)/.installed-gpu$(GPU)
PYTEST_ARGS ?=
SERVE_ARGS ?=
# Which exported variant to serve: auto (best that passed its gate on this hardware), cpu, gpu, or
# one variant by name (`python -m server --help` lists them; export/variants.py, export/generation_gate.py).
PRECISION ?= auto

.PHONY: venv export export-report serve compare tail autotune locust test lint format test-perf test-unit test-integration perf-baseline perf perf-quick perf-generate perf-speculative perf-gateway structured-bench cache-bench rollout-publish rollout-start rollout-status rollout-rollback rollout-finish compose-config compose-images compose-up compose-down compose-test fuzz soak cpu-cost image-bench priority-bench serve-cluster failover-bench chaos clean

$(STAMP): requirements.txt requirements-perf.txt requirements-dev.txt requirements-gpu.txt constraints.txt pyproject.toml scripts/setup.sh
	VENV=$(VENV) GPU=$(GPU) scripts/setup.sh
	rm -f $(VENV)/.installed-gpu*
	touch $@

venv: $(STAMP)

# Every model in every precision this machine can build, gated, with reports and speed.
export: $(STAMP)
	$(PY) -m export

export-report: $(STAMP)
	$(PY) -m export --update-docs

serve: $(STAMP)
	$(PY) -m server --precision $(PRECISION) $(SERVE_ARGS)

# REPLICAS tritonserver replicas behind one nginx front door (8000/8001/8002), the gateway (8080),
# a shared Redis L2 and Prometheus; a dead replica is restarted (docs/cluster.md). Ctrl-C stops all.
REPLICAS ?= 2
CLUSTER_ARGS ?=
serve-cluster: $(STAMP)
	$(PY) -m server.cluster --replicas $(REPLICAS) --precision $(PRECISION) $(CLUSTER_ARGS)

# The product's tests, with the hostile-request fuzz's short run; test-perf: the benchmarks' and the
# chaos soak's short runs and the serve-cluster drills (each starts replicas, gateways and Redis of its
# own: tests/integration/test_cluster_*.py), so that make test stays under 25 minutes on 2 cores.
# CI runs both.
RESILIENCE_SMOKE := tests/perf/test_fuzz_smoke.py
CLUSTER_DRILLS := $(sort $(wildcard tests/integration/test_cluster_*.py))
test: $(STAMP) lint
	$(PY) -m export --no-speed
	STRICT_SKIPS=1 $(PY) -m pytest tests/unit tests/integration $(RESILIENCE_SMOKE) $(foreach f,$(CLUSTER_DRILLS),--ignore=$(f)) -rs --durations=10 $(PYTEST_ARGS)

# ruff's lint rules and formatter over the whole tree, then mypy over every package and scripts/ (pyproject.toml's [tool.mypy] files); `make format` applies the first two.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test-perf: $(STAMP)
	$(PY) -m export --no-speed
	STRICT_SKIPS=1 $(PY) -m pytest tests/perf $(CLUSTER_DRILLS) $(foreach f,$(RESILIENCE_SMOKE),--ignore=$(f)) -rs $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# Throughput and P99 of the ensemble at concurrency 1 and 16 (starts its own server).
perf-baseline: $(STAMP)
	$(PY) -m perf.bench.baseline

# Concurrency and Poisson request-rate sweeps of each served model over gRPC and HTTP: CSV,
# PNG plots and summary.md under perf/results/sweep-<UTC time>/ (perf/README.md). About 15 min.
perf: $(STAMP)
	$(PY) -m perf.bench.sweep

# CI smoke of the same: text_embedding (both input sets), gRPC, concurrency 1 and 8, one rate (under a minute).
perf-quick: $(STAMP)
	$(PY) -m perf.bench.sweep --quick

# Text generation side by side: in-process engine, Triton gRPC/HTTP, the OpenAI gateway's chat stream,
# llama.cpp's llama-server on the same model (built once into .cache/llama.cpp/, 6-10 min on 2 cores:
# perf/baselines/llama_cpp.py), long-prompt prefill, prefix caching (docs/performance.md). PRECISION picks
# the weights precision served (default auto).
perf-generate: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.bench.generate_bench --precision $(PRECISION)

# Prompt-lookup speculative decoding on and off, side by side in-process: quoting and chat answers at
# 1 and 2 streams, tokens/s, time per token, acceptance, same tokens (docs/generation-internals.md#speculative-decoding). About 5 min.
perf-speculative: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.bench.speculative_bench --precision $(PRECISION)

# The OpenAI gateway against Triton direct, side by side: /v1/embeddings vs Triton's HTTP infer and
# infinity-emb at 32 clients, unique and repeated texts (docs/performance.md; its chat streams: perf-generate).
# About 5 min; GATEWAY_BENCH_ARGS e.g. "--rounds 1".
GATEWAY_BENCH_ARGS ?=
perf-gateway: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.bench.gateway_bench $(GATEWAY_BENCH_ARGS)

# Side by side in one run: in-process ONNX Runtime limit, naive per-request PyTorch server,
# Triton (gRPC/HTTP), Triton without dynamic batching; prints the ratios (perf/README.md).
compare: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.bench.compare

# The latency tail (requests/s, P50, P99, max) of every model and ensemble at 4 and 32
# connections, with and without the batcher settings that stall tritonserver 2.51, side by
# side (docs/performance.md). About 6 minutes; TAIL_ARGS e.g. "--duration 4 --concurrency 32".
TAIL_ARGS ?=
tail: $(STAMP)
	$(PY) -m perf.bench.tail $(TAIL_ARGS)

# Search the encoder's max_queue_delay x preferred_batch_size x instance count under a P99
# budget (reloads through the repository API, one server); AUTOTUNE_ARGS, e.g. --apply 127.0.0.1:8000.
AUTOTUNE_ARGS ?=
autotune: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.bench.autotune $(AUTOTUNE_ARGS)

# The result cache on a Zipf workload over 10,000 sentences: without cache, with cache (cold),
# a new replica (warm L2) and hits only, side by side; starts its own servers and redis-server
# (perf/README.md). CACHE_BENCH_ARGS="--requests 5000" for a shorter run.
CACHE_BENCH_ARGS ?=
# Structured outputs through the whole stack: validity with and without the engine's guide, and
# tokens/s at 16 streams with and without a JSON schema (docs/generation-internals.md#structured-outputs).
structured-bench: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.bench.structured_bench

cache-bench: $(STAMP)
	$(PY) -m perf.bench.cache_bench $(CACHE_BENCH_ARGS)

# Canary rollout of a text_encoder version on a running server (make serve; docs/versions-and-rollout.md):
# publish copies the export into the next version folder; start VERSION=N steps 10 -> 50 -> 100 % with automatic rollback; ROLLOUT_ARGS e.g.
# "--dwell 120 --max-error-rate 0.005" (start) or "--force" (finish); ROLLOUT_OPTS for all
# commands, e.g. "--url 127.0.0.1:9000 --state-file other.json".
VERSION ?=
ROLLOUT_ARGS ?=
ROLLOUT_OPTS ?=
rollout-publish: $(STAMP)
	$(PY) -m ops.rollout publish $(ROLLOUT_ARGS)
rollout-start: $(STAMP)
	@test -n "$(VERSION)" || { echo "usage: make rollout-start VERSION=<n> [ROLLOUT_ARGS=...]"; exit 2; }
	$(PY) -m ops.rollout $(ROLLOUT_OPTS) start $(VERSION) $(ROLLOUT_ARGS)
rollout-status: $(STAMP)
	$(PY) -m ops.rollout $(ROLLOUT_OPTS) status
rollout-rollback: $(STAMP)
	$(PY) -m ops.rollout $(ROLLOUT_OPTS) rollback
rollout-finish: $(STAMP)
	$(PY) -m ops.rollout $(ROLLOUT_OPTS) finish $(ROLLOUT_ARGS)

# docker-compose's front door: nginx.conf and the njs check with every model's limits, rendered
# from deploy/frontdoor/ and model_repository/ into .frontdoor/ (mounted read-only), and Grafana's
# dashboard from deploy/grafana/dashboard.py into .grafana/dashboards/. Run it after `make export`
# and before `docker-compose up`.
compose-config: $(STAMP)
	$(PY) -m server.frontdoor render --out .frontdoor --upstream triton-upstream-1 --upstream triton-upstream-2 --listen 0.0.0.0 --repository-door repository-door:8004 --stream-door grpc-door:8005 --stream-upstream-listen 0.0.0.0:8006
	$(PY) -m deploy.grafana.dashboard render .grafana/dashboards

# docker-compose's CPU profile on this machine (docs/deployment.md): a Docker engine (installed and
# started if absent), local base images from Debian's packages, the project's images, then the stack
# (both replicas, front door, gRPC door, gateway, Redis, Prometheus). With registry access,
# `docker-compose --profile cpu up` runs the same file on the public images.
compose-images: $(STAMP)
	VENV=$(VENV) scripts/compose.sh images

compose-up: $(STAMP)
	$(PY) -m export --no-speed
	VENV=$(VENV) scripts/compose.sh up

compose-down:
	scripts/compose.sh down

# The CPU stack started on test ports and checked from the host (tests/compose/), then taken down:
# nothing of it may be left (scripts/compose.sh test).
compose-test: $(STAMP)
	$(PY) -m export --no-speed
	VENV=$(VENV) scripts/compose.sh test

# Locust, headless, against a running server (make serve): LOCUST_ARGS to change users/time.
LOCUST_ARGS ?= -u 32 -r 8 -t 60s
locust: $(STAMP)
	$(VENV)/bin/locust -f perf/bench/locustfile.py --headless $(LOCUST_ARGS) --host http://127.0.0.1:8000 TritonHttpUser
	$(VENV)/bin/locust -f perf/bench/locustfile.py --headless $(LOCUST_ARGS) --host grpc://127.0.0.1:8001 TritonGrpcUser

# Property-based (hypothesis) and coverage-guided (atheris) fuzzing of every served model's HTTP
# and gRPC endpoints and of the Python steps' decoding functions; counts per outcome (docs/fuzzing.md).
# FUZZ_ARGS e.g. "--cases 2000".
FUZZ_ARGS ?=
fuzz: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m tests.fuzz $(FUZZ_ARGS)

# 10-minute soak at about 70 % of peak (embeddings, cached embeddings, images, generation with
# cancellations): RSS of every process and P99 per minute, a PNG plot (docs/soak.md). SOAK_ARGS e.g. "--duration 60".
SOAK_ARGS ?=
soak: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.drills.soak $(SOAK_ARGS)

# CPU-seconds per 1,000 requests of every process on each request path (front door, each stub,
# the gateway, the load generator) (docs/performance.md). CPU_COST_ARGS e.g. "--requests 2000".
CPU_COST_ARGS ?=
cpu-cost: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.bench.cpu_cost $(CPU_COST_ARGS)

# Image classification: each served ensemble (EfficientNet-Lite0 default, ResNet-50) against ONNX Runtime
# in-process on the same .onnx file, photos and batch sizes, preprocessing included in both; images/s,
# P50/P99/max and the ratios (docs/performance.md). About 5 min; IMAGE_BENCH_ARGS e.g. "--rounds 1 --batches 1".
IMAGE_BENCH_ARGS ?=
image-bench: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.bench.image_bench $(IMAGE_BENCH_ARGS)

# Priority classes under overload: interactive alone, then with default and bulk traffic at 5x
# their peak rate; P50/P99 and rejection rate per class (docs/priority-classes.md). PRIORITY_BENCH_ARGS e.g. "--duration 10".
PRIORITY_BENCH_ARGS ?=
priority-bench: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.bench.priority_bench $(PRIORITY_BENCH_ARGS)

# serve-cluster with 2 replicas under load (16 clients), one SIGKILLed at 10 s: per-second
# requests/s, P50/P99/max, failures and a PNG (docs/cluster.md). FAILOVER_ARGS e.g. "--duration 60".
FAILOVER_ARGS ?=
failover-bench: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.drills.chaos --scenario failover $(FAILOVER_ARGS)

# Chaos soak: serve-cluster (2 replicas, every model family, the gateways, Redis) at 70 % of peak
# while a stub, a replica, a gateway and Redis are SIGKILLed and a burst of hostile requests
# arrives; failures per client, recovery per fault, RSS before/after, a PNG timeline
# (docs/chaos.md). About 8 minutes; CHAOS_ARGS e.g. "--duration 90".
CHAOS_ARGS ?=
chaos: $(STAMP)
	$(PY) -m export --no-speed
	$(PY) -m perf.drills.chaos $(CHAOS_ARGS)

clean:
	rm -rf .triton perf/results
	find model_repository \( -name '*.onnx' -o -name '*.plan' -o -name '*.export.json' -o -name tokenizer.json -o -name labels.txt -o -name variants.json \) -delete
	rm -rf model_repository/*/configs export/reports
