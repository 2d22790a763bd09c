"""text_generation served by a real tritonserver behind the front door, spoken to with plain
tritonclient gRPC streams and raw HTTP (generate, generate_stream SSE).

Covered: one streamed response per piece with the final flag on the last, streams that
concatenate to the whole answer over gRPC and HTTP, SSE events that really arrive one by one,
the chat-template answer, token-for-token parity with transformers' generate() on the same
weights, concurrent streams equal to the same requests run alone, cancellation (gRPC cancel,
HTTP disconnect) that frees the KV blocks at once, per-request errors naming the field while a
good stream runs on, hostile requests answered with 4xx, no leak of KV blocks or stub memory
after many random requests, the llm_* metrics, and UNAVAILABLE when the waiting queue is full.

The server is the session's, which loads text_generation with the default models (a server of
its own would take 12-16 s more to load on 2 idle cores, and 2.2 GB); the queue-full test starts
one with a small queue.
TEXT_GENERATION_LEAK_REQUESTS sets the size of the leak run (60 by default).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import queue
import random
import re
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from server.layout import ROOT
from tests.metrics_text import metric_sum
from tests.metrics_text import scrape as scrape_url

MODEL = "text_generation"
REPOSITORY = ROOT / "model_repository"
VERSION_DIR = REPOSITORY / MODEL / "1"
QUESTION = json.dumps([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
PROMPT = "Here is a short list of three fruits and their colours:"
GREEDY = {"temperature": 0, "max_tokens": 24}
LEAK_REQUESTS = int(os.environ.get("TEXT_GENERATION_LEAK_REQUESTS", "60"))
# Growth of the python stub's RSS allowed between the leak run's warm-up round and its end.
# The KV pool is preallocated and touched at load, the attention workspaces grow to the
# largest batch during warm-up; what remains is allocator noise (measured: a few MB). A leak
# of one step's logits (49,152 floats, 192 KiB) per step of a 60-request run is ~280 MB.
RSS_GROWTH_BOUND = 48 * 2**20
WORDS = [
    "river",
    "stone",
    "light",
    "garden",
    "window",
    "music",
    "paper",
    "cloud",
    "silver",
    "orange",
    "morning",
    "quiet",
    "engine",
    "market",
    "winter",
    "yellow",
    "forest",
    "ladder",
    "pocket",
    "bridge",
    "candle",
    "mirror",
    "letter",
]


_PARAMETER = r'(key:\s*"{}"\s*value:\s*\{{\s*string_value:\s*")([^"]*)"'


def _param(name: str) -> str:
    text = (REPOSITORY / MODEL / "config.pbtxt").read_text(encoding="utf-8")
    m = re.search(_PARAMETER.format(re.escape(name)), text)
    assert m, f"config.pbtxt has no parameter {name}"
    return m.group(2)


MAX_TOKENS_LIMIT = int(_param("max_tokens_limit"))
MAX_MODEL_LEN = int(_param("max_model_len"))


@pytest.fixture(scope="module")
def server(triton):
    if not (VERSION_DIR / "model.safetensors").exists():
        pytest.skip("text_generation is not exported (python -m export.generation)")
    assert MODEL in triton.options.models, triton.options.models
    return triton


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(VERSION_DIR))


# ---- gRPC ----------------------------------------------------------------------------------
def grpc_inputs(text, *, stream: bool | None = True, sampling: dict | str | None = None, **flags):
    """The model's inputs: text_input, stream, sampling_parameters (a dict is dumped to JSON)
    and BOOL flags (exclude_input_in_output=True, ...)."""
    raw = text if isinstance(text, bytes) else text.encode("utf-8")
    tensors = [grpcclient.InferInput("text_input", [1], "BYTES")]
    tensors[0].set_data_from_numpy(np.array([raw], dtype=object))
    if stream is not None:
        flags = {"stream": stream, **flags}
    if sampling is not None:
        body = sampling if isinstance(sampling, str) else json.dumps(sampling)
        t = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        t.set_data_from_numpy(np.array([body.encode("utf-8")], dtype=object))
        tensors.append(t)
    for name, value in flags.items():
        t = grpcclient.InferInput(name, [1], "BOOL")
        t.set_data_from_numpy(np.array([value], dtype=bool))
        tensors.append(t)
    return tensors


@dataclass
class Streamed:
    pieces: list[str] = field(default_factory=list)
    finals: list[bool] = field(default_factory=list)  # triton_final_response of each response
    times: list[float] = field(default_factory=list)  # arrival of each response (monotonic)
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    error: Exception | None = None
    cancelled: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _first(result, name):
    array = result.as_numpy(name)
    if array is None:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else int(value)


def grpc_generate(
    server,
    inputs,
    *,
    cancel_after: int | None = None,
    cancel_when=None,
    on_piece=None,
    timeout: float = 120.0,
    request_id: str = "r",
) -> Streamed:
    """One request over a fresh gRPC stream; every response until the final one (or an error).
    stop_stream(cancel_requests=True) once ``cancel_after`` pieces arrived or ``cancel_when(out)``."""
    out = Streamed()
    done = False  # the request got its final response or its error: nothing left to cancel
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error, time.monotonic())))
        client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        while True:
            result, error, at = responses.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                out.error = error
                done = True
                break
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            text = _first(result, "text_output")
            out.times.append(at)
            out.finals.append(final)
            if text is not None:
                out.pieces.append(text)
                if on_piece is not None:
                    on_piece(out)
            for name in ("finish_reason", "num_input_tokens", "num_output_tokens"):
                value = _first(result, name)
                if value is not None:
                    setattr(out, name, value)
            if final:
                done = True
                break
            if (cancel_after is not None and len(out.pieces) >= cancel_after) or (cancel_when is not None and cancel_when(out)):
                client.stop_stream(cancel_requests=True)
                out.cancelled = True
                break
    finally:
        # Cancelling a stream whose request tritonserver 2.51 itself refused (shape, datatype)
        # leaves the model "live" at shutdown: the server then waits out --exit-timeout-secs.
        client.stop_stream(cancel_requests=not done)
        client.close()
    return out


def generate_text(server, text, sampling=GREEDY, **flags) -> Streamed:
    """A whole (non-streamed) answer over gRPC; asserts it came in one final response."""
    r = grpc_generate(server, grpc_inputs(text, stream=False, sampling=sampling, **flags))
    assert r.error is None, f"request failed: {r.error}"
    assert r.finals == [True], f"a non-streamed request got {len(r.finals)} responses"
    return r


def grpc_error(server, inputs) -> str:
    r = grpc_generate(server, inputs, timeout=60)
    assert r.error is not None, f"accepted; answered {r.text!r}"
    return r.error.message()


# ---- HTTP ----------------------------------------------------------------------------------
def http_post(server, path: str, body, timeout: float = 120.0, content_type: str = "application/json") -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(
        f"http://{server.http_url}{path}", data=data, method="POST", headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def http_generate(server, body) -> tuple[int, dict | str]:
    return http_post(server, f"/v2/models/{MODEL}/generate", body)


def sse_events(server, body: dict, timeout: float = 120.0) -> tuple[int, list[tuple[float, dict]]]:
    """POST generate_stream through the front door; (status, [(arrival, event JSON)])."""
    conn = http.client.HTTPConnection(*server.http_url.rsplit(":", 1), timeout=timeout)
    try:
        conn.request(
            "POST", f"/v2/models/{MODEL}/generate_stream", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        events = []
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                events.append((time.monotonic(), json.loads(line[5:])))
        return resp.status, events
    finally:
        conn.close()


def ready(server) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{MODEL}/ready", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


# ---- metrics -------------------------------------------------------------------------------
def scrape(server) -> str:
    return scrape_url(server.metrics_url)


def metric(body: str, name: str, **labels) -> float:
    """The sum of ``name``'s series on this model whose labels include ``labels`` (one must exist)."""
    return metric_sum(body, name, series=True, model=MODEL, **labels)


def wait_for(server, check, timeout: float = 10.0, interval: float = 0.1):
    """Poll the metrics until ``check(body)`` is true; returns the last body (the caller asserts)."""
    deadline = time.monotonic() + timeout
    body = scrape(server)
    while not check(body) and time.monotonic() < deadline:
        time.sleep(interval)
        body = scrape(server)
    return body


def idle(body: str) -> bool:
    return (
        metric(body, "llm_num_requests_running") == 0
        and metric(body, "llm_num_requests_waiting") == 0
        and metric(body, "llm_kv_cache_blocks_used") == 0
    )


@pytest.fixture(scope="module")
def reference(server):
    """The greedy answer to PROMPT, whole, over gRPC: what every streamed path must equal."""
    r = generate_text(server, PROMPT, exclude_input_in_output=True, return_finish_reason=True, return_num_output_tokens=True)
    assert r.text.strip() and r.num_output_tokens > 4, f"a poor answer: {r.text!r}"
    return r


# ---- 1. streaming --------------------------------------------------------------------------
def test_grpc_stream_sends_one_response_per_piece_and_the_final_flag_last(server, reference):
    r = grpc_generate(server, grpc_inputs(PROMPT, sampling=GREEDY, return_finish_reason=True, return_num_output_tokens=True))
    assert r.error is None, r.error
    assert len(r.pieces) == len(r.finals) > 1, "the answer came in one response: not streamed"
    assert r.finals[-1] is True and not any(r.finals[:-1]), f"final flags {r.finals}"
    assert all(r.pieces[:-1]), f"an empty piece before the last: {r.pieces}"
    # Pieces are whole tokens or a few (a UTF-8 character split over tokens waits): never more
    # responses than tokens.
    assert len(r.pieces) <= r.num_output_tokens == reference.num_output_tokens
    assert r.text == reference.text, "the stream does not concatenate to the whole answer"
    assert r.finish_reason == reference.finish_reason
    # Only the whole, non-streamed answer carries the prompt in front (the vLLM backend's default).
    whole = generate_text(server, PROMPT)
    assert whole.text == PROMPT + reference.text


def test_http_generate_and_sse_give_the_same_text_and_sse_is_incremental(server, reference):
    status, body = http_generate(server, {"text_input": PROMPT, "exclude_input_in_output": True, "parameters": GREEDY})
    assert status == 200, body
    assert body["text_output"] == reference.text

    status, events = sse_events(server, {"text_input": PROMPT, "stream": True, "parameters": GREEDY})
    assert status == 200 and events, events
    assert "".join(e["text_output"] for _, e in events) == reference.text

    # 64 tokens: about 4 s on these cores; the first event must come long before the last.
    long = {"temperature": 0, "max_tokens": 64, "ignore_eos": True}
    start = time.monotonic()
    status, events = sse_events(
        server, {"text_input": PROMPT, "stream": True, "parameters": long, "return_num_output_tokens": True}
    )
    assert status == 200 and len(events) > 32, f"{len(events)} events"
    first, last = events[0][0] - start, events[-1][0] - start
    assert first < 0.25 * last, f"first event at {first:.2f} s, last at {last:.2f} s: buffered, not streamed"
    assert events[-1][1]["num_output_tokens"] == 64
    assert sorted(t for t, _ in events) == [t for t, _ in events]
    whole = grpc_generate(server, grpc_inputs(PROMPT, stream=False, sampling=long, exclude_input_in_output=True))
    assert whole.error is None and "".join(e["text_output"] for _, e in events) == whole.text


def test_chat_template_answer_is_paris(server):
    r = generate_text(
        server,
        QUESTION,
        sampling={"temperature": 0, "max_tokens": 24},
        apply_chat_template=True,
        exclude_input_in_output=True,
        return_finish_reason=True,
    )
    assert r.text == "The capital of France is Paris."
    assert r.finish_reason == "stop"
    status, body = http_generate(
        server,
        {"text_input": QUESTION, "apply_chat_template": True, "exclude_input_in_output": True, "parameters": {"temperature": 0}},
    )
    assert status == 200, body
    assert body["text_output"] == "The capital of France is Paris."


# ---- 2. parity and batching ----------------------------------------------------------------
PARITY_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "La tour Eiffel est un monument de Paris. Elle a été construite",
    None,  # the chat question, rendered with the model's own template
]


def test_served_text_equals_transformers_generate(server, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(VERSION_DIR), dtype=torch.float32)
    model.eval()
    for prompt in PARITY_PROMPTS:
        chat = prompt is None
        text = tokenizer.apply_chat_template(json.loads(QUESTION), tokenize=False, add_generation_prompt=True) if chat else prompt
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
        new = out[0, ids.shape[1] :].tolist()
        expected = tokenizer.decode(new, skip_special_tokens=True)
        served = generate_text(
            server,
            QUESTION if chat else prompt,
            apply_chat_template=chat,
            exclude_input_in_output=True,
            return_num_input_tokens=True,
            return_num_output_tokens=True,
        )
        assert served.text == expected, f"prompt {text[:40]!r}: served {served.text!r}, transformers {expected!r}"
        assert (served.num_input_tokens, served.num_output_tokens) == (ids.shape[1], len(new))


def test_logprobs_through_triton_are_transformers_and_spell_the_text(server, tokenizer):
    """The sampling field logprobs (or the return_logprobs flag) adds the output logprobs: OpenAI's
    token objects, whose tokens spell the text of their response (stream and whole alike) and
    whose chosen log-probabilities are transformers' own on the same weights."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(VERSION_DIR), dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref_lp = [torch.log_softmax(step[0].float(), -1) for step in ref.logits]
    params = {"temperature": 0, "max_tokens": 16, "logprobs": 3}
    status, body = http_generate(server, {"text_input": PROMPT, "exclude_input_in_output": True, "parameters": params})
    assert status == 200, body
    entries = json.loads(body["logprobs"])
    new = ref.sequences[0, ids.shape[1] :].tolist()
    assert len(entries) == len(new) and "".join(e["token"] for e in entries) == body["text_output"]
    worst = max(abs(e["logprob"] - ref_lp[j][new[j]].item()) for j, e in enumerate(entries))
    assert worst < 1e-3, worst
    for e in entries:
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
        assert sum(math.exp(t["logprob"]) for t in e["top_logprobs"]) <= 1.0 + 1e-6
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
    status, events = sse_events(server, {"text_input": PROMPT, "stream": True, "parameters": params})
    assert status == 200 and len(events) > 4
    for _, event in events:  # each event's tokens are its own text
        assert "".join(e["token"] for e in json.loads(event["logprobs"])) == event["text_output"]
    streamed = [e for _, event in events for e in json.loads(event["logprobs"])]
    assert [(e["token"], e["logprob"]) for e in streamed] == [(e["token"], e["logprob"]) for e in entries]
    status, flag = http_generate(
        server, {"text_input": PROMPT, "return_logprobs": True, "parameters": {"temperature": 0, "max_tokens": 4}}
    )
    assert status == 200, flag
    assert [e["top_logprobs"] for e in json.loads(flag["logprobs"])] == [[]] * 4  # the flag alone: no alternatives
    status, plain = http_generate(server, {"text_input": PROMPT, "parameters": {"temperature": 0, "max_tokens": 4}})
    assert status == 200 and "logprobs" not in plain


def test_guides_through_triton_are_enforced_and_bad_ones_are_400_naming_the_field(server):
    """vLLM's guided_* sampling fields, as Triton's vLLM backend takes them: enforced by the
    engine; a guide that does not compile is one INVALID_ARG naming its field."""
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}}, "required": ["capital"]}
    status, body = http_generate(
        server,
        {
            "text_input": QUESTION,
            "apply_chat_template": True,
            "exclude_input_in_output": True,
            "parameters": {"temperature": 0, "max_tokens": 40, "guided_json": json.dumps(schema)},
        },
    )
    assert status == 200, body
    assert isinstance(json.loads(body["text_output"])["capital"], str)
    choice = generate_text(
        server,
        QUESTION,
        sampling={"max_tokens": 8, "guided_choice": ["Paris", "Rome"]},
        apply_chat_template=True,
        exclude_input_in_output=True,
    )
    assert choice.text in ("Paris", "Rome")
    for name, value in (("guided_regex", "a(b"), ("guided_grammar", "start: nothing_here"), ("guided_json", "{")):
        status, body = http_generate(server, {"text_input": "hi", "parameters": {name: value}})
        assert status == 400 and name in body["error"], body


QUOTE = (
    "Copy this code exactly:\n\ndef area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)


DRAFTED, ACCEPTED = "llm_spec_decode_num_draft_tokens_total", "llm_spec_decode_num_accepted_tokens_total"


def test_prompt_lookup_drafts_stream_the_same_text_in_fewer_pieces(server, tokenizer):
    """config.pbtxt turns prompt-lookup drafts on: a lone greedy stream that quotes its prompt
    gets several tokens in some pieces, the text is transformers' generate() (FP32), and the
    metrics port counts the drafts."""
    import torch
    from transformers import AutoModelForCausalLM

    assert int(_param("num_speculative_tokens")) > 0 and int(_param("speculative_max_seqs")) >= 1
    before = wait_for(server, idle)
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUOTE}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(str(VERSION_DIR), dtype=torch.float32).eval()
    with torch.no_grad():
        new = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )[0, ids.shape[1] :].tolist()
    streamed = grpc_generate(
        server,
        grpc_inputs(
            text, sampling={"temperature": 0, "max_tokens": 48}, exclude_input_in_output=True, return_num_output_tokens=True
        ),
    )
    assert streamed.error is None
    assert "".join(streamed.pieces) == tokenizer.decode(new, skip_special_tokens=True)
    assert streamed.num_output_tokens == len(new)
    assert len([p for p in streamed.pieces if p]) < len(new) * 3 // 4, "drafts accepted: fewer pieces than tokens"

    def counted(body):  # the counters reach the metrics port with the engine's next stats report
        return idle(body) and metric(body, ACCEPTED) > metric(before, ACCEPTED)

    body = wait_for(server, counted)
    drafted = metric(body, DRAFTED) - metric(before, DRAFTED)
    accepted = metric(body, ACCEPTED) - metric(before, ACCEPTED)
    assert drafted >= accepted > len(new) // 4, (drafted, accepted)


def _mixed_requests():
    rng = random.Random(8)
    out = []
    for i in range(8):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 120)))
        out.append((f"Story {i}: {words}. Continue the story:", 8 + 3 * i))
    return out


def test_eight_concurrent_streams_equal_the_same_requests_one_at_a_time(server):
    requests = _mixed_requests()

    def run(i):
        prompt, max_tokens = requests[i]
        return grpc_generate(
            server, grpc_inputs(prompt, sampling={"temperature": 0, "max_tokens": max_tokens}), request_id=f"c{i}"
        )

    alone = [run(i) for i in range(len(requests))]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(run, range(len(requests))))
    for i, (a, t) in enumerate(zip(alone, together)):
        assert a.error is None and t.error is None, (a.error, t.error)
        assert t.text == a.text, f"request {i} (max_tokens {requests[i][1]}): {t.text!r} batched vs {a.text!r} alone"
    assert sum(bool(a.text) for a in alone) == len(requests)
    # They really ran together: at some moment at least half of them were streaming at once.
    spans = [(t.times[0], t.times[-1]) for t in together]
    overlap = max(sum(a <= at <= b for a, b in spans) for at, _ in spans)
    assert overlap >= len(requests) // 2, f"at most {overlap} streams at once"


# ---- 3. cancellation -----------------------------------------------------------------------
LONG = {"temperature": 0, "max_tokens": 1500, "ignore_eos": True}


def test_grpc_cancel_frees_the_kv_blocks_at_once(server):
    before = wait_for(server, idle)
    assert idle(before), "the engine is not idle before the test"
    aborts = metric(before, "llm_request_success_total", finish_reason="abort")
    held = []

    def holding(stream):
        # Cancel once the metrics show this stream holding blocks (a gauge that moves).
        if len(stream.pieces) >= 3:
            held.append(metric(scrape(server), "llm_kv_cache_blocks_used"))
        return bool(held and held[-1] > 0) or len(stream.pieces) >= 100

    r = grpc_generate(server, grpc_inputs("Tell me a very long story about the sea.", sampling=LONG), cancel_when=holding)
    cancelled_at = time.monotonic()
    assert r.cancelled and r.error is None and len(r.pieces) >= 3
    # A generous wait (a busy machine, gauges sent every 0.5 s): "at once" is the token count below.
    after = wait_for(server, lambda b: idle(b) and metric(b, "llm_request_success_total", finish_reason="abort") > aborts)
    took = time.monotonic() - cancelled_at
    assert held[-1] > 0, "the stream's blocks never showed on llm_kv_cache_blocks_used"
    assert metric(after, "llm_kv_cache_blocks_used") == 0, f"blocks still held {took:.1f} s after the cancel"
    assert metric(after, "llm_num_requests_running") == 0
    assert metric(after, "llm_request_success_total", finish_reason="abort") == aborts + 1
    assert metric(after, "llm_generation_tokens_total") < metric(before, "llm_generation_tokens_total") + 200


def test_n_choices_over_grpc_one_response_per_choice_one_prefill_and_a_cancel_frees_them_all(server):
    """sampling_parameters n = 3: each response says its choice (output index); whole answers
    come one per choice, the final flag on the last; the prompt is computed once (metrics);
    cancelling the stream frees every choice's blocks."""
    prompt = f"List some animals. ({time.time_ns()})"  # never seen: no prefix-cache hit
    before = wait_for(server, idle)
    computed = metric(before, "llm_prompt_tokens_computed_total")
    forked = metric(before, "llm_sequences_forked_total")
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        sampling = {**GREEDY, "n": 3}
        client.async_stream_infer(
            MODEL,
            grpc_inputs(prompt, stream=False, sampling=sampling, exclude_input_in_output=True, return_num_input_tokens=True),
            request_id="n3",
            enable_empty_final_response=True,
        )
        got = []
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.as_numpy("text_output") is not None:
                got.append((_first(result, "index"), _first(result, "text_output"), _first(result, "num_input_tokens")))
            if final:
                break
    finally:
        client.stop_stream()
        client.close()
    assert sorted(i for i, _, _ in got) == [0, 1, 2]
    after = wait_for(server, idle)
    assert metric(after, "llm_prompt_tokens_computed_total") - computed == got[0][2]  # the prompt, once
    assert metric(after, "llm_sequences_forked_total") - forked == 2
    alone = generate_text(server, prompt, exclude_input_in_output=True).text
    assert {text for _, text, _ in got} == {alone}  # greedy: every choice is the one-choice answer

    aborts = metric(after, "llm_request_success_total", finish_reason="abort")
    r = grpc_generate(server, grpc_inputs("Tell me a very long story about the sea.", sampling={**LONG, "n": 3}), cancel_after=9)
    assert r.cancelled and r.error is None
    # The idle gauges have shown on the metrics port before this request's abort was counted:
    # wait for both, so its abort is counted here and not in the next test's window.
    after = wait_for(server, lambda b: idle(b) and metric(b, "llm_request_success_total", finish_reason="abort") > aborts)
    assert idle(after) and metric(after, "llm_kv_cache_blocks_used") == 0
    assert metric(after, "llm_request_success_total", finish_reason="abort") == aborts + 1  # the request's, once for n choices


def test_http_sse_disconnect_frees_the_kv_blocks_at_once(server):
    """tritonserver 2.51 cancels an HTTP request whose connection closes before it completes
    (src/http_server.cc: InferRequestClass::RequestFiniHook calls
    TRITONSERVER_InferenceRequestCancel), and nginx closes its upstream connection when the
    client goes: so a client leaving generate_stream frees its blocks within a step."""
    before = wait_for(server, idle)
    aborts = metric(before, "llm_request_success_total", finish_reason="abort")
    body = json.dumps(
        {"text_input": "Tell me a very long story about the mountains.", "stream": True, "parameters": LONG}
    ).encode()
    host, port = server.http_url.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        b"POST /v2/models/%s/generate_stream HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (MODEL.encode(), host.encode(), len(body)) + body
    )
    got = b""
    while got.count(b"data:") < 5:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended early: {got[-300:]!r}"
        got += chunk
    assert b" 200 OK" in got.split(b"\r\n", 1)[0]
    assert metric(wait_for(server, lambda b: metric(b, "llm_kv_cache_blocks_used") > 0), "llm_kv_cache_blocks_used") > 0
    sock.close()
    closed_at = time.monotonic()
    after = wait_for(server, lambda b: idle(b) and metric(b, "llm_request_success_total", finish_reason="abort") > aborts)
    took = time.monotonic() - closed_at
    assert metric(after, "llm_kv_cache_blocks_used") == 0, f"blocks still held {took:.1f} s after the disconnect"
    assert metric(after, "llm_request_success_total", finish_reason="abort") == aborts + 1


# ---- 4. bad input --------------------------------------------------------------------------
def _context_prompt():
    return "word " * (MAX_MODEL_LEN - MAX_TOKENS_LIMIT + 200)


# name -> (text_input, sampling_parameters, BOOL flags, the field the message must name)
BAD = {
    "empty_prompt": ("", None, {}, "text_input"),
    "whitespace_prompt": (" \n\t ", None, {}, "text_input"),
    "non_utf8": (b"caf\xe9 au lait", None, {}, "text_input"),
    "malformed_json": ("Hello", '{"max_tokens": 4,', {}, "sampling_parameters"),
    "unknown_parameter": ("Hello", {"max_tokenz": 4}, {}, "max_tokenz"),
    "max_tokens_0": ("Hello", {"max_tokens": 0}, {}, "max_tokens"),
    "max_tokens_over_limit": ("Hello", {"max_tokens": MAX_TOKENS_LIMIT + 1}, {}, "max_tokens"),
    "negative_temperature": ("Hello", {"temperature": -0.5}, {}, "temperature"),
    "top_p_0": ("Hello", {"top_p": 0}, {}, "top_p"),
    "top_p_1.5": ("Hello", {"top_p": 1.5}, {}, "top_p"),
    "top_k_negative": ("Hello", {"top_k": -1}, {}, "top_k"),
    "17_stop_strings": ("Hello", {"stop": [f"s{i}" for i in range(17)]}, {}, "stop"),
    "beyond_max_model_len": (None, {"max_tokens": MAX_TOKENS_LIMIT}, {}, "max_tokens"),
    "chat_template_not_json": ("What is 2 + 2?", None, {"apply_chat_template": True}, "text_input"),
}


def _bad_case(name):
    text, sampling, flags, field_name = BAD[name]
    return (_context_prompt() if text is None else text), sampling, flags, field_name


def _check_context_message(message: str, tokenizer):
    n_prompt = len(tokenizer.encode(_context_prompt(), add_special_tokens=False))
    for number in (n_prompt, MAX_TOKENS_LIMIT, MAX_MODEL_LEN):
        assert str(number) in message, f"{number} not named in {message!r}"


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_over_grpc_is_one_error_naming_the_field(server, tokenizer, case):
    text, sampling, flags, field_name = _bad_case(case)
    message = grpc_error(server, grpc_inputs(text, sampling=sampling, **flags))
    # The stream protocol carries only the message (ModelStreamInferResponse.error_message), not
    # the code; the message says which field, and an internal error would say so.
    assert field_name in message and "internal error" not in message, message
    if case == "beyond_max_model_len":
        _check_context_message(message, tokenizer)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_over_http_generate_is_a_400_naming_the_field(server, tokenizer, case):
    text, sampling, flags, field_name = _bad_case(case)
    body = {"text_input": text.decode("latin-1") if isinstance(text, bytes) else text, **flags}
    if isinstance(sampling, str):
        body["sampling_parameters"] = sampling
    elif sampling is not None:
        body["parameters"] = sampling
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8")
    if isinstance(text, bytes):  # the raw, non-UTF-8 bytes in the JSON body
        raw = raw.replace(text.decode("latin-1").encode("utf-8"), text)
    status, answer = http_generate(server, raw)
    assert status == 400, (status, answer)
    assert field_name in answer["error"], answer
    if case == "beyond_max_model_len":
        _check_context_message(answer["error"], tokenizer)


def test_bad_requests_do_not_disturb_a_running_stream(server, reference):
    result: dict = {}
    good = threading.Thread(
        target=lambda: result.update(r=grpc_generate(server, grpc_inputs(PROMPT, sampling=GREEDY), request_id="good"))
    )
    good.start()
    errors = {}
    for case in BAD:
        text, sampling, flags, _ = _bad_case(case)
        errors[case] = grpc_error(server, grpc_inputs(text, sampling=sampling, **flags))
        status, _ = http_generate(server, {"text_input": "Hello", "parameters": {"top_k": -1}})
        assert status == 400
    good.join(120)
    r = result["r"]
    assert r.error is None and r.finals[-1], r.error
    assert r.text == reference.text, "the good stream's answer changed while bad requests were refused"
    assert len(errors) == len(BAD)


def _raw_infer(server, shape, data) -> tuple[int, dict | str]:
    body = {"inputs": [{"name": "text_input", "shape": shape, "datatype": "BYTES", "data": data}]}
    return http_post(server, f"/v2/models/{MODEL}/infer", body)


def test_hostile_requests_get_4xx_and_the_server_stays_ready(server, reference):
    statuses = {}
    # 10 MB of text: under the front door's body limit, over the model's max_text_bytes.
    big = json.dumps({"text_input": "a" * (10 * 2**20)}).encode()
    statuses["10MB text_input"], answer = http_generate(server, big)
    assert "text_input" in str(answer)
    # curl -d's default type: tritonserver 2.51 itself segfaults parsing such a body as a form
    # (any path); the front door passes it on as JSON.
    for path in (f"/v2/models/{MODEL}/generate", "/v2/health/ready"):
        statuses[f"10MB form {path}"], answer = http_post(server, path, big, content_type="application/x-www-form-urlencoded")
        assert ready(server), f"a form-typed 10 MB body to {path} took the server down"
    # /infer does not serve a decoupled model: the front door says where to go, whatever the shape.
    statuses["infer shape [2]"], answer = _raw_infer(server, [2], ["a", "b"])
    assert "decoupled" in str(answer) and "generate_stream" in str(answer)
    statuses["infer shape [1e9]"], answer = _raw_infer(server, [1000000000], ["a"])
    assert "decoupled" in str(answer) and "generate_stream" in str(answer)
    statuses["generate two texts"], _ = http_generate(server, {"text_input": ["a", "b"]})
    for case, status in statuses.items():
        assert 400 <= status < 500, f"{case}: {status}"
    for shape in ([2], [1000000000]):
        inputs = grpc_inputs(PROMPT, sampling=GREEDY)
        inputs[0].set_shape(shape)  # the declared shape lies; one string is sent
        message = grpc_error(server, inputs)
        assert "text_input" in message and "shape" in message, message
    stream = grpcclient.InferInput("stream", [1], "INT32")
    stream.set_data_from_numpy(np.array([1], dtype=np.int32))
    message = grpc_error(server, grpc_inputs(PROMPT, stream=None) + [stream])
    assert "stream" in message and "BOOL" in message, message
    assert ready(server)
    assert generate_text(server, PROMPT, exclude_input_in_output=True).text == reference.text


@pytest.mark.parametrize(
    "body, words",
    [
        # tritonserver 2.51 answers each of these with 500; the front door's generate check refuses them.
        ({"text_input": "Hello", "stream": "yes"}, 'stream: element "yes" is not a valid BOOL value'),
        ({"text_input": 5}, "text_input: element 5 is not a valid BYTES value"),
        ({"text_input": "Hi", "parameters": {"stop": ["a"]}}, "parameters.stop must be a string"),
        # ... and this one with an error under HTTP status 200.
        ({"text_input": "Hi", "stream": True}, "send it to .../generate_stream"),
    ],
)
def test_generate_bodies_tritonserver_would_500_are_a_400_naming_the_field(server, body, words):
    status, answer = http_generate(server, body)
    assert ready(server)
    assert status == 400, (status, answer)
    assert words in (answer if isinstance(answer, str) else str(answer.get("error"))), answer


def test_unpaired_surrogate_escape_is_a_400_and_a_pair_is_fine(server):
    for text, expected in (('"\\ud800 hi"', 400), ('"\\ud83d\\ude00 hi"', 200)):
        raw = ('{"text_input": ' + text + ', "parameters": {"max_tokens": 2, "temperature": 0}}').encode()
        conn = http.client.HTTPConnection(*server.http_url.rsplit(":", 1), timeout=60)
        try:
            conn.request("POST", f"/v2/models/{MODEL}/generate", raw, {"Content-Type": "application/json"})
            status = conn.getresponse().status
        finally:
            conn.close()
        assert status == expected, (text, status)
    assert ready(server)


# ---- 5. no leak ----------------------------------------------------------------------------
def _stub(server):
    import psutil

    def cmdline(p) -> list[str]:
        try:
            return p.cmdline()
        except psutil.Error:  # a zombie (an unloaded model's stub not yet reaped) or gone since the listing
            return []

    stubs = [
        p
        for p in psutil.Process(server.process.pid).children(recursive=True)
        if (args := cmdline(p))[:1] and args[0].endswith("triton_python_backend_stub") and any(f"/{MODEL}/" in a for a in args)
    ]
    assert len(stubs) == 1, f"python stubs of {MODEL}: {stubs}"
    return stubs[0]


def _random_round(server, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 200)))
        cancel = rng.random() < 0.2
        max_tokens = 400 if cancel else rng.randint(1, 32)
        jobs.append((f"{words}\n", max_tokens, rng.randint(1, 4) if cancel else None))

    def run(job):
        prompt, max_tokens, cancel_after = job
        return grpc_generate(
            server,
            grpc_inputs(prompt, sampling={"temperature": 0.8, "top_p": 0.95, "max_tokens": max_tokens, "seed": 7}),
            cancel_after=cancel_after,
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    failed = [r.error for r in results if r.error is not None]
    assert not failed, f"{len(failed)} requests failed, first: {failed[0]}"
    unfinished = [i for i, r in enumerate(results) if not r.cancelled and not (r.finals and r.finals[-1])]
    assert not unfinished, f"requests without a final response: {unfinished}"
    return {"cancelled": sum(r.cancelled for r in results), "requests": n}


def test_no_leak_after_many_random_requests_with_cancellations(server):
    _random_round(server, 12, seed=1)  # warm-up: workspaces and allocator pools reach their size
    assert idle(wait_for(server, idle))
    stub = _stub(server)
    rss_before = stub.memory_info().rss
    before = scrape(server)
    run = _random_round(server, LEAK_REQUESTS, seed=2)
    after = wait_for(
        server,
        lambda b: (
            idle(b)
            and metric(b, "llm_e2e_request_latency_seconds_count") - metric(before, "llm_e2e_request_latency_seconds_count")
            >= LEAK_REQUESTS
        ),
        timeout=10,
    )
    rss_after = stub.memory_info().rss
    growth = rss_after - rss_before
    print(
        f"leak run: {run['requests']} requests, {run['cancelled']} cancelled; stub RSS "
        f"{rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB ({growth / 2**20:+.1f} MiB)"
    )
    assert run["cancelled"] > 0
    assert metric(after, "llm_kv_cache_blocks_used") == 0
    assert metric(after, "llm_num_requests_running") == 0 and metric(after, "llm_num_requests_waiting") == 0
    finished = sum(
        metric(after, "llm_request_success_total", finish_reason=r) - metric(before, "llm_request_success_total", finish_reason=r)
        for r in ("stop", "length", "abort")
    )
    assert finished == LEAK_REQUESTS
    assert growth < RSS_GROWTH_BOUND, f"stub RSS grew {growth / 2**20:.1f} MiB over {LEAK_REQUESTS} requests"
    assert ready(server)


# ---- 6. metrics ----------------------------------------------------------------------------
COUNTERS = (
    "llm_time_to_first_token_seconds_count",
    "llm_e2e_request_latency_seconds_count",
    "llm_time_per_output_token_seconds_count",
    "llm_generation_tokens_total",
    "llm_prompt_tokens_total",
    "llm_prefix_cache_queries_total",
    "llm_prefix_cache_hits_total",
)


def test_metrics_on_the_metrics_port(server):
    before_body = wait_for(server, idle)
    before = {name: metric(before_body, name) for name in COUNTERS}
    # A prefix of ~10 full blocks no earlier request had (the nonce comes first).
    prefix = f"[{uuid.uuid4().hex}] " + "Rules: answer briefly, in English, and stay polite. " * 14
    results = [
        generate_text(
            server,
            prefix + q,
            sampling={"temperature": 0, "max_tokens": n},
            return_num_input_tokens=True,
            return_num_output_tokens=True,
        )
        for q, n in (("What is a river?", 12), ("What is a mountain?", 9))
    ]
    results.append(
        grpc_generate(server, grpc_inputs(PROMPT, sampling=GREEDY, return_num_output_tokens=True, return_num_input_tokens=True))
    )
    n_out = sum(r.num_output_tokens for r in results)
    n_in = sum(r.num_input_tokens for r in results)

    def settled(body):
        return idle(body) and metric(body, "llm_e2e_request_latency_seconds_count") - before[
            "llm_e2e_request_latency_seconds_count"
        ] >= len(results)

    body = wait_for(server, settled)
    delta = {name: metric(body, name) - before[name] for name in COUNTERS}
    assert delta["llm_time_to_first_token_seconds_count"] == len(results)
    assert delta["llm_e2e_request_latency_seconds_count"] == len(results)
    assert delta["llm_generation_tokens_total"] == n_out
    assert delta["llm_prompt_tokens_total"] == n_in
    assert delta["llm_time_per_output_token_seconds_count"] == n_out - len(results)
    assert delta["llm_prefix_cache_queries_total"] >= n_in - results[-1].num_input_tokens
    assert delta["llm_prefix_cache_hits_total"] >= 16 * 8, "the second request did not reuse the shared prefix"
    assert metric(body, "llm_kv_cache_blocks_total") > 0
    assert metric(body, "llm_time_to_first_token_seconds_sum") > 0
    assert metric(body, "llm_time_to_first_token_seconds_bucket", le="+Inf") == metric(
        body, "llm_time_to_first_token_seconds_count"
    )
    # one request at a time: nothing to preempt (a counter always reads >= 0, so the delta is what is checked)
    assert metric(body, "llm_num_preemptions_total") - metric(before_body, "llm_num_preemptions_total") == 0
    print(
        "metrics port excerpt:\n"
        + "\n".join(
            line
            for line in body.splitlines()
            if line.startswith("llm_") and ("_bucket" not in line or 'le="+Inf"' in line or 'le="0.5"' in line)
        )
    )


# ---- 7. queue full -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_queue_server(start_triton):
    """text_generation with max_num_seqs 1 and max_waiting 1 in a temporary repository (the
    version folder's files are links to the exported ones)."""
    repo = Path(tempfile.mkdtemp(prefix="textgen-queue-"))
    try:
        (repo / MODEL / "1").mkdir(parents=True)
        for f in VERSION_DIR.iterdir():
            if f.is_file():
                (repo / MODEL / "1" / f.name).symlink_to(f)
        config = (REPOSITORY / MODEL / "config.pbtxt").read_text(encoding="utf-8")
        for key, value in (("max_num_seqs", "1"), ("max_waiting", "1"), ("kv_cache_mb", "32")):
            config, n = re.subn(_PARAMETER.format(key), r"\g<1>" + value + '"', config)
            assert n == 1, key
        (repo / MODEL / "config.pbtxt").write_text(config, encoding="utf-8")
        with start_triton("triton-textgen-queue-", models=(MODEL,), model_repository=repo) as triton:
            yield triton
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def test_queue_full_is_unavailable_naming_max_waiting_and_admitted_requests_finish(small_queue_server):
    server = small_queue_server
    first_piece = threading.Event()
    results: dict = {}
    sampling = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}

    def run(key, **kw):
        results[key] = grpc_generate(server, grpc_inputs(PROMPT, sampling=sampling), request_id=key, **kw)

    running = threading.Thread(target=run, args=("running",), kwargs={"on_piece": lambda s: first_piece.set()})
    running.start()
    assert first_piece.wait(60), "the first request never streamed"
    waiting = threading.Thread(target=run, args=("waiting",))
    waiting.start()
    assert (
        metric(wait_for(server, lambda b: metric(b, "llm_num_requests_waiting") >= 1, timeout=30), "llm_num_requests_waiting")
        >= 1
    )
    refused = grpc_generate(server, grpc_inputs(PROMPT, sampling=sampling), request_id="refused")
    status, answer = http_generate(server, {"text_input": PROMPT, "parameters": sampling})
    running.join(120)
    waiting.join(120)
    from contract.errors import MARK, data_from_body, parse_error

    assert refused.error is not None and "max_waiting" in refused.error.message(), refused
    # The stream error has no status of its own: its data says what it is, the numbers included.
    data = parse_error(refused.error.message())
    assert data is not None and (data.code, data.http_status) == ("overloaded", 503), refused.error.message()
    assert data.values["max_waiting"] == 1
    # tritonserver 2.51's generate endpoint answers every error with 400; the front door gives
    # a decoupled model's whole answer the status of its error's data.
    assert status == 503 and "max_waiting" in answer["error"] and MARK not in answer["error"], (status, answer)
    assert data_from_body(answer).code == "overloaded", answer  # the data as the body's keys
    for key in ("running", "waiting"):
        r = results[key]
        assert r.error is None and r.finals[-1] and len(r.pieces) > 1, (key, r.error)
    assert results["running"].text == results["waiting"].text
