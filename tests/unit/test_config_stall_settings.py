"""No model config brings back a dynamic-batching setting that stalls tritonserver 2.51.

With ``priority_levels`` > 0, or a queue policy that has a timeout, allows the request's
timeout to override it, or bounds the queue, Triton core (r24.10) builds a priority queue
that cannot prefetch (``PriorityQueue::PriorityQueue`` in src/scheduler_utils.cc sets
``support_prefetching_ = false``). ``DynamicBatchScheduler::Enqueue`` then wakes the batcher
thread only while a model instance is idle, and nothing wakes it when an instance becomes
idle, so under concurrent load a queued request waits out the batcher's default wait,
``default_wait_microseconds = 500 * 1000`` in ``DynamicBatchScheduler::BatcherThread``
(src/dynamic_batch_scheduler.cc): P99 of about 500 ms at 4 connections (docs/performance.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

text_format = pytest.importorskip("google.protobuf.text_format")
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "model_repository"
WHY = (
    "stalls tritonserver 2.51's dynamic batcher: with priority levels or a queue policy the batcher "
    "cannot prefetch and a queued request waits out its 500 ms default wait "
    "(core src/dynamic_batch_scheduler.cc BatcherThread, src/scheduler_utils.cc PriorityQueue; "
    'docs/performance.md "The 500 ms stalls")'
)


def stall_settings(config) -> list[str]:
    """The settings of a parsed ``ModelConfig`` known to stall the 2.51 dynamic batcher."""
    if not config.HasField("dynamic_batching"):
        return []
    db = config.dynamic_batching
    found = []
    if db.priority_levels:
        found.append(f"priority_levels: {db.priority_levels}")
    if db.default_priority_level:
        found.append(f"default_priority_level: {db.default_priority_level} (only meaningful with priority_levels)")
    if len(db.priority_queue_policy):
        found.append("priority_queue_policy")
    if db.HasField("default_queue_policy"):
        q = db.default_queue_policy
        if q.allow_timeout_override:
            found.append("default_queue_policy.allow_timeout_override: true")
        if q.default_timeout_microseconds:
            found.append(f"default_queue_policy.default_timeout_microseconds: {q.default_timeout_microseconds}")
        if q.max_queue_size:
            found.append(f"default_queue_policy.max_queue_size: {q.max_queue_size}")
    return found


def parse(text: str):
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def config_files() -> list[Path]:
    # The generated variant configs (configs/*.pbtxt, from `python -m export`) too, when present.
    return sorted(REPOSITORY.glob("*/config.pbtxt")) + sorted(REPOSITORY.glob("*/configs/*.pbtxt"))


def test_the_lint_catches_each_stalling_setting():
    # The check itself must be able to fail: each known setting alone is reported.
    base = 'name: "m" backend: "python" max_batch_size: 8 dynamic_batching { %s }'
    for body in (
        "priority_levels: 2 default_priority_level: 2",
        "default_queue_policy { timeout_action: REJECT allow_timeout_override: true }",
        "default_queue_policy { default_timeout_microseconds: 1000 }",
        "default_queue_policy { max_queue_size: 16 }",
        "priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 1 value: { max_queue_size: 4 } }",
    ):
        assert stall_settings(parse(base % body)), body
    # A plain batcher (delay, preferred sizes) and a policy that changes nothing are fine.
    assert stall_settings(parse(base % "max_queue_delay_microseconds: 100 preferred_batch_size: [4]")) == []
    assert stall_settings(parse(base % "default_queue_policy { timeout_action: REJECT }")) == []
    assert stall_settings(parse('name: "e" platform: "ensemble" max_batch_size: 8')) == []


@pytest.mark.parametrize("path", config_files(), ids=lambda p: str(p.relative_to(REPOSITORY)))
def test_no_config_sets_a_stalling_batcher_setting(path: Path):
    found = stall_settings(parse(path.read_text()))
    assert not found, f"{path.relative_to(ROOT)}: {', '.join(found)}: {WHY}"


def test_generated_variants_inherit_no_stalling_setting():
    # Variant configs are rendered from config.pbtxt (export/variants.py); check the rendering
    # even where `python -m export` has not run.
    from export import variants

    for model in ("text_encoder", "image_classifier"):
        base = (REPOSITORY / model / "config.pbtxt").read_text()
        for name, variant in variants.VARIANTS.items():
            if name == "trt_plan" and 'backend: "onnxruntime"' not in base:
                continue
            found = stall_settings(parse(variants.variant_config(base, variant)))
            assert not found, f"{model} variant {name}: {', '.join(found)}: {WHY}"
