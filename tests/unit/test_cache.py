"""The result cache's library without Redis: keys, L1 (LRU, TTL, byte budget), the batch
plan (partial hits, one miss list, order), settings and the served identity."""

from __future__ import annotations

import numpy as np
import pytest

from contract.errors import ConfigError
from contract.model_config import ModelConfig
from python_backends.cache.identity import IdentityResolver, file_fingerprint, served_config
from python_backends.cache.keys import KEY_PREFIX, KeyMaker, ModelIdentity
from python_backends.cache.lru import ENTRY_OVERHEAD_BYTES, LRUCache
from python_backends.cache.settings import CacheSettings
from python_backends.cache.tiered import EmbeddingCache

DIM = 384
ID = ModelIdentity("text_embedding", "text_encoder", "1", "int8", "abcd")


def vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- keys ------------------------------------------------------------------------------


def test_key_changes_with_every_part_of_the_identity_and_the_exact_text():
    base = KeyMaker(ID)("Hello")
    assert base.startswith(KEY_PREFIX) and len(base) == len(KEY_PREFIX) + 64
    assert KeyMaker(ID)("Hello") == base  # stable
    others = [
        KeyMaker(ModelIdentity("other", "text_encoder", "1", "int8", "abcd"))("Hello"),
        KeyMaker(ModelIdentity("text_embedding", "enc", "1", "int8", "abcd"))("Hello"),
        KeyMaker(ModelIdentity("text_embedding", "text_encoder", "2", "int8", "abcd"))("Hello"),
        KeyMaker(ModelIdentity("text_embedding", "text_encoder", "1", "fp32", "abcd"))("Hello"),
        KeyMaker(ModelIdentity("text_embedding", "text_encoder", "1", "int8", "abce"))("Hello"),
        # no normalisation: case, spacing and Unicode form are part of the key
        KeyMaker(ID)("hello"),
        KeyMaker(ID)("Hello "),
        KeyMaker(ID)("Cafe\u0301"),
        KeyMaker(ID)("Caf\u00e9"),
    ]
    assert len({base, *others}) == len(others) + 1


def test_key_fields_are_length_prefixed():
    a = ModelIdentity("ab", "c", "1", "int8")
    b = ModelIdentity("a", "bc", "1", "int8")
    assert KeyMaker(a)("x") != KeyMaker(b)("x")


# ---- L1 --------------------------------------------------------------------------------


def test_l1_ttl_expiry():
    clock = Clock()
    l1 = LRUCache(max_bytes=1 << 20, ttl_s=10, clock=clock)
    l1.put("a", vec(1))
    clock.now += 9.9
    assert np.array_equal(l1.get("a"), vec(1))
    clock.now += 0.2  # 10.1 s after the put
    assert l1.get("a") is None
    assert l1.stats.expirations == 1 and l1.stats.entries == 0 and l1.stats.bytes == 0
    assert l1.stats.hits == 1 and l1.stats.misses == 1


def test_l1_ttl_zero_never_expires():
    clock = Clock()
    l1 = LRUCache(max_bytes=1 << 20, ttl_s=0, clock=clock)
    l1.put("a", vec(1))
    clock.now += 10**9
    assert l1.get("a") is not None


def test_l1_lru_eviction_by_byte_budget():
    per_entry = LRUCache.entry_bytes("k0", vec(0))
    assert per_entry == DIM * 4 + 2 + ENTRY_OVERHEAD_BYTES
    l1 = LRUCache(max_bytes=3 * per_entry, ttl_s=0)
    for i in range(3):
        l1.put(f"k{i}", vec(i))
    assert l1.get("k0") is not None  # k0 is now the most recently used; k1 the least
    l1.put("k3", vec(3))
    assert l1.get("k1") is None
    assert [l1.get(k) is not None for k in ("k0", "k2", "k3")] == [True, True, True]
    assert l1.stats.evictions == 1 and l1.stats.entries == 3 and l1.stats.bytes == 3 * per_entry
    assert l1.stats.bytes <= l1.max_bytes


def test_l1_budget_counts_bytes_not_entries():
    small = LRUCache.entry_bytes("k0", vec(0))
    l1 = LRUCache(max_bytes=10 * small, ttl_s=0)
    big = np.zeros(DIM * 4, dtype=np.float32)  # 4x the bytes of a normal entry
    for i in range(10):
        l1.put(f"k{i}", vec(i))
    l1.put("big", big)
    assert l1.stats.bytes <= 10 * small
    assert l1.stats.evictions >= 4
    assert l1.get("big") is not None


def test_l1_values_are_copies_and_read_only():
    l1 = LRUCache(max_bytes=1 << 20, ttl_s=0)
    v = vec(1)
    l1.put("a", v)
    v[:] = 0  # the caller's array changing later does not change the cache
    got = l1.get("a")
    assert np.array_equal(got, vec(1))
    with pytest.raises(ValueError):
        got[0] = 1.0


def test_l1_zero_budget_is_off_and_oversized_entries_are_skipped():
    off = LRUCache(max_bytes=0, ttl_s=0)
    off.put("a", vec(1))
    assert off.get("a") is None and len(off) == 0
    tiny = LRUCache(max_bytes=100, ttl_s=0)
    tiny.put("a", vec(1))
    assert len(tiny) == 0 and tiny.stats.evictions == 0
    with pytest.raises(ValueError):
        LRUCache(max_bytes=-1, ttl_s=0)


# ---- batch plan ------------------------------------------------------------------------


def test_partial_hits_one_miss_list_in_order_and_write_back():
    cache = EmbeddingCache(DIM, LRUCache(1 << 20, 0))
    keys = KeyMaker(ID)
    cache.l1.put(keys("b"), vec(2))
    cache.l1.put(keys("d"), vec(4))
    texts = ["a", "b", "c", "d", "a"]  # "a" twice: looked up and computed once
    plan = cache.plan(texts, [keys(t) for t in texts])
    assert plan.miss_texts == ["a", "c"]
    assert (plan.counts.texts, plan.counts.distinct, plan.counts.l1_hits, plan.counts.misses) == (5, 4, 2, 2)
    assert plan.rows(0, 5, DIM) is None  # misses not filled yet
    assert np.array_equal(plan.rows(1, 2, DIM), vec(2)[None])  # a request of only hits is complete
    cache.fill(plan, np.stack([vec(1), vec(3)]))
    rows = plan.rows(0, 5, DIM)
    assert np.array_equal(rows, np.stack([vec(1), vec(2), vec(3), vec(4), vec(1)]))
    # written back: the next batch is all hits
    again = cache.plan(["c", "a"], [keys("c"), keys("a")])
    assert again.miss_texts == [] and again.counts.l1_hits == 2


def test_fill_rejects_a_wrong_shape_and_store_false_does_not_write():
    cache = EmbeddingCache(DIM, LRUCache(1 << 20, 0))
    keys = KeyMaker(ID)
    plan = cache.plan(["a", "b"], [keys("a"), keys("b")])
    with pytest.raises(ValueError, match=r"shape \[1, 384\] for 2 texts"):
        cache.fill(plan, np.zeros((1, DIM)))
    cache.fill(plan, np.stack([vec(1), vec(2)]), store=False)
    assert plan.rows(0, 2, DIM) is not None
    assert len(cache.l1) == 0


def test_new_identity_misses_what_the_old_one_stored():
    cache = EmbeddingCache(DIM, LRUCache(1 << 20, 0))
    old, new = KeyMaker(ID), KeyMaker(ModelIdentity("text_embedding", "text_encoder", "2", "int8", "ffff"))
    plan = cache.plan(["a"], [old("a")])
    cache.fill(plan, vec(1)[None])
    assert cache.plan(["a"], [new("a")]).miss_texts == ["a"]


# ---- settings --------------------------------------------------------------------------


def _config(**params):
    return ModelConfig({"name": "text_embedding_cached", "parameters": {k: {"string_value": v} for k, v in params.items()}})


def test_settings_defaults_parameters_and_environment_override():
    s = CacheSettings.from_config(_config(), {})
    assert (s.l1_max_bytes, s.l1_ttl_s, s.l2_redis_url, s.l2_ttl_s, s.l2_timeout_s) == (64 << 20, 3600, "", 86400, 0.05)
    s = CacheSettings.from_config(_config(l1_max_mb="1", l2_redis_url="redis://h:1/0"), {})
    assert s.l1_max_bytes == 1 << 20 and s.l2_redis_url == "redis://h:1/0"
    s = CacheSettings.from_config(
        _config(l1_max_mb="1"), {"EMBEDDING_CACHE_L1_MAX_MB": "2", "EMBEDDING_CACHE_L2_REDIS_URL": "redis://e:2/0"}
    )
    assert s.l1_max_bytes == 2 << 20 and s.l2_redis_url == "redis://e:2/0"


@pytest.mark.parametrize(
    "params, environ, message",
    [
        ({"l1_max_mb": "lots"}, {}, "parameter 'l1_max_mb' must be a number, got 'lots'"),
        ({"l2_ttl_s": "0"}, {}, "parameter 'l2_ttl_s' must be >= 1, got '0'"),
        ({}, {"EMBEDDING_CACHE_L2_TIMEOUT_MS": "-5"}, "environment variable EMBEDDING_CACHE_L2_TIMEOUT_MS must be >= 1"),
        ({"l2_redis_url": "localhost:6379"}, {}, "l2_redis_url must start with redis://"),
    ],
)
def test_settings_errors_name_the_setting(params, environ, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CacheSettings.from_config(_config(**params), environ)


# ---- served identity -------------------------------------------------------------------


@pytest.fixture
def encoder_repo(tmp_path):
    enc = tmp_path / "text_encoder"
    (enc / "configs").mkdir(parents=True)
    (enc / "config.pbtxt").write_text('name: "text_encoder"\nbackend: "onnxruntime"\n')
    (enc / "configs" / "int8.pbtxt").write_text(
        "# GENERATED by `python -m export` from ../config.pbtxt for variant 'int8'\n"
        'name: "text_encoder"\n\ndefault_model_filename: "model.int8.onnx"\n'
    )
    (enc / "configs" / "cpu.pbtxt").write_text(
        "# GENERATED by `python -m export`: best variant for a CPU that passed its gate = int8\n"
        "# GENERATED by `python -m export` from ../config.pbtxt for variant 'int8'\n"
        'name: "text_encoder"\n\ndefault_model_filename: "model.int8.onnx"\n'
    )
    for version in ("1", "2"):
        (enc / version).mkdir()
        (enc / version / "model.onnx").write_bytes(b"fp32 weights " + version.encode())
        (enc / version / "model.int8.onnx").write_bytes(b"int8 weights " + version.encode())
    return tmp_path


def test_served_config_names_the_variant_and_file(encoder_repo):
    enc = encoder_repo / "text_encoder"
    assert served_config(enc, None) == ("fp32", "model.onnx")
    assert served_config(enc, "int8") == ("int8", "model.int8.onnx")
    assert served_config(enc, "cpu") == ("int8", "model.int8.onnx")
    assert served_config(enc, "fp16") == ("fp32", "model.onnx")  # no such config: Triton falls back too


def test_identity_follows_the_ready_version_and_the_variant(encoder_repo):
    ready = {"1"}
    resolver = IdentityResolver(
        encoder_repo, "text_embedding", "text_encoder", "int8", lambda name, version: name == "text_encoder" and version in ready
    )
    assert resolver.versions() == ["2", "1"]
    one = resolver.identity()
    assert (one.version, one.variant) == ("1", "int8")
    assert one.fingerprint == file_fingerprint(encoder_repo / "text_encoder" / "1" / "model.int8.onnx")
    ready.add("2")  # both ready (a canary, or mid-swap): which one serves is unknown -> no cache
    assert resolver.identity() is None
    assert resolver.identity("2").version == "2"  # unless the caller names the version
    ready.discard("1")  # version 1 unloaded: the next batch has new keys
    two = resolver.identity()
    assert two.version == "2" and two.fingerprint != one.fingerprint
    assert KeyMaker(one)("t") != KeyMaker(two)("t")
    assert resolver.identity("1") == one  # a caller may name the version (canary routing)
    fp32 = IdentityResolver(encoder_repo, "text_embedding", "text_encoder", None, lambda n, v: v == "2").identity()
    assert fp32.variant == "fp32" and KeyMaker(fp32)("t") != KeyMaker(two)("t")
    ready.clear()
    assert resolver.identity() is None


def test_identity_reads_the_config_name_from_the_environment(encoder_repo, monkeypatch):
    monkeypatch.setenv("TRITON_MODEL_CONFIG_NAME", "cpu")
    resolver = IdentityResolver(encoder_repo, "text_embedding", "text_encoder", None, lambda n, v: v == "1")
    assert resolver.identity().variant == "int8"


def test_fingerprint_follows_the_file_content(tmp_path):
    f = tmp_path / "m.onnx"
    f.write_bytes(b"a")
    first = file_fingerprint(f)
    f.write_bytes(b"bb")
    assert file_fingerprint(f) != first
    assert file_fingerprint(tmp_path / "missing") == ""
