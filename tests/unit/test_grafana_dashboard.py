"""The Grafana dashboard kept as code (deploy/grafana/dashboard.py): its JSON, and every PromQL
expression run by a real Prometheus.

Grafana cannot run on these machines, so what is checked is what Grafana would be given:

- the JSON model: uid, title, every panel with the provisioned datasource and at least one
  query, unique panel ids, grid positions inside the 24 columns that never overlap;
- every metric a panel names is one the project emits (a literal in its code), one of
  tritonserver 2.51's families (the list below, from a real scrape), a recording rule of
  deploy/prometheus/rules/, or Prometheus's ``up``;
- every expression, with Grafana's variables substituted, goes to the real Prometheus binary
  (/usr/bin/prometheus, Debian's 2.42) through /api/v1/query: a syntax error is its 400. That
  Prometheus scrapes two stand-in Triton replicas and a gateway, whose exposition is made by the
  project's own metric classes (padding, cache, generation, router tallies, the gateway's
  registry) and, for Triton's families, by the label sets of that real scrape; it loads the
  rules. Every panel query must then return series: a wrong label name or value, a metric that
  is not scraped or a rule that is not recorded shows up as an empty result.

The stand-ins are written here, so tests/integration/test_metrics.py checks the same selectors
(names, and the label values they filter on) against a real tritonserver's and gateway's scrapes.
"""

from __future__ import annotations

import http.server
import itertools
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from server.layout import ROOT

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed (requirements-dev.txt)")

from deploy.grafana import dashboard  # noqa: E402 (only once its packages are known installed)

PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
RULES = ROOT / "deploy" / "prometheus" / "rules"
# Grafana's variables as Grafana would substitute them ($instance: the "All" value).
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h", "instance": ".*"}
# tritonserver 2.51's families on its metrics port (a scrape of `make serve`'s server with
# --metrics-config=summary_latencies=true, CPU only: the GPU families are not listed).
TRITON_FAMILIES = {
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
    "nv_inference_pending_request_count",
    "nv_inference_request_summary_us",
    "nv_inference_queue_summary_us",
    "nv_inference_compute_input_summary_us",
    "nv_inference_compute_infer_summary_us",
    "nv_inference_compute_output_summary_us",
    "nv_cache_num_hits_per_model",
    "nv_cache_num_misses_per_model",
    "nv_cache_hit_summary_per_model",
    "nv_cache_miss_summary_per_model",
    "nv_cache_util",
    "nv_cache_num_entries",
    "nv_cpu_utilization",
    "nv_cpu_memory_used_bytes",
    "nv_cpu_memory_total_bytes",
}
# What Prometheus itself adds to every scrape.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# Where the project's own metric names are written (as string literals).
EMITTING_CODE = ("python_backends", "openai_gateway", "model_repository")
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}


@pytest.fixture(scope="module")
def board() -> dict:
    return dashboard.to_json()


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel."""
    return [(p["title"], t["expr"]) for p in panels(board) for t in p["targets"]]


def substitute(expr: str) -> str:
    """Grafana's $var and ${var} (only its own names: label_replace's "$1" stays)."""
    names = "|".join(map(re.escape, GRAFANA_VARIABLES))
    return re.sub(r"\$\{(" + names + r")\}|\$(" + names + r")\b", lambda m: GRAFANA_VARIABLES[m.group(1) or m.group(2)], expr)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (strings, label matchers, ranges and grouping removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group(0).lower() in PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(match.group(0))
    return names


def recording_rules() -> set[str]:
    names = set()
    for path in sorted(RULES.glob("*.y*ml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            names.update(rule["record"] for rule in group.get("rules", []) if "record" in rule)
    return names


def literals_in_code() -> set[str]:
    found = set()
    for folder in EMITTING_CODE:
        for path in (ROOT / folder).rglob("*.py"):
            found.update(re.findall(r"[\"']([a-z][a-z0-9_]+)[\"']", path.read_text(encoding="utf-8")))
    return found


# ---- the JSON model ------------------------------------------------------------------------


def test_dashboard_identity_and_datasource(board):
    assert board["uid"] == dashboard.UID and re.fullmatch(r"[a-z0-9-]{1,40}", board["uid"])
    assert board["title"] == dashboard.TITLE
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == dashboard.DATASOURCE_UID
    assert source["url"] == "http://prometheus:9090"  # the compose service
    assert len(panels(board)) >= 20
    for panel in panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": dashboard.DATASOURCE_UID}, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert all(ref_ids) and len(set(ref_ids)) == len(ref_ids), (panel["title"], ref_ids)
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        assert panel["title"]
    (variable,) = board["templating"]["list"]
    assert variable["name"] == "instance" and variable["datasource"]["uid"] == dashboard.DATASOURCE_UID


def test_panel_ids_are_unique_and_the_grid_has_no_overlap(board):
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) and i > 0 for i in ids), ids
    boxes = []
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, (p["title"], g)
        boxes.append((p["title"], g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"]))
    for (a, ax0, ay0, ax1, ay1), (b, bx0, by0, bx1, by1) in itertools.combinations(boxes, 2):
        assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, f"{a!r} and {b!r} overlap"
    # rows come in order, each above its panels
    rows = [p for p in board["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == [r.title for r in dashboard.rows()]
    assert [r["gridPos"]["y"] for r in rows] == sorted(r["gridPos"]["y"] for r in rows)


def test_the_dashboard_shows_what_the_issue_asks_for(board):
    exprs = " ".join(e for _, e in queries(board))
    titles = " ".join(p["title"] for p in panels(board)).lower()
    for name in (
        "nv_inference_request_success",
        "nv_inference_request_summary_us",
        "model:nv_inference_queue_time_us:avg_rate1m",
        "embedding_tokenizer_batch_size_bucket",
        "job:embedding_padding_fill_rate:ratio_rate5m",
        "embedding_cache_lookups_total",
        "llm_kv_cache_blocks_used",
        "llm_kv_cache_blocks_total",
        "llm_time_to_first_token_seconds_bucket",
        "canary_encoder_calls_total",
        'up{job="triton"}',
    ):
        assert name in exprs, name
    for entry in dashboard.CLASS_ENTRIES:
        assert entry in exprs
    for word in (
        "requests/s",
        "p50 / p99",
        "per class",
        "queue time",
        "batch size",
        "fill rate",
        "hit rate per level",
        "kv cache",
        "first token",
        "canary split",
        "replicas up",
    ):
        assert word in titles, word


def test_every_metric_name_is_emitted_or_known(board):
    rules, literals = recording_rules(), literals_in_code()
    unknown = []
    for title, expr in queries(board):
        for name in metric_names(expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if ":" in name:
                ok = name in rules
            else:
                ok = any(
                    n in TRITON_FAMILIES
                    or n in PROMETHEUS_SERIES
                    or n in literals
                    or n.removesuffix("_total") in literals  # prometheus_client adds _total
                    for n in (name, base)
                )
            if not ok:
                unknown.append((title, name))
    assert not unknown, f"names neither emitted by the project, nor Triton's, nor recording rules: {unknown}"
    # the check can fail: a name nobody emits is caught
    assert "embedding_padding_fill_rate_total" not in literals and "nv_inference_made_up" not in TRITON_FAMILIES
    assert metric_names('sum by (le) (rate(a_bucket{x="y"}[5m])) / ignoring (v) group_left b') == {"a_bucket", "b"}


def test_render_writes_what_the_provider_reads(tmp_path):
    assert dashboard.main(["render", str(tmp_path)]) == 0
    written = json.loads((tmp_path / dashboard.FILE_NAME).read_text())
    assert written == dashboard.to_json()
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "provider.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"


# ---- every expression through a real Prometheus ----------------------------------------------


class Exposition:
    """pb_utils.MetricFamily's interface, rendering the Prometheus text format: the project's
    metric classes (which take pb_utils as an argument) write into it as they write into Triton."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self):
        self.families: list[Exposition.Family] = []
        store = self

        class Family:
            COUNTER, GAUGE, HISTOGRAM = Exposition.COUNTER, Exposition.GAUGE, Exposition.HISTOGRAM

            def __init__(self, name, description, kind):
                self.name, self.description, self.kind, self.metrics = name, description, kind, []
                store.families.append(self)

            def Metric(self, labels, buckets=None):
                metric = Metric(dict(labels), buckets)
                self.metrics.append(metric)
                return metric

        class Metric:
            def __init__(self, labels, buckets):
                self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []

            def increment(self, n):
                self.value += n

            def set(self, v):
                self.value = v

            def observe(self, v):
                self.observed.append(v)

        self.MetricFamily = Family

    def text(self) -> str:
        def labels(d):
            return "{" + ",".join(f'{k}="{v}"' for k, v in d.items()) + "}"

        lines = []
        for f in self.families:
            lines += [f"# HELP {f.name} {f.description}", f"# TYPE {f.name} {f.kind}"]
            for m in f.metrics:
                if f.kind != self.HISTOGRAM:
                    lines.append(f"{f.name}{labels(m.labels)} {m.value}")
                    continue
                for bound in [*m.buckets, float("inf")]:
                    le = "+Inf" if bound == float("inf") else f"{bound:g}"
                    lines.append(f"{f.name}_bucket{labels({**m.labels, 'le': le})} {sum(v <= bound for v in m.observed)}")
                lines += [
                    f"{f.name}_sum{labels(m.labels)} {sum(m.observed)}",
                    f"{f.name}_count{labels(m.labels)} {len(m.observed)}",
                ]
        return "\n".join(lines) + "\n"


class TritonReplica:
    """One replica's metrics port: the project's metric classes driven as the models drive them,
    and Triton's own families with the labels tritonserver 2.51 gives them. Every scrape is one
    more second of traffic, so rates are non-zero."""

    MODELS = (
        "text_embedding",
        "text_tokenizer",
        "text_encoder",
        "text_encoder_interactive",
        "text_embedding_interactive",
        *dashboard.CLASS_ENTRIES,
        "image_classification",
        "text_generation",
    )

    def __init__(self, replica: int):
        from python_backends.cache.triton_metrics import CacheMetrics
        from python_backends.generation.triton_metrics import GenerationMetrics
        from python_backends.padding_metrics import PaddingMetrics
        from python_backends.routing.router import (
            CALLS_METRIC,
            LATENCY_METRIC,
            CallTally,
        )

        self.replica, self.scrapes = replica, 0
        self.pb = Exposition()
        # in the scrape's thread (no reporter thread): each scrape shows every execution recorded before it
        self.tokenizer = PaddingMetrics(self.pb, "text_tokenizer", "1", batch_histogram=True, background=False)
        self.encoder = PaddingMetrics(self.pb, "text_encoder", "1", background=False)
        self.cache = CacheMetrics(self.pb, "text_embedding_cached", instance="text_embedding_cached_0_0")
        self.generation = GenerationMetrics(self.pb, {"model": "text_generation", "version": "1"})
        self.generation.close()  # its reporter thread: the metrics are driven directly here
        family = self.pb.MetricFamily
        # The router's families as python_backends/routing/triton_metrics.py creates them.
        self.calls = family(CALLS_METRIC, "router calls", family.COUNTER)
        self.latency = family(LATENCY_METRIC + "_bucket", "router call latency", family.COUNTER)
        self.router_metrics: dict = {}
        self.tally = CallTally(interval_s=0)
        self.triton: dict[tuple, float] = {}

    def _router(self):
        for n in range(20):
            version = 2 if n % 10 == 0 else 1  # a 10 % canary
            self.tally.record(version, "error" if n == 5 else "ok", ms=3.0 + n)
        results, buckets = self.tally.drain()
        base = {"model": "text_encoder", "instance": "text_encoder_router_0_0"}
        for family, extra in [
            (self.calls, {(f"{v}", r): n for (v, r), n in results.items()}),
            (self.latency, {(f"{v}", le): n for (v, le), n in buckets.items()}),
        ]:
            key_name = "result" if family is self.calls else "le"
            for (version, key), n in extra.items():
                labels = {**base, "version": version, key_name: key}
                metric = self.router_metrics.get((family.name, tuple(labels.items())))
                if metric is None:
                    metric = self.router_metrics[(family.name, tuple(labels.items()))] = family.Metric(labels)
                metric.increment(n)

    def tick(self) -> None:
        self.scrapes += 1
        for requests in (1, 3, 8, 30):  # four tokenizer executions
            self.tokenizer.record(real=175, padded=256, requests=requests)
        self.encoder.record(real=700, padded=800)
        for (level, result), n in {("l1", "hit"): 30, ("l1", "miss"): 10, ("l2", "hit"): 4, ("l2", "miss"): 6}.items():
            self.cache.lookups[(level, result)].increment(n)
        self.cache.model_texts.increment(6)
        self.cache.errors["timeout"].increment(1)
        self.cache.l1_bytes.set(1 << 20)
        self.cache.redis_up.set(1)
        g = self.generation
        g.ttft.observe(0.05 * self.replica)
        g.generation_tokens.increment(40)
        g.prompt_tokens.increment(100)
        g.gauges["kv_blocks_used"].set(100 * self.replica)
        g.gauges["kv_blocks_total"].set(1000)
        g.gauges["num_requests_running"].set(3)
        g.gauges["num_requests_waiting"].set(1)
        self._router()
        for model in self.MODELS:
            add = {
                "nv_inference_request_success": 50,
                "nv_inference_count": 80,
                "nv_inference_exec_count": 10,
                "nv_inference_request_duration_us": 50 * 9000,
                "nv_inference_queue_duration_us": 50 * 700,
                "nv_inference_compute_infer_duration_us": 10 * 5000,
            }
            for name, n in add.items():
                key = (name, (("model", model), ("version", "1")))
                self.triton[key] = self.triton.get(key, 0) + n
            for reason, n in (
                ("REJECTED", 1 if model in dashboard.CLASS_ENTRIES else 0),
                ("BACKEND", 0),
                ("OTHER", 0),
                ("CANCELED", 0),
            ):
                key = ("nv_inference_request_failure", (("model", model), ("reason", reason), ("version", "1")))
                self.triton[key] = self.triton.get(key, 0) + n
        for model in ("text_tokenizer", "image_preprocess"):
            for name, n in (("nv_cache_num_hits_per_model", 20), ("nv_cache_num_misses_per_model", 30)):
                key = (name, (("model", model), ("version", "1")))
                self.triton[key] = self.triton.get(key, 0) + n

    def text(self) -> str:
        lines = [
            f"{name}{{{','.join(f'{k}={json.dumps(v)}' for k, v in labels)}}} {value}"
            for (name, labels), value in sorted(self.triton.items())
        ]
        for model in self.MODELS:
            for family, base in (("nv_inference_request_summary_us", 9000), ("nv_inference_queue_summary_us", 700)):
                for quantile, factor in (("0.5", 1), ("0.9", 2), ("0.95", 3), ("0.99", 5), ("0.999", 8)):
                    lines.append(f'{family}{{model="{model}",version="1",quantile="{quantile}"}} {base * factor * self.replica}')
        lines.append(f"nv_cpu_utilization {0.3 * self.replica}")
        return "\n".join(lines) + "\n" + self.pb.text()


def _serve(render) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or next((p for p in ("/usr/bin/prometheus",) if Path(p).is_file()), None)


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    """A real Prometheus scraping two stand-in replicas (job triton) and the gateway's real
    registry (job gateway) every second, with deploy/prometheus/rules/ loaded; its base URL."""
    from openai_gateway.metrics import GatewayMetrics
    from server.process import free_port

    binary = prometheus_binary()
    if binary is None:
        reason = "prometheus is not installed (Debian package prometheus): the dashboard's PromQL is not run"
        print(reason)
        pytest.skip(reason)
    lock = threading.Lock()
    replicas = [TritonReplica(1), TritonReplica(2)]
    gateway = GatewayMetrics()

    def replica_text(r):
        with lock:
            r.tick()
            return r.text()

    def gateway_text():
        with lock:
            for route in ("/v1/embeddings", "/v1/chat/completions"):
                gateway.observe(route, 200, 0.02)
            gateway.observe("/v1/embeddings", 503, 0.001)
            gateway.ttft.labels("text_generation").observe(0.2)
            gateway.triton_ready.set(1)
            return gateway.exposition().decode()

    servers = [_serve(lambda r=r: replica_text(r)) for r in replicas] + [_serve(gateway_text)]
    work = tmp_path_factory.mktemp("prometheus")
    rule_files = sorted(str(p) for p in RULES.glob("*.y*ml"))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": rule_files,
        "scrape_configs": [
            {"job_name": "triton", "static_configs": [{"targets": [f"127.0.0.1:{s.server_port}" for s in servers[:2]]}]},
            {"job_name": "gateway", "static_configs": [{"targets": [f"127.0.0.1:{servers[2].server_port}"]}]},
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(work / "prometheus.log", "w") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                assert process.poll() is None, (work / "prometheus.log").read_text()
                try:
                    with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as reply:
                        if reply.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.2)
            print(f"prometheus at {url}, rules: {[Path(p).name for p in rule_files] or 'none'}")
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            for s in servers:
                s.shutdown()


def query(url: str, expr: str) -> tuple[int, dict]:
    data = urllib.parse.urlencode({"query": expr}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/api/v1/query", data=data), timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_prometheus_refuses_a_broken_expression(prom):
    """The check below can fail: Prometheus answers a syntax error with 400."""
    status, body = query(prom, substitute('sum by (model) (rate(nv_inference_count{job="triton"}[$__rate_interval])'))
    assert status == 400 and body["errorType"] == "bad_data", body
    assert substitute('label_replace(x, "c", "$1", "m", "(.+)")[$__range]') == 'label_replace(x, "c", "$1", "m", "(.+)")[1h]'


def test_every_expression_parses_and_evaluates(board, prom):
    failed = []
    for title, expr in queries(board):
        status, body = query(prom, substitute(expr))
        if status != 200 or body.get("status") != "success":
            failed.append((title, expr, status, body.get("error")))
    assert not failed, failed
    assert len(queries(board)) >= 40


def test_every_query_returns_series_from_the_scraped_replicas(board, prom):
    """Within a few scrapes every panel has data: the label names and values the panels filter
    on are the ones the project's metric classes and tritonserver write."""
    pending = {(title, expr) for title, expr in queries(board)}
    missing_rules = sorted({n for _, e in pending for n in metric_names(e) if ":" in n} - recording_rules())
    if missing_rules:
        print(f"recording rules not in {RULES.relative_to(ROOT)}: {missing_rules}")
    deadline = time.monotonic() + 40
    while pending and time.monotonic() < deadline:
        for title, expr in sorted(pending):
            status, body = query(prom, substitute(expr))
            assert status == 200, (title, expr, body)
            if body["data"]["result"]:
                pending.discard((title, expr))
        time.sleep(1)
    assert not pending, f"no series for: {sorted(pending)}"
    # two replicas scraped and up
    _, body = query(prom, 'sum(up{job="triton"})')
    assert float(body["data"]["result"][0]["value"][1]) == 2
    # the canary split adds up to one, with the canary near its 10 %
    _, body = query(prom, substitute(next(e for t, e in queries(board) if t.startswith("Canary split"))))
    shares = {r["metric"]["version"]: float(r["value"][1]) for r in body["data"]["result"]}
    assert set(shares) == {"1", "2"} and abs(sum(shares.values()) - 1) < 1e-9 and 0.05 < shares["2"] < 0.15, shares
    # per class: the default class and the two named ones
    _, body = query(prom, substitute(next(e for t, e in queries(board) if t == "Requests/s per class")))
    assert {r["metric"]["class"] for r in body["data"]["result"]} == {"default", "interactive", "bulk"}
