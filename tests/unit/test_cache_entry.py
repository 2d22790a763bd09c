"""python_backends.cache.entry: the cached entry's batch (keys, L1, one model call for the misses,
admission, failures) without Triton; and its model.py shim driven with a fake pb_utils."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from contract.errors import ConfigError, InputError, Overloaded, format_error, parse_error
from contract.model_config import ModelConfig
from python_backends.cache.entry import CachedEntry
from tests.unit.triton_fakes import (
    Request,
    encoder_repository,
    load_shim,
    make_pb_utils,
    model_config,
    tensor,
    triton_logging,
)

pytestmark = pytest.mark.usefixtures(triton_logging.__name__)
DIM = 4


def config_json(dims=(DIM,), **parameters):
    return model_config(
        "text_embedding_cached",
        [
            tensor("TEXT", [1], "TYPE_STRING"),
            tensor("TRUNCATE", [1], "TYPE_BOOL"),
            tensor("TRUNCATION_DIRECTION", [1], "TYPE_STRING"),
        ],
        [tensor("EMBEDDING", dims, "TYPE_FP32"), tensor("NUM_TOKENS", [1], "TYPE_INT32")],
        parameters={"admission_rows": "64", **parameters},
    )


def vector(text):
    return np.full(DIM, float(len(text)), np.float32)


def count(text):
    """The target's token count of ``text`` (any function other than the vector's)."""
    return 2 + 3 * len(text)


def answer(texts):
    return np.stack([vector(t) for t in texts]), np.array([[count(t)] for t in texts], np.int32)


class Model:
    """The target model: one vector and token count per text, every call recorded; ``fail``
    makes it raise."""

    def __init__(self):
        self.calls, self.fail = [], None

    def __call__(self, texts, options=None):
        self.calls.append(list(texts))
        if self.fail:
            raise self.fail
        return answer(texts)


@pytest.fixture
def repo(tmp_path):
    return encoder_repository(tmp_path / "repo", versions=(1, 2))


@pytest.fixture
def ready():
    return {"1"}


def entry_for(tmp_path, repo, ready, model, **parameters):
    return CachedEntry(
        ModelConfig(config_json(**parameters)),
        repo,
        lambda name, version: version in ready,
        model,
        environ={},
        admission_dir=tmp_path / "admission",
    )


def test_hits_are_served_without_the_model_and_misses_go_in_one_call(tmp_path, repo, ready):
    model = Model()
    entry = entry_for(tmp_path, repo, ready, model)
    first = entry.embed([["a", "bb"], ["bb", "ccc"]])
    assert model.calls == [["a", "bb", "ccc"]]  # distinct texts, one call
    assert [r[0].tolist() for r in first] == [
        [vector("a").tolist(), vector("bb").tolist()],
        [vector("bb").tolist(), vector("ccc").tolist()],
    ]
    assert [r[1].tolist() for r in first] == [[count("a"), count("bb")], [count("bb"), count("ccc")]]
    assert first[0][1].dtype == np.int32 and first[0][0].dtype == np.float32
    again = entry.embed([["ccc"], ["dddd", "a"]])
    assert model.calls[1:] == [["dddd"]]
    vectors, counts = again[1]
    assert vectors.tolist() == [vector("dddd").tolist(), vector("a").tolist()]
    assert counts.tolist() == [count("dddd"), count("a")]  # the hit's count came from the cache
    assert entry.embed([]) == [] and len(model.calls) == 2


def test_a_failed_model_call_fails_only_the_requests_it_left_without_vectors(tmp_path, repo, ready):
    model = Model()
    entry = entry_for(tmp_path, repo, ready, model)
    entry.embed([["cached"]])
    model.fail = RuntimeError("text_embedding failed: boom")
    cached, missing = entry.embed([["cached"], ["cached", "new"]])
    assert cached[0].tolist() == [vector("cached").tolist()] and cached[1].tolist() == [count("cached")]
    assert missing is model.fail


def test_a_full_lane_refuses_the_misses_with_overloaded(tmp_path, repo, ready):
    entry = entry_for(tmp_path, repo, ready, Model(), admission_rows="1")
    seen = []

    def nested(texts, options):  # the lane is full while this batch is in it: a second batch is refused
        seen.append(entry.embed([["other"], ["more"]]))
        return answer(texts)

    entry.compute = nested
    (rows,) = entry.embed([["x"]])
    assert rows[0].tolist() == [vector("x").tolist()]
    assert all(isinstance(r, Overloaded) for r in seen[0])


def test_without_one_ready_version_the_cache_is_bypassed(tmp_path, repo, ready):
    model = Model()
    entry = entry_for(tmp_path, repo, ready, model)
    ready.add("2")  # a canary: two versions ready, none chosen
    entry.embed([["a"]])
    (a, b) = entry.embed([["a"], ["b"]])
    assert model.calls == [["a"], ["a", "b"]]
    assert (a[0].tolist(), a[1].tolist(), b[1].tolist()) == ([vector("a").tolist()], [count("a")], [count("b")])
    model.fail = RuntimeError("down")
    assert entry.embed([["a"], ["b"]]) == [model.fail, model.fail]


def test_vectors_computed_across_a_version_swap_are_returned_not_stored(tmp_path, repo, ready):
    model = Model()
    entry = entry_for(tmp_path, repo, ready, model)

    def swapping(texts, options):
        ready.clear()
        ready.add("2")  # version 2 replaced version 1 during the call
        return model(texts)

    entry.compute = swapping
    (rows,) = entry.embed([["a"]])
    assert rows[0].tolist() == [vector("a").tolist()]
    entry.compute = model
    entry.embed([["a"]])
    assert model.calls == [["a"], ["a"]]  # not found under either version's keys
    assert entry.key_maker().identity.version == "2"


def test_a_request_for_another_class_is_refused_naming_its_entry(tmp_path, repo, ready):
    entry = entry_for(tmp_path, repo, ready, Model(), priority_class="bulk")
    entry.check_class('{"priority_class": "bulk"}')
    with pytest.raises(InputError, match="send it to model text_embedding_cached_interactive"):
        entry.check_class('{"priority_class": "interactive"}')


def test_the_config_is_checked_at_load(tmp_path, repo, ready, caplog):
    with pytest.raises(ValueError, match=r"EMBEDDING must have dims \[d\]"):
        CachedEntry(ModelConfig(config_json(dims=(2, 2))), repo, lambda *a: True, Model(), {}, tmp_path)
    no_counts = json.loads(config_json())
    no_counts["output"] = no_counts["output"][:1]
    with pytest.raises(ConfigError, match="NUM_TOKENS"):
        CachedEntry(ModelConfig(json.dumps(no_counts)), repo, lambda *a: True, Model(), {}, tmp_path)
    with pytest.raises(InputError, match="unknown priority class 'urgent'"):
        entry_for(tmp_path, repo, ready, Model(), priority_class="urgent")
    with pytest.raises(ConfigError, match="l2_redis_url must start with"):
        entry_for(tmp_path, repo, ready, Model(), l2_redis_url="http://x")
    with caplog.at_level(logging.WARNING, logger="python_backends.cache.entry"):
        entry_for(tmp_path, repo, ready, Model(), admission_rows="128")  # > (2 - 1) x 64
    assert "a flood queues instead of being refused" in caplog.text


def test_metrics_hear_of_lookups_and_computed_texts(tmp_path, repo, ready):
    class Recorder:
        def __init__(self):
            self.synced, self.computed, self.recorded = 0, [], []

        def sync(self, l1, l2):
            self.synced += 1

        def model_computed(self, n):
            self.computed.append(n)

        def record(self, counts, l1, l2):
            self.recorded.append((counts.texts, counts.l1_hits, counts.misses))

    entry, metrics = entry_for(tmp_path, repo, ready, Model()), Recorder()
    entry.use_metrics(metrics)
    entry.embed([["a", "b"]])
    entry.embed([["a"]])
    assert (metrics.synced, metrics.computed, metrics.recorded) == (1, [2], [(2, 0, 2), (1, 1, 0)])


def test_the_shim_answers_each_request_and_calls_the_target_once_per_batch(tmp_path, repo, monkeypatch):
    monkeypatch.setenv("TRITON_ADMISSION_DIR", str(tmp_path / "admission"))
    monkeypatch.delenv("TRITON_MODEL_CONFIG_NAME", raising=False)

    def bls(request):
        texts = [row[0].decode() for row in request.inputs["TEXT"]]
        vectors, counts = answer(texts)
        return pb.InferenceResponse(output_tensors=[pb.Tensor("EMBEDDING", vectors), pb.Tensor("NUM_TOKENS", counts)])

    pb = make_pb_utils(bls, ready=lambda model, version: version == "1")
    shim = load_shim("text_embedding_cached", pb, monkeypatch)
    monkeypatch.setattr("python_backends.shim_base.freeze_loaded_objects", lambda: 0)
    shim.initialize(
        {"model_config": config_json(), "model_repository": str(repo / "text_embedding_cached"), "model_version": "1"}
    )

    def text(*values):
        return np.array([[v.encode()] for v in values], dtype=object)

    batch = [
        Request("ok", TEXT=text("one", "two")),
        Request("empty", TEXT=text("")),
        Request("class", {"priority_class": "bulk"}, TEXT=text("three")),
        Request("ok2", TEXT=text("two")),
    ]
    responses = shim.execute(batch)
    assert [t for r in pb.sent for t in r.inputs["TEXT"].ravel()] == [b"one", b"two"]
    assert pb.sent[0].model_name == "text_embedding" and pb.sent[0].parameters == {"priority_class": "default"}
    assert pb.sent[0].requested_output_names == ["EMBEDDING", "NUM_TOKENS"]
    assert responses[0].output("EMBEDDING").tolist() == [vector("one").tolist(), vector("two").tolist()]
    assert responses[0].output("NUM_TOKENS").tolist() == [[count("one")], [count("two")]]
    assert responses[3].output("EMBEDDING").tolist() == [vector("two").tolist()]
    assert responses[1].error().code() == responses[2].error().code() == pb.TritonError.INVALID_ARG
    assert "text_embedding_cached_bulk" in responses[2].error().message()
    pb.bls = lambda request: pb.InferenceResponse(error=pb.TritonError("down"))
    cached, failed = shim.execute([Request("hit", TEXT=text("one")), Request("miss", TEXT=text("four"))])
    assert cached.output("EMBEDDING").tolist() == [vector("one").tolist()]
    assert cached.output("NUM_TOKENS").tolist() == [[count("one")]] and cached.output("NUM_TOKENS").dtype == np.int32
    assert failed.error().code() == pb.TritonError.INTERNAL and "text_embedding failed: down" in failed.error().message()
    # The target's refusal crosses the BLS hop as data: its code, not INTERNAL, answers the client.
    busy = Overloaded("lane full", values={"in_flight": 8})
    pb.bls = lambda request: pb.InferenceResponse(error=pb.TritonError(format_error(busy), pb.TritonError.INTERNAL))
    (refused,) = shim.execute([Request("miss", TEXT=text("five"))])
    data = parse_error(refused.error().message())
    assert refused.error().code() == pb.TritonError.UNAVAILABLE, refused.error().message()
    assert (data.code, data.values) == ("overloaded", {"in_flight": 8}) and "text_embedding failed: lane full" in data.message
    kept = []
    monkeypatch.setattr("python_backends.shim_base.keep_metrics", lambda *objects: kept.extend(objects))
    shim.finalize()
    assert kept and all(hasattr(o, "increment") or hasattr(o, "Metric") for o in kept)


# --- truncation (docs/embeddings.md#truncation) ------------------------------------------------


class Tokenizing(Model):
    """A target that refuses as text_tokenizer does: a text starting with "long" has 300 tokens;
    sent without truncate, the call fails with the tokenizer's error as it crosses the BLS hop
    (format_error, then error_from_message: data, not words). Its vector depends on the end kept."""

    def __call__(self, texts, options=None):
        from contract.errors import error_from_message
        from contract.truncation import REFUSE, ContextLengthError

        self.calls.append(list(texts))
        self.options = list(options or [REFUSE] * len(texts))
        counts = [300 if t.startswith("long") else count(t) for t in texts]
        for i, (n, o) in enumerate(zip(counts, self.options)):
            if n > 256 and not o.truncate:
                raise error_from_message(format_error(ContextLengthError("TEXT", i, n, 256)), "text_embedding failed: ")
        vectors = np.stack([vector(t) + (100 if n > 256 and o.left else 0) for t, n, o in zip(texts, counts, self.options)])
        return vectors, np.array(counts, np.int32)


def test_a_text_over_the_limit_is_refused_by_default_and_its_neighbours_answered(tmp_path, repo, ready):
    from contract.truncation import ContextLengthError

    model = Tokenizing()
    entry = entry_for(tmp_path, repo, ready, model)
    refused, fine = entry.embed([["ok", "long one"], ["short"]])
    assert isinstance(refused, ContextLengthError) and refused.field == "TEXT[1]"
    assert refused.values == {"index": 1, "tokens": 300, "limit": 256}
    assert fine[1].tolist() == [count("short")]
    # The model refused the long text (no vector was made for it); the others were sent again.
    assert model.calls == [["ok", "long one", "short"], ["ok", "short"]]
    assert entry.embed([["ok"]])[0][1].tolist() == [count("ok")] and len(model.calls) == 2  # cached


def test_left_has_keys_of_its_own_right_shares_them_with_refusing(tmp_path, repo, ready):
    from contract.truncation import LEFT, REFUSE, RIGHT, ContextLengthError, Truncation

    model = Tokenizing()
    entry = entry_for(tmp_path, repo, ready, model)
    right, left = Truncation(True, RIGHT), Truncation(True, LEFT)
    (r,) = entry.embed([["long text"]], [[right]])
    (lft,) = entry.embed([["long text"]], [[left]])
    assert len(model.calls) == 2 and not np.array_equal(r[0], lft[0])  # two keys, two vectors
    assert r[1].tolist() == lft[1].tolist() == [300]  # the whole text's count either way
    # A refusing request finds the right-truncated entry and is refused by its stored count.
    (refused,) = entry.embed([["long text"]])
    assert isinstance(refused, ContextLengthError) and refused.values["tokens"] == 300 and len(model.calls) == 2
    # Hits again, from each key.
    assert np.array_equal(entry.embed([["long text"]], [[right]])[0][0], r[0])
    assert np.array_equal(entry.embed([["long text"]], [[left]])[0][0], lft[0]) and len(model.calls) == 2
    # A text that fits: refusing and right share one entry; left has its own, with the same vector.
    (a,) = entry.embed([["fits"]])
    (b,) = entry.embed([["fits"]], [[right]])
    (c,) = entry.embed([["fits"]], [[left]])
    assert len(model.calls) == 4 and np.array_equal(a[0], b[0]) and np.array_equal(a[0], c[0])
    keys = entry.key_maker()
    assert keys("fits") != keys("fits", left=True) and keys("fits", left=True).startswith("emb2:left:")
    # One batch, the same long text refused by one request and truncated by another: one call, truncated.
    refused, kept = entry.embed([["long new"], ["long new"]], [[REFUSE], [right]])
    assert model.calls[-1] == ["long new"] and model.options == [right]
    assert isinstance(refused, ContextLengthError) and kept[1].tolist() == [300]
