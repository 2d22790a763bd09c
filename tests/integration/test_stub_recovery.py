"""What dies is brought back (server/stubs.py), and health says so meanwhile.

A python backend stub is SIGKILLed (as the OOM killer does) on the session's server under a
load of plain clients that never retry (http.client keep-alive through the nginx front door,
tritonclient gRPC through the gRPC door). tritonserver 2.51 alone would answer every request
routed to the dead instance 500 "Stub process ... is not healthy" forever, with readiness 200.
Here: no client sees a 500 or INTERNAL (the doors resend an idempotent inference while the
watchdog reloads), readiness answers 503 until the model is reloaded, the instance serves again
within 30 s, and /metrics/watchdog counts the death.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import queue
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from server.stubs import find_stubs
from tests.integration.conftest import GATEWAY_TEST_KEY
from tests.metrics_text import metric_sum, scrape

RECOVERY_S = 30


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def _stubs(triton, model: str) -> list:
    return [s for s in find_stubs(triton.process.pid) if s.model == model and not s.zombie]


class Load:
    """Plain clients without retries on one model through both doors; counts every outcome."""

    def __init__(self, triton, model: str, threads: int = 3):
        self.triton, self.model = triton, model
        self.outcomes: collections.Counter = collections.Counter()
        self.messages: collections.Counter = collections.Counter()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.workers = [threading.Thread(target=self._http, daemon=True) for _ in range(threads)]
        self.workers += [threading.Thread(target=self._grpc, daemon=True) for _ in range(threads)]

    def _count(self, key: str, message: str = "") -> None:
        with self.lock:
            self.outcomes[key] += 1
            if message:
                self.messages[(key, message[:120])] += 1

    def _http(self) -> None:
        host, port = self.triton.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = json.dumps(
            {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": ["a sentence for the load"]}]}
        )
        while not self.stop.is_set():
            try:
                conn.request("POST", f"/v2/models/{self.model}/infer", body)
                response = conn.getresponse()
                data = response.read()
                self._count(f"http {response.status}", "" if response.status == 200 else data.decode(errors="replace"))
            except (OSError, http.client.HTTPException) as exc:
                self._count("http dropped", repr(exc))
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=60)

    def _grpc(self) -> None:
        client = grpcclient.InferenceServerClient(self.triton.grpc_url)
        inp = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[b"another sentence for the load"]], dtype=object))
        while not self.stop.is_set():
            try:
                client.infer(self.model, [inp], client_timeout=60)
                self._count("grpc OK")
            except grpcclient.InferenceServerException as exc:
                self._count(f"grpc {exc.status()}", exc.message() or "")
        client.close()

    def __enter__(self) -> Load:
        for w in self.workers:
            w.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for w in self.workers:
            w.join(timeout=90)


def _kill_and_watch(triton, model: str, entry: str) -> dict:
    """SIGKILL one stub of ``model``; poll readiness of ``entry`` until the model is back."""
    victims = _stubs(triton, model)
    assert victims, f"no live stub of {model}"
    victim = victims[-1]
    base = f"http://{triton.http_url}"
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    seen = collections.Counter()
    recovered = None
    while time.monotonic() - killed < RECOVERY_S + 10:
        ready = _status(f"{base}/v2/models/{entry}/ready")
        server_ready = _status(f"{base}/v2/health/ready")
        seen[(ready, server_ready)] += 1
        marked = any(not name.startswith(".") for name in os.listdir(triton.health_dir))
        back = [s for s in _stubs(triton, model) if s.pid != victim.pid]
        if (
            ready == 200
            and server_ready == 200
            and not marked
            and len(back) >= len(victims)
            and all(s.pid not in {v.pid for v in victims} for s in back)
        ):
            recovered = time.monotonic() - killed
            break
        time.sleep(0.05)
    return {"victim": victim, "recovered_s": recovered, "readiness": seen}


def _watchdog_metric(triton, name: str, model: str) -> float:
    return metric_sum(scrape(triton.metrics_url.rsplit("/metrics", 1)[0] + "/metrics/watchdog"), name, series=True, model=model)


# The BLS entry's stub is killed between requests: SIGKILLed in the middle of a BLS call it
# holds the python backend's interprocess lock, and tritonserver 2.51 itself then aborts
# ("terminate called after throwing an instance of 'boost::interprocess::lock_exception'",
# seen in 2 of 6 runs here): a crash of the whole server that no watchdog inside it can heal
# (docs/security.md, what is not defended).
@pytest.mark.parametrize(
    "model, entry, under_load",
    [("text_encoder", "text_embedding", True), ("text_embedding_cached", "text_embedding_cached", False)],
    ids=["onnxruntime-step", "bls-entry"],
)
def test_a_killed_stub_is_reloaded_under_load_without_a_failed_request(triton, model, entry, under_load):
    deaths_before = _watchdog_metric(triton, "triton_stub_deaths_total", model)
    if not under_load:
        result = _kill_and_watch(triton, model, entry)
    with Load(triton, entry) as load:
        time.sleep(1.5)
        if under_load:
            result = _kill_and_watch(triton, model, entry)
        time.sleep(2.0)  # the replaced instances' requests finished; the new ones serve
    outcomes, messages = load.outcomes, load.messages
    assert result["recovered_s"] is not None and result["recovered_s"] < RECOVERY_S, result
    # Readiness told the truth while the model was being reloaded.
    assert any(ready == 503 and server == 503 for ready, server in result["readiness"]), result["readiness"]
    failed = {k: v for k, v in outcomes.items() if k not in ("http 200", "grpc OK")}
    # Never a 500 or INTERNAL; what a client may see is a clean 503 / UNAVAILABLE, and rarely.
    assert not {k for k in failed if k not in ("http 503", "grpc StatusCode.UNAVAILABLE")}, (failed, messages)
    served = outcomes["http 200"] + outcomes["grpc OK"]
    assert served > 50 and sum(failed.values()) <= 0.02 * served, (outcomes, messages)
    assert _watchdog_metric(triton, "triton_stub_deaths_total", model) == deaths_before + 1
    assert _watchdog_metric(triton, "triton_model_unhealthy", model) == 0
    print(f"\n{model}: recovered in {result['recovered_s']:.1f} s; outcomes {dict(outcomes)}")


def _stream(triton, max_tokens: int, markers: queue.Queue) -> None:
    """One greedy generation over the gRPC door; puts ("started", n) after 3 pieces, then
    ("final", its num_output_tokens) or ("error", exception) on ``markers``."""
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Tell me a long story about the sea."], dtype=object))
    sampling = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(
        np.array([json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()], dtype=object)
    )
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    count = grpcclient.InferInput("return_num_output_tokens", [1], "BOOL")
    count.set_data_from_numpy(np.array([True]))
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("text_generation", [text, sampling, stream, count], enable_empty_final_response=True)
    pieces, tokens = 0, None
    try:
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                markers.put(("error", error))
                return
            pieces += 1
            if result.as_numpy("num_output_tokens") is not None:
                tokens = int(result.as_numpy("num_output_tokens")[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                markers.put(("final", tokens))
                return
            if pieces == 3:
                markers.put(("started", pieces))
    finally:
        client.stop_stream(cancel_requests=False)
        client.close()


def _gateway_stream(url: str, max_tokens: int, markers: queue.Queue) -> None:
    """One chat completion streamed through the OpenAI gateway (server-sent events); puts
    ("started", n) after 3 content chunks, then ("done", completion_tokens) or ("error", the error
    event's body)."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps(
        {
            "model": "text_generation",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    conn.request(
        "POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {GATEWAY_TEST_KEY}", "Content-Type": "application/json"}
    )
    response = conn.getresponse()
    chunks, tokens = 0, None
    try:
        for line in response:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                markers.put(("done", tokens))
                return
            event = json.loads(data)
            if "error" in event:
                markers.put(("error", event["error"]))
                return
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            chunks += 1
            if chunks == 3:
                markers.put(("started", chunks))
        markers.put(("done", tokens))
    finally:
        conn.close()


def _http_stream(triton, max_tokens: int, markers: queue.Queue) -> None:
    """One greedy generation over Triton's HTTP generate_stream through the front door (nginx, then
    the gRPC door's stream listener), asking for the token ids; puts ("started", n) after 3 events,
    then ("done", the model's token count from the last event, the ids received) or ("error", the
    error event's message). A token dropped or sent twice across a continuation shows in the ids."""
    host, port = triton.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {
        "text_input": "Tell me a long story about the mountains.",
        "stream": True,
        "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}),
        "return_num_output_tokens": True,
        "return_token_ids": True,
    }
    conn.request("POST", "/v2/models/text_generation/generate_stream", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    events, tokens, ids = 0, None, []
    try:
        for line in response:
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                markers.put(("error", event["error"]))
                return
            got = event.get("token_ids", [])
            ids += got if isinstance(got, list) else [got]
            tokens = event.get("num_output_tokens", tokens)
            events += 1
            if events == 3:
                markers.put(("started", events))
        markers.put(("done", tokens, len(ids)))
    finally:
        conn.close()


def test_a_killed_generation_stub_loses_no_stream_and_serves_again(triton, start_gateway):
    """The streams in flight when the stub dies go on once the watchdog has reloaded the model:
    the gRPC door (its gRPC port and its HTTP stream listener) and the gateway send each again with the token ids already sent
    (docs/generation.md#streams-that-outlive-a-replica), and each ends with all its tokens."""
    if "text_generation" not in triton.options.models:
        pytest.skip("text_generation is not loaded")
    markers: queue.Queue = queue.Queue()
    worker = threading.Thread(target=_stream, args=(triton, 300, markers), daemon=True)
    worker.start()
    assert markers.get(timeout=120)[0] == "started"
    # one over HTTP generate_stream through the front door (before, it stayed open for nginx's 600 s)
    http_markers: queue.Queue = queue.Queue()
    http_worker = threading.Thread(target=_http_stream, args=(triton, 150, http_markers), daemon=True)
    http_worker.start()
    assert http_markers.get(timeout=120)[0] == "started"
    # and one through the OpenAI gateway, told the watchdog's folder as `make serve` tells it
    with start_gateway(triton.triton_grpc_url, "--rate-limit", "0", "--triton-health-dir", str(triton.health_dir)) as gw:
        sse: queue.Queue = queue.Queue()
        sse_worker = threading.Thread(target=_gateway_stream, args=(gw.url, 150, sse), daemon=True)
        sse_worker.start()
        assert sse.get(timeout=120)[0] == "started"
        result = _kill_and_watch(triton, "text_generation", "text_generation")
        sse_worker.join(timeout=180)
        sse_kind, sse_detail = sse.get(timeout=5)
    worker.join(timeout=180)
    kind, detail = markers.get(timeout=5)
    http_worker.join(timeout=180)
    # the HTTP stream went on too: the stream listener sent it again after the ids it had sent
    assert http_markers.get(timeout=5) == ("done", 150, 150)  # and each token reached the client once
    # the stream in flight through the gRPC door went on after the reload, to its last token
    assert (kind, detail) == ("final", 300), (
        kind,
        getattr(detail, "message", lambda: detail)(),
        getattr(detail, "status", str)(),
    )
    # and so did the gateway's (its own continuation: it talks to tritonserver directly here)
    assert (sse_kind, sse_detail) == ("done", 150), (sse_kind, sse_detail)
    assert result["recovered_s"] is not None and result["recovered_s"] < RECOVERY_S, result
    assert any(ready == 503 for ready, _ in result["readiness"]), result["readiness"]
    # A new stream on the reloaded model (its own, fresh KV pool) runs to its end.
    again: queue.Queue = queue.Queue()
    _stream(triton, 8, again)
    outcomes = [again.get_nowait() for _ in range(again.qsize())]
    assert outcomes[-1][0] == "final", outcomes
    print(f"\ntext_generation: recovered in {result['recovered_s']:.1f} s; the stream ended with {detail}")
