"""The metrics the rules watch, on the session server's real metrics port.

- The padding counters count exactly the known batch: the tokenizer's tensors (its bucketed
  padding) and the encoder's real ONNX Runtime runs (rows trimmed and regrouped under
  max_batch_tokens), with real <= padded everywhere.
- embedding_tokenizer_batch_size is a real histogram: cumulative buckets, +Inf = _count =
  the tokenizer's executions (nv_inference_exec_count), _sum = the requests they held.
- Every metric name deploy/prometheus/rules reads appears in a real scrape (Triton's, the
  router's once it is loaded, the gateway's), so no rule watches a series that does not exist.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from collections import defaultdict

import numpy as np
import pytest
import tritonclient.http as httpclient

from contract.model_config import ModelConfig
from export.reference import model_dir
from ops.prometheus_rules import all_rules, scraped_names
from python_backends.onnx_engine.batching import plan_runs
from python_backends.padding_metrics import (
    BATCH_SIZE,
    BATCH_SIZE_BUCKETS,
    PADDED_TOKENS,
    REAL_TOKENS,
    histogram_buckets,
)
from python_backends.text.tokenization import BatchTokenizer
from tests.integration.conftest import unload_and_wait

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(name, frozenset(_LABEL.findall(labels or ""))): float(value) for name, labels, value in _SAMPLE.findall(text)}


def value(samples, name: str, **labels) -> float:
    """The sum of ``name``'s series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def settled(url: str, name: str, labels: dict, target: float, timeout: float = 10.0):
    """A scrape once ``name``'s series reach ``target`` (a reporter thread sends them just after
    the execution), or the last one when ``timeout`` ran out."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if value(samples, name, **labels) >= target or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def names(samples) -> set[str]:
    return {name for name, _ in samples}


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
    before = scrape(triton.metrics_url)
    result = http_client.infer("text_tokenizer", texts_request(texts))
    after = settled(triton.metrics_url, f"{BATCH_SIZE}_count", labels, value(before, f"{BATCH_SIZE}_count", **labels) + 1)
    real = value(after, REAL_TOKENS, **labels) - value(before, REAL_TOKENS, **labels)
    padded = value(after, PADDED_TOKENS, **labels) - value(before, PADDED_TOKENS, **labels)
    mask = result.as_numpy("attention_mask")
    assert (real, padded) == (int(expected.lengths.sum()), expected.input_ids.size) == (int(mask.sum()), mask.size)
    assert padded == 3 * 32 and real < padded  # the longest text rounded up to the 32 bucket
    executions = value(after, f"{BATCH_SIZE}_count", **labels) - value(before, f"{BATCH_SIZE}_count", **labels)
    buckets = {
        le: value(after, f"{BATCH_SIZE}_bucket", le=le, **labels) - value(before, f"{BATCH_SIZE}_bucket", le=le, **labels)
        for le in histogram_buckets([])
    }
    assert executions == 1 and buckets == histogram_buckets([1])  # one request, one execution: every bucket +1


def test_encoder_padding_counts_its_real_runs(triton, http_client, tokenizer):
    # Three rows of real token ids padded to 32 as the tokenizer sends them; the backend trims
    # each to its length and plans its runs under the config's max_batch_tokens / max_row_padding.
    texts = ["a rather longer sentence about apples and pears", "short one", "ok"]
    batch = tokenizer.encode(texts)
    ids = np.zeros((3, 32), dtype=np.int64)
    mask = np.zeros_like(ids)
    ids[:, : batch.input_ids.shape[1]] = batch.input_ids
    mask[:, : batch.input_ids.shape[1]] = batch.attention_mask
    lengths = [int(n) for n in mask.sum(axis=1)]
    config = served_config(http_client, "text_encoder")
    runs = plan_runs(
        lengths,
        config.param_int("max_batch_tokens", 0),
        config.param_int("max_batch_rows", 0),
        config.param_int("max_row_padding", 0),
    )
    expected_padded = sum(len(run) * max(lengths[i] for i in run) for run in runs)
    inputs = []
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        inp = httpclient.InferInput(name, list(array.shape), "INT64")
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    labels = {"model": "text_encoder", "version": "1"}
    before = scrape(triton.metrics_url)
    http_client.infer("text_encoder", inputs)
    after = settled(triton.metrics_url, PADDED_TOKENS, labels, value(before, PADDED_TOKENS, **labels) + expected_padded)
    real = value(after, REAL_TOKENS, **labels) - value(before, REAL_TOKENS, **labels)
    padded = value(after, PADDED_TOKENS, **labels) - value(before, PADDED_TOKENS, **labels)
    assert real == sum(lengths)
    assert padded == expected_padded < ids.size  # what ran, not the 3 x 32 sent
    print(f"rows {lengths}: runs {runs}, {real:.0f} real of {padded:.0f} padded tokens run (3 x 32 = 96 sent)")


def test_batch_size_histogram_is_cumulative_and_counts_executions(triton, http_client):
    # Requests in flight together (the client's 8 connections) so that executions hold several.
    pending = [http_client.async_infer("text_tokenizer", texts_request([unique(f"text {i}")])) for i in range(48)]
    for request in pending:
        request.get_result()
    labels = {"model": "text_tokenizer", "version": "1"}
    executions = value(scrape(triton.metrics_url), "nv_inference_exec_count", model="text_tokenizer")
    samples = settled(triton.metrics_url, f"{BATCH_SIZE}_count", labels, executions)
    buckets = {dict(ls)["le"]: v for (n, ls), v in samples.items() if n == f"{BATCH_SIZE}_bucket" and set(labels.items()) <= ls}
    order = [str(b) for b in BATCH_SIZE_BUCKETS] + ["+Inf"]
    assert list(sorted(buckets, key=order.index)) == order
    counts = [buckets[le] for le in order]
    assert counts == sorted(counts), f"buckets not cumulative: {dict(zip(order, counts))}"
    count = value(samples, f"{BATCH_SIZE}_count", **labels)
    assert counts[-1] == count == value(samples, "nv_inference_exec_count", model="text_tokenizer") > 0
    # _sum: the requests that reached execute = all requests answered minus the cache's hits
    answered = value(samples, "nv_inference_request_success", model="text_tokenizer") + value(
        samples, "nv_inference_request_failure", model="text_tokenizer"
    )
    hits = value(samples, "nv_cache_num_hits_per_model", model="text_tokenizer")
    assert value(samples, f"{BATCH_SIZE}_sum", **labels) == answered - hits
    print(f"text_tokenizer: {count:.0f} executions, buckets {dict(zip(order, counts))}")


def test_padding_counters_real_never_above_padded(triton):
    samples = scrape(triton.metrics_url)
    real, padded = defaultdict(float), defaultdict(float)
    for (name, ls), v in samples.items():
        if name in (REAL_TOKENS, PADDED_TOKENS):
            (real if name == REAL_TOKENS else padded)[dict(ls)["model"]] += v
    assert {"text_tokenizer", "text_encoder"} <= set(padded)
    for model in padded:
        assert 0 < real[model] <= padded[model], model
    print("fill rates since start:", {m: round(real[m] / padded[m], 3) for m in sorted(padded)})


def test_every_metric_the_rules_read_exists(triton, http_client, openai_client, gateway):
    wanted = scraped_names(all_rules())
    # Each class's entry model once, so its queue summary has a sample.
    for model in ("text_embedding_cached", "text_embedding_cached_interactive", "text_embedding_cached_bulk"):
        http_client.infer(model, texts_request([unique("class check")]))
    seen = names(scrape(triton.metrics_url))
    if "text_generation" not in triton.options.models:
        pytest.fail("the session server does not load text_generation: the llm_* rules cannot be checked")
    # The canary router's counters exist once it is loaded and has flushed (every 0.5 s).
    router = "text_encoder_router"
    http_client.load_model(router)
    try:
        ids = np.array([[101, 7592, 2088, 102]], dtype=np.int64)
        inputs = []
        for name, array in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
            inp = httpclient.InferInput(name, list(array.shape), "INT64")
            inp.set_data_from_numpy(array)
            inputs.append(inp)
        deadline = time.monotonic() + 30
        while "canary_encoder_calls_total" not in seen and time.monotonic() < deadline:
            http_client.infer(router, inputs)
            time.sleep(0.6)
            seen |= names(scrape(triton.metrics_url))
    finally:
        unload_and_wait(http_client, router)
    openai_client.models.list()  # one request counted by the gateway
    seen |= names(scrape(f"{gateway.url}/metrics"))
    # The launcher's stub watchdog, on the front door's metrics port (server/stubs.py).
    seen |= names(scrape(triton.metrics_url.rsplit("/metrics", 1)[0] + "/metrics/watchdog"))
    seen.add("up")  # made by Prometheus for every target, not scraped
    assert wanted - seen == set(), "rules read series no server exposes"
    print(f"{len(wanted)} metric names the rules read, all in real scrapes: {sorted(wanted)}")
