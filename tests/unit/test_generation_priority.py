"""Priority classes in the generation engine: the scheduler admits waiting sequences in class
order (interactive, default, bulk; FIFO within a class), preempts the newest of the lowest class
when the KV pool is short, and caps bulk's places with ``max_running_bulk``; the request field
``priority_class`` is checked by SamplingParams and reaches the scheduler through the engine.

The scheduler runs over the fake model of ``generation_fakes`` (tokens a fixed function of the
context, so a wrong recompute after a preemption changes them); the engine test uses a tiny
random-init checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from contract.errors import InputError
from contract.sampling import SamplingParams
from python_backends.generation.block_manager import BlockManager
from python_backends.generation.sampling import parse_sampling_params
from python_backends.generation.scheduler import Scheduler, SequenceStatus
from tests.unit.generation_fakes import FakeRunner
from tests.unit.test_generation_scheduler import next_token, reference_output

INTERACTIVE, DEFAULT, BULK = 0, 1, 2


def make(num_blocks=64, max_num_seqs=2, max_running_bulk=0):
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    sched = Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        max_waiting=100,
        max_model_len=512,
        max_running_bulk=max_running_bulk,
    )
    return sched, FakeRunner(bm, next_token)


def run(sched, runner, max_steps=1000) -> list:
    """Step to the end; the sequence ids in the order they finished."""
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        out = sched.schedule()
        finished += [s.seq_id for s in sched.update(out, runner.step(sched, out)) if s.is_finished]
        sched.bm.check_invariants()
    raise AssertionError("the scheduler did not finish")


def admitted_order(sched, runner) -> list:
    """Step to the end; the sequence ids in the order they were first admitted."""
    order: list = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [c.seq_id for c in out.prefills if c.seq_id not in order]
        sched.update(out, runner.step(sched, out))
    return order


def test_an_interactive_arrival_is_admitted_before_waiting_bulk_ones():
    sched, runner = make(max_num_seqs=2)
    for i in range(4):
        sched.add(f"bulk{i}", [5, 6, 7, i], max_tokens=6, priority=BULK)
    out = sched.schedule()  # bulk0 and bulk1 take both running places
    sched.update(out, runner.step(sched, out))
    assert [s.seq_id for s in sched.running] == ["bulk0", "bulk1"]
    sched.add("chat", [9, 8, 7], max_tokens=3, priority=INTERACTIVE)
    sched.add("plain", [9, 8, 6], max_tokens=3, priority=DEFAULT)
    assert [s.seq_id for s in sched.waiting] == ["chat", "plain", "bulk2", "bulk3"]
    # no preemption for a place: the interactive arrival takes the first place that frees
    sched.abort("bulk1")
    out = sched.schedule()
    assert [c.seq_id for c in out.prefills] == ["chat"] and not out.preempted
    assert [s.seq_id for s in sched.running] == ["chat", "bulk0"]  # (class, admission) order
    finished = run(sched, runner)
    assert finished.index("chat") < finished.index("bulk2") and finished.index("plain") < finished.index("bulk3")


def test_fifo_within_a_class():
    sched, runner = make(max_num_seqs=1)
    for i, cls in enumerate([BULK, DEFAULT, INTERACTIVE, BULK, INTERACTIVE, DEFAULT, INTERACTIVE]):
        sched.add(f"{cls}-{i}", [3, 1, i], max_tokens=2, priority=cls)
    assert admitted_order(sched, runner) == ["0-2", "0-4", "0-6", "1-1", "1-5", "2-0", "2-3"]


def test_under_kv_pressure_the_newest_bulk_sequence_is_preempted_first():
    # 12 blocks of 4 tokens: three sequences of 8 + 12 tokens need 15 at the end
    sched, runner = make(num_blocks=12, max_num_seqs=3)
    prompts = {"bulk-old": [1] * 8, "bulk-new": [2] * 8, "chat": [3] * 8}
    sched.add("bulk-old", prompts["bulk-old"], max_tokens=12, priority=BULK)
    sched.add("bulk-new", prompts["bulk-new"], max_tokens=12, priority=BULK)
    sched.schedule()
    sched.add("chat", prompts["chat"], max_tokens=12, priority=INTERACTIVE)  # admitted last, the newest
    preempted: list = []
    finished = []
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += out.preempted
        finished += [s.seq_id for s in sched.update(out, runner.step(sched, out)) if s.is_finished]
    assert preempted and preempted[0] == "bulk-new" and "chat" not in preempted
    assert finished.index("chat") < finished.index("bulk-new")
    assert sched.num_preemptions == len(preempted)


def test_preempted_tokens_are_recomputed_the_same():
    sched, runner = make(num_blocks=12, max_num_seqs=3)
    seqs = {
        "b1": sched.add("b1", [1] * 8, max_tokens=12, priority=BULK),
        "b2": sched.add("b2", [2] * 8, max_tokens=12, priority=BULK),
        "i": sched.add("i", [3] * 8, max_tokens=12, priority=INTERACTIVE),
    }
    run(sched, runner)
    assert seqs["b2"].num_preemptions > 0 and seqs["i"].num_preemptions == 0
    for seq in seqs.values():
        assert seq.output_tokens == reference_output(seq.prompt_tokens, 12)


def test_max_running_bulk_leaves_places_for_the_other_classes():
    sched, runner = make(max_num_seqs=4, max_running_bulk=2)
    for i in range(4):
        sched.add(f"bulk{i}", [4, 4, i], max_tokens=8, priority=BULK)
    out = sched.schedule()
    sched.update(out, runner.step(sched, out))
    assert [s.seq_id for s in sched.running] == ["bulk0", "bulk1"]
    assert [s.seq_id for s in sched.waiting] == ["bulk2", "bulk3"]
    sched.add("chat", [7, 7], max_tokens=2, priority=INTERACTIVE)
    out = sched.schedule()
    assert [c.seq_id for c in out.prefills] == ["chat"] and not out.preempted
    stats = sched.stats()
    assert (stats["num_requests_running_interactive"], stats["num_requests_running_bulk"]) == (1, 2)
    assert (stats["num_requests_waiting_bulk"], stats["num_requests_waiting_default"]) == (2, 0)
    finished = run(sched, runner)
    assert set(finished) == {"chat", "bulk0", "bulk1", "bulk2", "bulk3"}


def test_an_aborted_waiting_sequence_leaves_its_class_queue():
    sched, _ = make(max_num_seqs=1)
    sched.add("a", [1, 2], max_tokens=2, priority=BULK)
    sched.add("b", [1, 3], max_tokens=2, priority=BULK)
    assert sched.abort("b") and sched.num_waiting == 1
    assert sched.get("a").status is SequenceStatus.WAITING


def test_a_bad_class_is_an_input_error_naming_the_field():
    assert SamplingParams().priority_class == "default"
    for bad in ("urgent", "", "BULK", 2, None):
        with pytest.raises(InputError) as err:
            SamplingParams(priority_class=bad)
        assert err.value.field == "priority_class"
        assert "interactive, default, bulk" in str(err.value)
    with pytest.raises(InputError) as err:
        parse_sampling_params('{"priority_class": "urgent"}', max_tokens_limit=64)
    assert err.value.field == "priority_class"
    assert parse_sampling_params('{"priority_class": "bulk"}', max_tokens_limit=64).priority_class == "bulk"


MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"


@pytest.mark.skipif(
    not (MODEL_DIR / "tokenizer.json").is_file(), reason="text_generation not exported (python -m export.generation)"
)
def test_the_engine_queues_each_request_in_its_class(tmp_path):
    transformers = pytest.importorskip("transformers")
    from python_backends.generation.engine import LLMEngine
    from python_backends.generation.engine_config import EngineConfig
    from tests.unit.tiny_checkpoints import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path, MODEL_DIR, "llama", max_position_embeddings=512)
    engine = LLMEngine(
        EngineConfig(
            model_dir=folder,
            num_blocks=64,
            block_size=16,
            max_num_seqs=2,
            max_num_batched_tokens=128,
            max_model_len=512,
            max_running_bulk=2,
        ),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"bulk{i}", f"a bulk prompt {i}", replace(params, priority_class="bulk"))
    engine.step()
    engine.add_request("chat", "an interactive prompt", replace(params, priority_class="interactive"))
    assert [s.seq_id for s in engine.scheduler.waiting] == ["chat", "bulk2", "bulk3"]
    assert engine.stats()["num_requests_waiting_interactive"] == 1
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished.index("chat") < finished.index("bulk2")
