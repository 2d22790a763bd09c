"""python_backends.generation.entry: the text_generation model without Triton (config at load,
each request to the engine loop, the loop's outputs as response arrays) on the exported
SmolLM2 weights; and its model.py shim driven with a fake pb_utils."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from contract.errors import ConfigError, InputError
from contract.model_config import ModelConfig
from python_backends.generation.entry import GenerationEntry, output_arrays
from python_backends.generation.sampling import SamplingParams
from python_backends.generation.scheduler import QueueFull
from tests.unit.triton_fakes import model_config, tensor

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"
pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(), reason="text_generation is not exported (run `make export`)"
)


def config(**parameters) -> ModelConfig:
    settings = {
        "kv_cache_mb": "16",
        "max_num_seqs": "1",
        "max_waiting": "1",
        "num_threads": "2",
        "sampling_defaults": '{"temperature": 0.2, "top_p": 0.9}',
        **parameters,
    }
    return ModelConfig(
        model_config(
            "text_generation",
            [tensor("text_input", [1], "TYPE_STRING")],
            [tensor("text_output", [-1], "TYPE_STRING")],
            max_batch_size=0,
            parameters=settings,
        )
    )


class Recorder:
    """A Reply that keeps what it was sent."""

    def __init__(self):
        self.sent, self.errors, self.closed, self.done = [], [], False, threading.Event()

    def send(self, arrays, final):
        self.sent.append(arrays)
        if final:
            self.done.set()

    def fail(self, error):
        self.errors.append(error)
        self.done.set()

    def close(self):
        self.closed = True
        self.done.set()

    def is_cancelled(self):
        return False


def inputs(text: str, **flags) -> dict:
    out = {name: None for name in ("text_input", "sampling_parameters")}
    out["text_input"] = np.array([text.encode()], dtype=object)
    for name, value in flags.items():
        out[name] = np.array([value])
    return out


@pytest.fixture(scope="module")
def entry():
    entry = GenerationEntry(config(), MODEL_DIR, decoupled=True)
    yield entry
    entry.close()


def test_a_model_that_is_not_decoupled_fails_the_load():
    with pytest.raises(ConfigError, match="must be decoupled"):
        GenerationEntry(config(), MODEL_DIR, decoupled=False)


def test_requests_stream_through_the_reply_as_the_engine_generates_them(entry):
    want, _ = entry.engine.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    outputs = []
    entry.start(on_output=outputs.append)
    reply = Recorder()
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    entry.submit(inputs("Hello", stream=True, return_finish_reason=True), params, reply)
    assert reply.done.wait(60) and not reply.errors
    text = "".join(a["text_output"][0].decode() for a in reply.sent if "text_output" in a)
    assert text == want
    assert reply.sent[-1]["finish_reason"].tolist() == [b"length"]
    assert outputs and outputs[-1].finished  # the metrics hook heard every output
    with pytest.raises(InputError, match="text_input"):
        entry.submit(inputs("   "), {}, Recorder())
    # One running and one waiting: the next is refused at once, its numbers as data.
    running, waiting = Recorder(), Recorder()
    entry.submit(inputs("Tell me a story."), {"max_tokens": 32, "ignore_eos": True}, running)
    entry.submit(inputs("Hello"), {"max_tokens": 4}, waiting)
    with pytest.raises(QueueFull) as refused:
        entry.submit(inputs("Hello"), {"max_tokens": 4}, Recorder())
    assert (refused.value.code, refused.value.values) == ("overloaded", {"waiting": 1, "max_num_seqs": 1, "max_waiting": 1})
    assert waiting.done.wait(120) and not waiting.errors
    assert running.done.wait(120) and not running.errors


def test_output_arrays_are_one_element_arrays_of_the_configured_types():
    arrays = output_arrays({"text_output": "hé", "finish_reason": None, "num_output_tokens": 3})
    assert arrays["text_output"].tolist() == ["hé".encode()] and arrays["text_output"].dtype == object
    assert arrays["num_output_tokens"].dtype == np.uint32 and "finish_reason" not in arrays


def test_the_sampling_defaults_are_the_models_with_the_operators_on_top(entry):
    # generation_config.json of SmolLM2 sets no sampling; config.pbtxt gives the model card's.
    assert entry.engine.config.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    with pytest.raises(ConfigError, match="sampling_defaults: temperature"):
        GenerationEntry(config(sampling_defaults='{"temperature": -1}'), MODEL_DIR, decoupled=True)


class _PumpReply:
    def __init__(self, fail_on: int | None = None):
        self.sent: list = []
        self.cancelled = False
        self.fail_on = fail_on

    def send(self, arrays, final):
        if self.fail_on is not None and len(self.sent) == self.fail_on:
            raise RuntimeError("the stream is gone")
        self.sent.append((arrays["n"], final))

    def fail(self, error):
        self.sent.append(("failed", str(error)))

    def close(self):
        self.sent.append(("closed", True))

    def is_cancelled(self):
        return self.cancelled


def test_the_reply_pump_sends_in_order_watches_cancellation_and_aborts_a_failed_stream():
    import threading

    from python_backends.generation.entry import ReplyPump

    cancelled: list = []
    seen = threading.Event()

    def on_cancel(request_id):
        cancelled.append(request_id)
        seen.set()

    pump = ReplyPump(on_cancel, poll_s=0.005)
    ordered, watched, broken = _PumpReply(), _PumpReply(), _PumpReply(fail_on=1)
    for rid, reply in ((1, ordered), (2, watched), (3, broken)):
        pump.watch(rid, reply)
    for i in range(200):
        pump.send(1, ordered, {"n": i}, i == 199)
    pump.send(3, broken, {"n": 0}, False)
    pump.send(3, broken, {"n": 1}, False)  # raises: request 3 is aborted, not the pump
    assert seen.wait(5) and cancelled == [3]
    seen.clear()
    watched.cancelled = True  # the client went away: found by the watch, aborted once
    assert seen.wait(5) and cancelled == [3, 2]
    pump.fail(2, watched, ValueError("abort"))
    pump.stop()
    assert ordered.sent == [(i, i == 199) for i in range(200)]
    assert broken.sent == [(0, False)] and watched.sent == [("failed", "abort")]
    assert cancelled == [3, 2]  # request 1 finished: no longer watched


def test_the_reply_pump_bounds_its_cancellation_polls_and_still_finds_every_cancelled_stream():
    """At 16-32 streams, asking each stream every 20 ms was 800-1,600 round trips a second to
    tritonserver; the pump asks at most max_polls_per_s streams a second, in turn."""
    import time

    from python_backends.generation.entry import ReplyPump

    found: list = []
    all_found = threading.Event()
    replies = {rid: _PumpReply() for rid in range(40)}

    def on_cancel(request_id):
        found.append(request_id)
        if len(found) == 3:
            all_found.set()

    with pytest.raises(ValueError, match="max_polls_per_s"):
        ReplyPump(on_cancel, max_polls_per_s=0)
    pump = ReplyPump(on_cancel, poll_s=0.005, max_polls_per_s=400)  # 2 streams a sweep
    assert pump.polls_per_sweep == 2
    started = time.monotonic()
    for rid, reply in replies.items():
        pump.watch(rid, reply)
    for rid in (0, 21, 39):  # the first, one in the middle, the last
        replies[rid].cancelled = True
    try:
        assert all_found.wait(10), found
        elapsed = time.monotonic() - started
        assert sorted(found) == [0, 21, 39]
        # Never more than 2 polls per 5 ms sweep (a slow machine only sweeps less often).
        assert pump.polls <= 2 * (elapsed / 0.005 + 2), (pump.polls, elapsed)
        assert pump.polls >= 37  # every watched stream was asked before the last one was found
    finally:
        pump.stop()
