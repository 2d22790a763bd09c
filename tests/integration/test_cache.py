"""The result cache against a real tritonserver and a real redis-server.

One server for this module, on a copy of the model repository made of symlinks (so a test can
add a text_encoder version without touching the real one), with Triton's response cache on,
text_embedding_cached's L2 at a redis-server the tests kill, stop and restart, and a short L2
retry interval. Tests run in file order; the hot swap is last.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import numpy as np
import pytest
import redis
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from server.layout import ROOT
from server.redis_process import RedisProcess
from tests.metrics_text import metric_sum, metric_values, scrape

CACHED, ENSEMBLE = "text_embedding_cached", "text_embedding"
RETRY_S = 0.5


@pytest.fixture(scope="module")
def redis_l2():
    with RedisProcess() as server:
        yield server


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """The real repository's models as symlinks; folders are real, so versions can be added."""
    target = tmp_path_factory.mktemp("repo") / "model_repository"
    shutil.copytree(
        (ROOT / "model_repository").resolve(), target, copy_function=os.symlink, ignore=shutil.ignore_patterns("__pycache__")
    )
    return target


@pytest.fixture(scope="module")
def triton(start_triton, redis_l2, repo):
    env = {
        "EMBEDDING_CACHE_L2_REDIS_URL": redis_l2.url,
        "EMBEDDING_CACHE_L2_RETRY_INTERVAL_S": str(RETRY_S),
        "EMBEDDING_CACHE_WARN_INTERVAL_S": "3600",
    }
    with start_triton("triton-cache-", (ENSEMBLE, CACHED), model_repository=repo, cache_size_bytes=16 << 20, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def client(triton):
    c = httpclient.InferenceServerClient(triton.http_url, concurrency=4)
    yield c
    c.close()


def embed(client, model: str, texts: list[str]) -> np.ndarray:
    return embed_counted(client, model, texts)[0]


def embed_counted(client, model: str, texts: list[str], truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """EMBEDDING [n, 384] and NUM_TOKENS [n] of ``texts`` (``truncate``: with TRUNCATE true, so
    a text over 256 tokens is embedded from its first tokens instead of refused)."""
    data = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
    inp = httpclient.InferInput("TEXT", list(data.shape), "BYTES")
    inp.set_data_from_numpy(data)
    inputs = [inp]
    if truncate:
        flag = httpclient.InferInput("TRUNCATE", list(data.shape), "BOOL")
        flag.set_data_from_numpy(np.ones(data.shape, dtype=np.bool_))
        inputs.append(flag)
    result = client.infer(model, inputs)
    return result.as_numpy("EMBEDDING"), result.as_numpy("NUM_TOKENS").reshape(-1)


def lookups(server, level: str, result: str) -> float:
    return metric(server, "embedding_cache_lookups_total", level=level, model=CACHED, result=result)


def cache_hits(server) -> float:
    """L1 + L2 hits: each of the model's two instances has its own L1, so a text cached by
    one instance is an L2 hit on the other."""
    return lookups(server, "l1", "hit") + lookups(server, "l2", "hit")


def redis_up(server) -> set[float]:
    """embedding_cache_redis_up of each instance."""
    return set(metric_values(scrape(server.metrics_url), "embedding_cache_redis_up"))


def metric(server, name: str, **labels) -> float:
    """The sum of ``name``'s series whose labels include ``labels`` (tests/metrics_text.py)."""
    return metric_sum(scrape(server.metrics_url), name, **labels)


def ensemble_requests(client) -> int:
    stats = client.get_inference_statistics(ENSEMBLE)["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


def test_cached_vectors_equal_the_ensemble_and_repeat_bit_for_bit(client, triton):
    texts = ["A man is playing a guitar.", "Ein Mann spielt Gitarre.", "猫が好きです", "🙂 ok"]
    direct = embed(client, ENSEMBLE, texts)
    first = embed(client, CACHED, texts)
    assert first.shape == (4, 384) and first.dtype == np.float32
    assert np.abs(first - direct).max() < 1e-4  # computed by the same model (batching noise only)
    hits = cache_hits(triton)
    second = embed(client, CACHED, texts)
    assert np.array_equal(second, first)
    assert cache_hits(triton) - hits == 4


def test_partial_hits_in_one_batch_one_model_call_for_the_misses_in_order(client, triton):
    known = ["partial: known one", "partial: known two"]
    single = {t: embed(client, CACHED, [t])[0] for t in known}
    before = (ensemble_requests(client), cache_hits(triton), metric(triton, "embedding_cache_model_texts_total", model=CACHED))
    batch = ["partial: new A", known[0], "partial: new B", known[1], "partial: new A"]
    out = embed(client, CACHED, batch)
    after = (ensemble_requests(client), cache_hits(triton), metric(triton, "embedding_cache_model_texts_total", model=CACHED))
    assert after[0] - before[0] == 1  # ONE batched request to text_embedding for the misses
    assert after[1] - before[1] == 2  # distinct texts: 2 hits (L1, or L2 on the other instance)
    assert after[2] - before[2] == 2  # and 2 computed ("new A" once)
    assert np.array_equal(out[1], single[known[0]]) and np.array_equal(out[3], single[known[1]])
    assert np.array_equal(out[0], out[4])
    fresh = embed(client, ENSEMBLE, ["partial: new A", "partial: new B"])
    assert np.abs(out[[0, 2]] - fresh).max() < 1e-4


def test_triton_response_cache_hits_show_in_triton_metrics(client, triton):
    def hits(model: str) -> float:
        return metric(triton, "nv_cache_num_hits_per_model", model=model, version="1")

    before = hits("text_tokenizer")
    text = ["response cache: the same text twice"]
    a = embed(client, ENSEMBLE, text)
    b = embed(client, ENSEMBLE, text)
    assert hits("text_tokenizer") - before >= 1
    assert np.abs(a - b).max() < 1e-5
    # and never on the ensemble itself (it would serve old vectors after an encoder swap)
    assert hits("text_embedding") == 0


def test_token_counts_come_back_with_the_vectors_from_the_model_l1_and_l2(client, triton, redis_l2):
    """NUM_TOKENS is the tokenizer's count of the whole text (special tokens included, not cut at
    256) from the ensemble, and the same from the cache on a miss, an L1 hit and an L2 hit."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "model_repository" / "text_tokenizer" / "1" / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    texts = ["counts: hello world", "counts: " + "word " * 300, "counts: 猫が好きです 🙂"]
    expected = [len(tok.encode(t).ids) for t in texts]
    assert expected[1] > 256
    vectors, counts = embed_counted(client, ENSEMBLE, texts, truncate=True)
    assert counts.tolist() == expected and counts.dtype == np.int32
    miss = embed_counted(client, CACHED, texts, truncate=True)
    hit = embed_counted(client, CACHED, texts, truncate=True)
    assert miss[1].tolist() == hit[1].tolist() == expected
    assert np.array_equal(hit[0], miss[0]) and np.abs(miss[0] - vectors).max() < 1e-4
    client.unload_model(CACHED)  # a new process: an empty L1, the entries in L2
    client.load_model(CACHED)
    l2_hits = lookups(triton, "l2", "hit")
    from_l2 = embed_counted(client, CACHED, texts, truncate=True)
    assert lookups(triton, "l2", "hit") - l2_hits == 3
    assert from_l2[1].tolist() == expected and np.array_equal(from_l2[0], miss[0])


def test_l2_serves_a_new_replica(client, triton, redis_l2):
    text = ["shared: computed by one replica"]
    first = embed(client, CACHED, text)
    assert redis.Redis.from_url(redis_l2.url).dbsize() > 0
    # A new process with an empty L1, as another replica would be.
    client.unload_model(CACHED)
    client.load_model(CACHED)
    l2_hits = lookups(triton, "l2", "hit")
    again = embed(client, CACHED, text)
    assert np.array_equal(again, first)  # the very bytes another process stored
    assert lookups(triton, "l2", "hit") - l2_hits == 1


def test_redis_killed_mid_run_then_restarted(client, triton, redis_l2):
    errors = lambda: metric(triton, "embedding_cache_redis_errors_total", kind="connection", model=CACHED)  # noqa: E731
    before = errors()
    redis_l2.kill()
    texts = [f"redis down {i}" for i in range(3)]
    t = time.perf_counter()
    out = embed(client, CACHED, texts)  # still answered, by the model
    assert time.perf_counter() - t < 10  # refused at once; the client's own timeout is far longer
    assert np.abs(out - embed(client, ENSEMBLE, texts)).max() < 1e-4
    for i in range(5):
        embed(client, CACHED, [f"redis still down {i}"])
    assert errors() - before >= 1
    assert redis_up(triton) == {0.0}  # both instances tried and failed
    log = triton.log_tail(400)
    # one warning per interval and instance (two instances), not one per failed request
    assert 1 <= log.count("serving without L2") <= 2

    redis_l2.start()  # same port, empty
    time.sleep(RETRY_S + 0.2)
    # The next batch after the retry interval tries again; on a busy machine its 50 ms timeout may
    # expire once more (another interval): poll, with fresh texts so each one reaches L2.
    deadline = time.monotonic() + 30
    n = 0
    while 1.0 not in redis_up(triton):
        assert time.monotonic() < deadline, f"L2 not used again 30 s after Redis came back: {redis_up(triton)}"
        embed(client, CACHED, [f"redis back: {n}"])
        n += 1
        if 1.0 not in redis_up(triton):
            time.sleep(RETRY_S + 0.1)
    assert redis.Redis.from_url(redis_l2.url).dbsize() >= 1  # written to L2 again, no restart
    assert "is back" in triton.log_tail(400)


def test_stopped_redis_costs_a_bounded_wait(client, triton, redis_l2):
    def errors():
        return sum(metric(triton, "embedding_cache_redis_errors_total", kind=k, model=CACHED) for k in ("timeout", "connection"))

    before = errors()
    redis_l2.pause()
    try:
        for i in range(2):  # one per instance, past any retry interval still running
            time.sleep(RETRY_S + 0.1)
            t = time.perf_counter()
            embed(client, CACHED, [f"redis hangs: {i}"])
            assert time.perf_counter() - t < 10  # 50 ms timeouts, then the model (a hung Redis without one: forever)
        # a hung Redis times out (a connection it had dropped is refused instead)
        assert errors() - before >= 1
        assert metric(triton, "embedding_cache_redis_errors_total", kind="timeout", model=CACHED) >= 1
    finally:
        redis_l2.resume()


@pytest.mark.parametrize(
    "value, message",
    [
        (b"", "TEXT[0]: text is empty"),
        (b"   ", "TEXT[0]: text contains only whitespace"),
        (b"\xff\xfe", "TEXT[0]: not valid UTF-8"),
        (b"x" * 70000, "TEXT[0]: text is 70000 bytes; the limit is 65536 bytes"),
    ],
)
def test_bad_input_fails_only_its_request(client, value, message):
    data = np.array([[value]], dtype=object)
    inp = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    inp.set_data_from_numpy(data)
    with pytest.raises(InferenceServerException, match=re.escape(message)):
        client.infer(CACHED, [inp])
    assert embed(client, CACHED, ["still serving"]).shape == (1, 384)


def test_another_precision_variant_shares_redis_but_not_keys(start_triton, redis_l2, client):
    """A server restarted with another PRECISION (here: a second server, INT8) on the same
    Redis must not find the FP32 server's vectors: the variant is part of the key."""
    text = ["variant: computed by the FP32 server first"]
    fp32 = embed(client, CACHED, text)
    stored = redis.Redis.from_url(redis_l2.url).dbsize()
    env = {"EMBEDDING_CACHE_L2_REDIS_URL": redis_l2.url}
    with start_triton("triton-cache-int8-", (ENSEMBLE, CACHED), model_config_name="int8", env=env) as int8_server:
        c = httpclient.InferenceServerClient(int8_server.http_url)
        try:
            int8 = embed(c, CACHED, text)
            assert lookups(int8_server, "l2", "hit") == 0  # the FP32 entry was not found
            assert np.abs(int8 - embed(c, ENSEMBLE, text)).max() < 1e-4
            assert np.abs(int8 - fp32).max() > 1e-3  # and INT8 vectors do differ
            assert redis.Redis.from_url(redis_l2.url).dbsize() == stored + 1  # its own entry
            assert "variant int8" in int8_server.log_tail(400)
        finally:
            c.close()


def test_hot_swap_to_a_new_encoder_version_changes_the_keys(client, triton, repo):
    text = ["hot swap: the same text before and after"]
    old = embed(client, CACHED, text)
    assert np.array_equal(embed(client, CACHED, text), old)  # cached
    # Version 2 = the INT8 weights (other vectors than FP32's version 1), loaded through the API.
    encoder = repo / "text_encoder"
    (encoder / "2").mkdir()
    os.symlink((ROOT / "model_repository" / "text_encoder" / "1" / "model.int8.onnx").resolve(), encoder / "2" / "model.onnx")
    client.load_model("text_encoder")
    assert client.is_model_ready("text_encoder", "2") and not client.is_model_ready("text_encoder", "1")
    new_model = embed(client, ENSEMBLE, text)
    assert np.abs(new_model - old).max() > 1e-3  # the swap really changed the vectors
    after = embed(client, CACHED, text)
    assert np.abs(after - new_model).max() < 1e-4  # not the stale cached vector
    assert not np.array_equal(after, old)
    assert "text_encoder version 2" in triton.log_tail(400)
