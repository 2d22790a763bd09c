"""The metrics the rules and the dashboard watch, on the session server's real metrics port.

- The padding counters count exactly the known batch: the tokenizer's tensors (its bucketed
  padding) and the encoder's real ONNX Runtime runs (rows trimmed and regrouped under
  max_batch_tokens and max_row_padding: the runs worked out by hand here), with real <= padded
  everywhere.
- embedding_tokenizer_batch_size is a real histogram: cumulative buckets, +Inf = _count =
  the tokenizer's executions (nv_inference_exec_count), _sum = the requests they held.
- Every metric name deploy/prometheus/rules reads appears in a real scrape (Triton's, the
  router's once it is loaded, the gateway's), so no rule watches a series that does not exist.
- Every series the Grafana dashboard (deploy/grafana/dashboard.py) selects is in the real
  scrape of the job it names, with the label values it filters on: its unit test runs the
  queries against stand-in replicas, this checks the names against tritonserver itself.

Prometheus text is read with tests/metrics_text.py: a name not in a scrape fails, never reads 0.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import defaultdict

import numpy as np
import pytest
import tritonclient.http as httpclient

from contract.model_config import ModelConfig
from export.reference import model_dir
from ops.prometheus_rules import all_rules, scraped_names
from python_backends.padding_metrics import (
    BATCH_SIZE,
    BATCH_SIZE_BUCKETS,
    PADDED_TOKENS,
    REAL_TOKENS,
    histogram_buckets,
)
from python_backends.text.tokenization import BatchTokenizer
from tests.integration.conftest import unload_and_wait
from tests.metrics_text import metric_series, metric_sum, scrape, series_names


def settled(url: str, name: str, labels: dict, target: float, timeout: float = 30.0) -> str:
    """A scrape once ``name``'s series reach ``target`` (a reporter thread sends them just after
    the execution), or the last one when ``timeout`` ran out (the caller's asserts say what)."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(url)
        if metric_sum(text, name, **labels) >= target or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def texts_request(texts: list[str]) -> list:
    data = np.array([[t.encode()] for t in texts], dtype=object)
    inp = httpclient.InferInput("TEXT", list(data.shape), "BYTES")
    inp.set_data_from_numpy(data)
    return [inp]


def unique(text: str) -> str:
    return f"{text} {uuid.uuid4().hex[:8]}"  # Triton's response cache sits in front of the tokenizer


def served_config(http_client, model: str) -> ModelConfig:
    return ModelConfig(http_client.get_model_config(model))


@pytest.fixture(scope="module")
def tokenizer(http_client):
    config = served_config(http_client, "text_tokenizer")
    return BatchTokenizer(
        model_dir() / "tokenizer.json",
        max_length=config.param_int("max_sequence_length", 256),
        buckets=config.param_int_list("sequence_buckets", ()),
    )


def test_tokenizer_padding_counts_the_known_batch(triton, http_client, tokenizer):
    texts = [unique("hi"), unique("a rather longer sentence about the prices of apples in the autumn market"), unique("ok")]
    expected = tokenizer.encode(texts)
    labels = {"model": "text_tokenizer", "version": "1"}

    def value(text: str, name: str, **more) -> float:
        return metric_sum(text, name, series=True, **labels, **more)

    before = scrape(triton.metrics_url)
    result = http_client.infer("text_tokenizer", texts_request(texts))
    after = settled(triton.metrics_url, f"{BATCH_SIZE}_count", labels, value(before, f"{BATCH_SIZE}_count") + 1)
    real = value(after, REAL_TOKENS) - value(before, REAL_TOKENS)
    padded = value(after, PADDED_TOKENS) - value(before, PADDED_TOKENS)
    mask = result.as_numpy("attention_mask")
    assert (real, padded) == (int(expected.lengths.sum()), expected.input_ids.size) == (int(mask.sum()), mask.size)
    assert padded == 3 * 32 and real < padded  # the longest text rounded up to the 32 bucket
    executions = value(after, f"{BATCH_SIZE}_count") - value(before, f"{BATCH_SIZE}_count")
    buckets = {
        le: value(after, f"{BATCH_SIZE}_bucket", le=le) - value(before, f"{BATCH_SIZE}_bucket", le=le)
        for le in histogram_buckets([])
    }
    assert executions == 1 and buckets == histogram_buckets([1])  # one request, one execution: every bucket +1


# Seven rows sent padded to 32 with these real lengths (attention-mask ones). Under the served
# config's max_batch_tokens 128, max_row_padding 8 (no max_batch_rows) the backend runs, longest
# first, each run padded to its first row:
#   32 31 30 29  4 x 32 = 128 tokens; a fifth row (26) would make 5 x 32 = 160 > 128
#   26 24        2 x 26 =  52; the next row, 6, is 20 shorter than 26 (> 8)
#   6            1 x  6 =   6
# 186 padded tokens run for 178 real ones, of 7 x 32 = 224 sent. Worked out by hand, not by the
# backend's planner: without the token budget it would run 6 x 32 + 6 = 198, without the padding
# bound 128 + 3 x 26 = 206, untrimmed 224.
ENCODER_LENGTHS = [29, 6, 32, 24, 31, 26, 30]  # in no order: the backend sorts
ENCODER_SETTINGS = {"max_batch_tokens": 128, "max_batch_rows": 0, "max_row_padding": 8}
ENCODER_PADDED = 4 * 32 + 2 * 26 + 6


def test_encoder_padding_counts_its_real_runs(triton, http_client):
    config = served_config(http_client, "text_encoder")
    settings = {name: config.param_int(name, 0) for name in ENCODER_SETTINGS}
    assert settings == ENCODER_SETTINGS, f"text_encoder's run settings changed: work ENCODER_PADDED out again for {settings}"
    rng = np.random.default_rng(7)
    ids = np.zeros((len(ENCODER_LENGTHS), 32), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(ENCODER_LENGTHS):
        ids[row, :n] = rng.integers(1000, 20000, size=n)
        ids[row, 0], ids[row, n - 1] = 101, 102  # [CLS] ... [SEP]
        mask[row, :n] = 1
    inputs = []
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        inp = httpclient.InferInput(name, list(array.shape), "INT64")
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    labels = {"model": "text_encoder", "version": "1"}
    before = scrape(triton.metrics_url)
    padded_before = metric_sum(before, PADDED_TOKENS, series=True, **labels)
    http_client.infer("text_encoder", inputs)
    after = settled(triton.metrics_url, PADDED_TOKENS, labels, padded_before + ENCODER_PADDED)
    real = metric_sum(after, REAL_TOKENS, series=True, **labels) - metric_sum(before, REAL_TOKENS, series=True, **labels)
    padded = metric_sum(after, PADDED_TOKENS, series=True, **labels) - padded_before
    assert real == sum(ENCODER_LENGTHS) == 178
    assert padded == ENCODER_PADDED == 186, f"{padded:.0f} padded tokens run (by hand: 186; untrimmed 224)"
    print(f"rows {ENCODER_LENGTHS}: {real:.0f} real of {padded:.0f} padded tokens run (7 x 32 = 224 sent)")


def test_batch_size_histogram_is_cumulative_and_counts_executions(triton, http_client):
    # Requests in flight together (the client's 8 connections) so that executions hold several.
    pending = [http_client.async_infer("text_tokenizer", texts_request([unique(f"text {i}")])) for i in range(48)]
    for request in pending:
        request.get_result()
    labels = {"model": "text_tokenizer", "version": "1"}
    executions = metric_sum(scrape(triton.metrics_url), "nv_inference_exec_count", series=True, model="text_tokenizer")
    samples = settled(triton.metrics_url, f"{BATCH_SIZE}_count", labels, executions)
    buckets = {ls["le"]: v for ls, v in metric_series(samples, f"{BATCH_SIZE}_bucket", **labels)}
    order = [str(b) for b in BATCH_SIZE_BUCKETS] + ["+Inf"]
    assert sorted(buckets, key=order.index) == order
    counts = [buckets[le] for le in order]
    assert counts == sorted(counts), f"buckets not cumulative: {dict(zip(order, counts))}"
    count = metric_sum(samples, f"{BATCH_SIZE}_count", series=True, **labels)
    assert counts[-1] == count == metric_sum(samples, "nv_inference_exec_count", series=True, model="text_tokenizer") > 0
    # _sum: the requests that reached execute = all requests answered minus the cache's hits
    answered = metric_sum(samples, "nv_inference_request_success", series=True, model="text_tokenizer") + metric_sum(
        samples, "nv_inference_request_failure", series=True, model="text_tokenizer"
    )
    hits = metric_sum(samples, "nv_cache_num_hits_per_model", series=True, model="text_tokenizer")
    assert metric_sum(samples, f"{BATCH_SIZE}_sum", series=True, **labels) == answered - hits
    print(f"text_tokenizer: {count:.0f} executions, buckets {dict(zip(order, counts))}")


def test_padding_counters_real_never_above_padded(triton):
    text = scrape(triton.metrics_url)
    real, padded = defaultdict(float), defaultdict(float)
    for name, into in ((REAL_TOKENS, real), (PADDED_TOKENS, padded)):
        for labels, v in metric_series(text, name):
            into[labels["model"]] += v
    assert {"text_tokenizer", "text_encoder"} <= set(padded)
    assert set(real) == set(padded)
    for model in padded:
        assert 0 < real[model] <= padded[model], model
    print("fill rates since start:", {m: round(real[m] / padded[m], 3) for m in sorted(padded)})


CLASS_ENTRIES = ("text_embedding_cached", "text_embedding_cached_interactive", "text_embedding_cached_bulk")
ROUTER = "text_encoder_router"


@pytest.fixture(scope="module")
def real_scrapes(triton, http_client, openai_client, gateway) -> dict[str, str]:
    """Scrapes of the session's servers by Prometheus job, after a request to each model the
    rules and the dashboard read, so that series that exist only once used have a sample:
    ``triton`` (taken while the canary router is loaded and has flushed its counters, every
    0.5 s), ``gateway``, and ``watchdog`` (the launcher's stub watchdog, on the front door's
    metrics port: server/stubs.py)."""
    if "text_generation" not in triton.options.models:
        pytest.fail("the session server does not load text_generation: the llm_* series cannot be checked")
    for model in CLASS_ENTRIES:  # each class's entry model once, so its summaries have samples
        http_client.infer(model, texts_request([unique("class check")]))
    openai_client.models.list()  # one request counted by the gateway
    # one streamed chat through the gateway: its time-to-first-token histogram and the engine's
    chunks = openai_client.chat.completions.create(
        model="text_generation", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    assert [c for c in chunks], "the streamed chat sent nothing"
    http_client.load_model(ROUTER)
    try:
        ids = np.array([[101, 7592, 2088, 102]], dtype=np.int64)
        inputs = []
        for name, array in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
            inp = httpclient.InferInput(name, list(array.shape), "INT64")
            inp.set_data_from_numpy(array)
            inputs.append(inp)
        deadline = time.monotonic() + 60
        while True:
            http_client.infer(ROUTER, inputs)
            time.sleep(0.6)
            text = scrape(triton.metrics_url)
            if "canary_encoder_calls_total" in series_names(text):
                break
            assert time.monotonic() < deadline, "the canary router's counters did not show in 60 s"
    finally:
        unload_and_wait(http_client, ROUTER)
    return {
        "triton": text,
        "gateway": scrape(f"{gateway.url}/metrics"),
        "watchdog": scrape(triton.metrics_url.rsplit("/metrics", 1)[0] + "/metrics/watchdog"),
    }


def test_every_metric_the_rules_read_exists(real_scrapes):
    wanted = scraped_names(all_rules())
    seen = set().union(*(series_names(text) for text in real_scrapes.values()))
    seen.add("up")  # made by Prometheus for every target, not scraped
    assert wanted - seen == set(), "rules read series no server exposes"
    print(f"{len(wanted)} metric names the rules read, all in real scrapes: {sorted(wanted)}")


_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(name, [(label, op, value)]) of each ``name{...}`` selector of a PromQL expression."""
    return [(m.group(1), _MATCHER.findall(m.group(2))) for m in _SELECTOR.finditer(expr)]


def test_selectors_are_read_with_their_matchers():
    expr = 'sum by (le) (rate(a_bucket{job="triton", model=~"x|y", quantile="0.5"}[1m])) / b{job!="g"}'
    assert selectors(expr) == [
        ("a_bucket", [("job", "=", "triton"), ("model", "=~", "x|y"), ("quantile", "=", "0.5")]),
        ("b", [("job", "!=", "g")]),
    ]


def test_every_series_the_dashboard_selects_is_in_a_real_scrape(real_scrapes):
    """Each name a panel selects, in the scrape of the job its selector names (Triton's metrics
    port, the gateway's), with a series for each label value it filters on (each model of a
    model=~"a|b" alternation). Recording rules (a ':' in the name) are the rules' own, whose
    inputs the test above checks; ``up`` is Prometheus's."""
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed (requirements.txt)")
    from deploy.grafana import dashboard
    from tests.unit.test_grafana_dashboard import GRAFANA_VARIABLES, PROMETHEUS_SERIES, metric_names, queries

    board = dashboard.to_json()
    names = {job: series_names(real_scrapes[job]) for job in ("triton", "gateway")}
    problems, checked = [], set()

    def check(title: str, name: str, matchers: list[tuple[str, str, str]]) -> None:
        jobs = [v for k, op, v in matchers if k == "job" and op == "="] or [j for j in names if name in names[j]] or ["triton"]
        for job in jobs:
            if job not in names:
                problems.append((title, name, f"job {job!r}: no such scrape"))
                continue
            checked.add(name)
            if name not in names[job]:
                problems.append((title, name, f"not in the {job} scrape"))
                continue
            series = [labels for labels, _ in metric_series(real_scrapes[job], name)]
            for label, op, value in matchers:
                if label in ("job", "instance") or op not in ("=", "=~"):
                    continue  # Prometheus's target labels; a negative matcher selects anything else
                value = re.sub(r"\$(\w+)", lambda m: GRAFANA_VARIABLES[m.group(1)], value)
                if op == "=~" and not re.fullmatch(r"[\w|]+", value):  # a real regex: some series matches it
                    if not any(re.fullmatch(value, ls.get(label, "")) for ls in series):
                        problems.append((title, name, f"no series with {label}=~{value!r}"))
                    continue
                for v in value.split("|") if op == "=~" else [value]:  # each alternative of a=~"x|y"
                    if not any(ls.get(label) == v for ls in series):
                        problems.append((title, name, f"no series with {label}={v!r}"))

    for title, expr in queries(board):
        found = selectors(expr)
        bare = metric_names(expr) - {name for name, _ in found}
        for name, matchers in [*found, *((name, []) for name in sorted(bare))]:
            if ":" not in name and name not in PROMETHEUS_SERIES:
                check(title, name, matchers)
    assert not problems, f"the dashboard selects what the real servers do not expose: {problems}"
    assert {"nv_inference_request_success", "nv_inference_request_summary_us", "gateway_requests_total"} <= checked
    print(f"{len(checked)} names the dashboard selects, all in real scrapes: {sorted(checked)}")
