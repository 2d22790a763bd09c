"""The OpenAI gateway against hostile and careless clients, in front of a real tritonserver.

1. auth: every /v1 route answers 401 in OpenAI's error shape without a valid bearer key;
   /health and /metrics need none; keys never reach the log.
2. limits: body size (Content-Length, a lying Content-Length, chunked), inputs, characters,
   prompt, max_tokens, stop; invalid JSON and wrong types are 4xx naming the field, never 5xx.
3. the per-key rate limit: 429 with Retry-After, recovery, other keys untouched, the SDK's retry.
4. CORS off by default; a configured origin is allowed, another is not.
5. readiness: in front of a dead Triton, quick 503s with Retry-After.
6. a client that goes away cancels its generation (Triton's llm_* gauges back to idle).
7. a schemathesis fuzz of /openapi.json: zero 5xx; valid neighbours unharmed by hostile traffic.
8. the generated key file (mode 0600) and the refusal of a key file others can read.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import select
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

try:
    import httpx
except ImportError:  # the openai SDK of this venv ships its fork under this name
    import httpx2 as httpx

from server.layout import ROOT
from server.process import free_port
from tests.integration.conftest import GATEWAY_TEST_KEY
from tests.metrics_text import metric_sum, scrape

AUTH = {"Authorization": f"Bearer {GATEWAY_TEST_KEY}"}
GEN = "text_generation"
EMB = "text_embedding"

# Every /v1 route with a body that would be valid with a key.
V1_ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/text_embedding", None),
    ("POST", "/v1/embeddings", {"model": EMB, "input": "hello"}),
    ("POST", "/v1/chat/completions", {"model": GEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("POST", "/v1/completions", {"model": GEN, "prompt": "hi", "max_tokens": 1}),
    ("GET", "/v1/no-such-route", None),
]


def error_of(r) -> dict:
    """OpenAI's error object of a response (or of its body's bytes), checked for its shape."""
    body = json.loads(r) if isinstance(r, (bytes, str)) else r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def gateway_metric(gw, name: str, **labels) -> float:
    """The sum of a gateway metric's series whose labels include ``labels`` (tests/metrics_text.py)."""
    return metric_sum(httpx.get(f"{gw.url}/metrics", timeout=10).text, name, **labels)


def triton_metric(triton, name: str, **labels) -> float:
    """The sum of the generation model's series of a Triton metric (at least one must exist)."""
    return metric_sum(scrape(triton.metrics_url), name, series=True, model=GEN, **labels)


def generation_idle(triton) -> bool:
    return (
        triton_metric(triton, "llm_num_requests_running") == 0
        and triton_metric(triton, "llm_num_requests_waiting") == 0
        and triton_metric(triton, "llm_kv_cache_blocks_used") == 0
    )


def wait_until(check, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def host_port(gw) -> tuple[str, int]:
    u = urllib.parse.urlsplit(gw.url)
    return u.hostname, u.port


def raw_exchange(gw, head: bytes, body_chunks, read_timeout: float = 30.0) -> tuple[int | None, bytes, float]:
    """Send ``head`` and then the chunks on a raw socket, stopping as soon as the server answers
    (it may answer 413 before the body is all sent, then close); (status, response, seconds)."""
    sock = socket.create_connection(host_port(gw), timeout=read_timeout)
    started = time.monotonic()
    data = b""
    try:
        sock.sendall(head)
        for chunk in body_chunks:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        try:
            while b"\r\n\r\n" not in data:
                piece = sock.recv(65536)
                if not piece:
                    break
                data += piece
            # The body of a short error answer follows its head at once.
            sock.settimeout(1.0)
            try:
                while True:
                    piece = sock.recv(65536)
                    if not piece:
                        break
                    data += piece
            except (TimeoutError, ConnectionResetError):
                pass
        except ConnectionResetError:
            pass
    finally:
        sock.close()
    took = time.monotonic() - started
    m = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return (int(m.group(1)) if m else None), data, took


def plain_request(gw, method: str, path: str, body=None, headers: dict | None = None):
    """One request over http.client: (status, lower-cased headers, body bytes)."""
    conn = http.client.HTTPConnection(*host_port(gw), timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(
            method, path, body=data, headers={**({"Content-Type": "application/json"} if data else {}), **(headers or {})}
        )
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def body_json(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1].decode("utf-8"))


def healthy(gw) -> bool:
    return httpx.get(f"{gw.url}/health", timeout=10).status_code == 200


# ---- 1. auth -----------------------------------------------------------------------------

BAD_AUTH = {
    "none": None,
    "wrong key": "Bearer sk-wrong-key-but-long-enough-000",
    "basic scheme": "Basic " + base64.b64encode(f"user:{GATEWAY_TEST_KEY}".encode()).decode(),
    "the key without a scheme": GATEWAY_TEST_KEY,
    "empty bearer": "Bearer ",
    "bearer alone": "Bearer",
    "the key with a suffix": f"Bearer {GATEWAY_TEST_KEY}x",
}


@pytest.mark.parametrize("how", list(BAD_AUTH))
@pytest.mark.parametrize("method,path,body", V1_ROUTES, ids=[f"{m} {p}" for m, p, _ in V1_ROUTES])
def test_v1_routes_refuse_a_missing_or_invalid_key_with_401(gateway, how, method, path, body):
    # http.client, not httpx: httpx refuses to send a header value with a trailing space.
    headers = {} if BAD_AUTH[how] is None else {"Authorization": BAD_AUTH[how]}
    status, response_headers, data = plain_request(gateway, method, path, body, headers)
    assert status == 401, (status, data)
    err = error_of(data)
    assert err["type"] == "authentication_error", err
    assert "Bearer" in err["message"]
    assert response_headers.get("x-request-id")


def test_the_valid_key_is_accepted_on_every_route(gateway):
    for method, path, body in V1_ROUTES:
        r = httpx.request(method, gateway.url + path, json=body, headers=AUTH, timeout=120)
        expected = 404 if path == "/v1/no-such-route" else 200
        assert r.status_code == expected, (path, r.status_code, r.text)


def test_health_and_metrics_need_no_key(gateway):
    for path in ("/health", "/health/ready", "/metrics"):
        r = httpx.get(gateway.url + path, timeout=10)
        assert r.status_code == 200, (path, r.status_code, r.text)
    assert "gateway_requests_total" in httpx.get(gateway.url + "/metrics", timeout=10).text


def test_sdk_with_a_wrong_key_raises_authentication_error(gateway):
    import openai

    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-wrong-key-but-long-enough-111", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.embeddings.create(model=EMB, input="hello")
    assert caught.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client.close()


def test_keys_never_reach_the_log(gateway):
    presented = "sk-presented-wrong-key-4242424242"
    httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {presented}"}, timeout=10)
    httpx.get(gateway.url + "/v1/models", headers=AUTH, timeout=10)
    text = gateway.log_path.read_text(encoding="utf-8", errors="replace")
    assert '"status":401' in text.replace(" ", ""), "the access log has no line of the refused request"
    assert GATEWAY_TEST_KEY not in text
    assert presented not in text


# ---- 2. limits and malformed bodies ------------------------------------------------------


@pytest.fixture(scope="module")
def limited(triton, start_gateway):
    """A gateway with small limits: 1 MB bodies, 4 inputs of 100 characters, 200-character prompts,
    max_tokens at most 8."""
    with start_gateway(
        triton.triton_grpc_url,
        "--rate-limit",
        "0",
        "--max-body-mb",
        "1",
        "--max-inputs",
        "4",
        "--max-input-chars",
        "100",
        "--max-prompt-chars",
        "200",
        "--max-tokens-cap",
        "8",
    ) as gw:
        yield gw


MB = 1024 * 1024


def test_a_body_over_max_body_mb_is_413(limited):
    body = json.dumps({"model": EMB, "input": "x" * (2 * MB)})
    r = httpx.post(f"{limited.url}/v1/embeddings", content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413, (r.status_code, r.text[:300])
    err = error_of(r)
    assert "--max-body-mb" in err["message"] and err["code"] == "request_too_large", err


def test_a_content_length_claiming_too_much_is_413_before_the_body_is_read(limited):
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {GATEWAY_TEST_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {50 * MB}\r\n\r\n"
    ).encode()
    status, raw, took = raw_exchange(limited, head, [b'{"model": "text_embedding", "input": "a"}'])
    assert status == 413, raw[:400]
    assert "--max-body-mb" in body_json(raw)["error"]["message"]
    # at once: a gateway waiting for the 50 MB would not answer before the client's 30 s read timeout
    assert took < 15, f"the 413 took {took:.1f} s: the gateway waited for a body that never came"
    assert healthy(limited)


def test_a_content_length_claiming_less_than_is_sent_is_a_4xx_and_the_gateway_lives(limited):
    """The server reads what Content-Length says; the rest is garbage on the connection."""
    tail = b'{"model": "text_embedding", "input": "' + b"y" * (2 * MB) + b'"}'
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {GATEWAY_TEST_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: 20\r\n\r\n"
    ).encode()
    status, raw, _ = raw_exchange(limited, head, [tail[i : i + 65536] for i in range(0, len(tail), 65536)])
    assert status is not None and 400 <= status < 500, raw[:400]
    assert healthy(limited)


def test_a_non_numeric_content_length_is_refused(limited):
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {GATEWAY_TEST_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: 12abc\r\n\r\n"
    ).encode()
    status, raw, _ = raw_exchange(limited, head, [b'{"a": 1}'])
    assert status is None or 400 <= status < 500, raw[:400]
    assert healthy(limited)


def test_a_chunked_body_over_the_limit_without_content_length_is_413(limited):
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {GATEWAY_TEST_KEY}\r\n"
        f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    payload = b'{"model": "text_embedding", "input": "' + b"z" * (2 * MB) + b'"}'
    chunks = [b"%x\r\n%s\r\n" % (len(p), p) for p in (payload[i : i + 65536] for i in range(0, len(payload), 65536))]
    status, raw, _ = raw_exchange(limited, head, [*chunks, b"0\r\n\r\n"])
    assert status == 413, raw[:400]
    assert "--max-body-mb" in body_json(raw)["error"]["message"]
    assert healthy(limited)
    # Under the limit, chunked is fine.
    small = b'{"model": "text_embedding", "input": "chunked"}'
    status, raw, _ = raw_exchange(limited, head, [b"%x\r\n%s\r\n" % (len(small), small), b"0\r\n\r\n"])
    assert status == 200, raw[:400]


def _post(gw, path, body, **kw):
    return httpx.post(gw.url + path, json=body, headers=AUTH, timeout=kw.pop("timeout", 60), **kw)


def test_more_inputs_than_max_inputs_is_413_naming_the_limit(limited):
    r = _post(limited, "/v1/embeddings", {"model": EMB, "input": ["a", "b", "c", "d", "e"]})
    assert r.status_code == 413, r.text
    err = error_of(r)
    assert "--max-inputs" in err["message"] and "4" in err["message"] and err["param"] == "input", err
    assert _post(limited, "/v1/embeddings", {"model": EMB, "input": ["a", "b", "c", "d"]}).status_code == 200


def test_a_text_over_max_input_chars_is_413_naming_it(limited):
    r = _post(limited, "/v1/embeddings", {"model": EMB, "input": ["ok", "w" * 101]})
    assert r.status_code == 413, r.text
    err = error_of(r)
    assert "--max-input-chars" in err["message"] and err["param"] == "input[1]", err
    assert _post(limited, "/v1/embeddings", {"model": EMB, "input": "w" * 100}).status_code == 200


def test_a_prompt_over_max_prompt_chars_is_413_naming_it(limited):
    r = _post(limited, "/v1/completions", {"model": GEN, "prompt": "p" * 201, "max_tokens": 1})
    assert r.status_code == 413, r.text
    err = error_of(r)
    assert "--max-prompt-chars" in err["message"] and err["param"] == "prompt", err
    r = _post(
        limited,
        "/v1/chat/completions",
        {
            "model": GEN,
            "max_tokens": 1,
            "messages": [{"role": "system", "content": "s" * 150}, {"role": "user", "content": "u" * 51}],
        },
    )
    assert r.status_code == 413, r.text
    err = error_of(r)
    assert "--max-prompt-chars" in err["message"] and err["param"] == "messages", err


@pytest.mark.parametrize(
    "route,field",
    [
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
        ("/v1/completions", "max_tokens"),
    ],
)
def test_max_tokens_over_the_cap_is_400_naming_it(limited, route, field):
    body = {"model": GEN, field: 9}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})
    r = _post(limited, route, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == field and field in err["message"] and "8" in err["message"], err
    body[field] = 8
    ok = _post(limited, route, body, timeout=120)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] <= 8


def test_too_many_stop_strings_is_400(limited):
    r = _post(limited, "/v1/completions", {"model": GEN, "prompt": "hi", "max_tokens": 1, "stop": ["a", "b", "c", "d", "e"]})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "stop" and "limit" in err["message"], err


POST_ROUTES = ["/v1/embeddings", "/v1/chat/completions", "/v1/completions"]


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b'{"model": "text_embedding", "input": "a"',
        b"not json",
        b"\xff\xfe",
        b'{"model": "text_embedding", "input": "a"}}',
        b"{'model': 'x'}",
    ],
    ids=["brace", "unterminated", "words", "bad-utf8", "trailing", "single-quotes"],
)
@pytest.mark.parametrize("route", POST_ROUTES)
def test_invalid_json_is_400(gateway, route, raw):
    r = httpx.post(gateway.url + route, content=raw, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, (r.status_code, r.text)
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"], err


CHAT = {"model": GEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
WRONG_TYPES = [
    ("/v1/embeddings", {"model": EMB, "input": 5}, "input"),
    ("/v1/embeddings", {"model": EMB, "input": [1, "a"]}, "input"),
    ("/v1/embeddings", {"model": EMB, "input": [None]}, "input"),
    ("/v1/embeddings", {"model": EMB, "input": [[1, None]]}, "input"),
    ("/v1/embeddings", {"model": EMB, "input": {"text": "a"}}, "input"),
    ("/v1/embeddings", {"model": EMB, "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"model": 5, "input": "a"}, "model"),
    ("/v1/embeddings", {"input": "a"}, "model"),
    ("/v1/embeddings", {"model": EMB, "input": "a", "dimensions": "384"}, "dimensions"),
    ("/v1/embeddings", {"model": EMB, "input": "a", "dimensions": 2**80}, "dimensions"),
    ("/v1/embeddings", {"model": EMB, "input": [[2**80]]}, "input"),
    ("/v1/chat/completions", {**CHAT, "messages": "x"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [None]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": None, "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [None]}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": {"a": None}}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2**80}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    # Python's JSON parser takes NaN and Infinity: each is then a value out of range.
    ("/v1/chat/completions", {**CHAT, "temperature": float("nan")}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": float("nan")}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "temperature": float("inf")}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": float("nan")}, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": float("nan")}, "presence_penalty"),
    ("/v1/completions", {"model": GEN, "prompt": "hi", "frequency_penalty": float("-inf")}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**80}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -(2**80)}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1.5}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**80}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": -1}, "seed"),
    ("/v1/chat/completions", {**CHAT, "n": 17}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": 2**80}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": "2"}, "n"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "stop": [None]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": 5}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**80}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 2**80}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 2**80}, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1": 2**80}}, "logit_bias"),
    ("/v1/completions", {"model": GEN, "prompt": None}, "prompt"),
    ("/v1/completions", {"model": GEN, "prompt": [None]}, "prompt"),
    ("/v1/completions", {"model": GEN, "prompt": [[2**80]]}, "prompt"),
    ("/v1/completions", {"model": GEN, "prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"model": GEN, "prompt": "hi", "echo": None, "max_tokens": 2**80}, "max_tokens"),
]


@pytest.mark.parametrize(
    "route,body,param", WRONG_TYPES, ids=[f"{r.split('/')[-1]}-{p}-{i}" for i, (r, _, p) in enumerate(WRONG_TYPES)]
)
def test_wrong_types_are_4xx_naming_the_field(gateway, route, body, param):
    r = httpx.post(
        gateway.url + route, content=json.dumps(body), headers={**AUTH, "Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code in (400, 422), (r.status_code, r.text)
    err = error_of(r)
    assert err["type"] == "invalid_request_error", err
    assert err["param"] is not None and err["param"].split(".")[0].split("[")[0] == param, err


@pytest.mark.parametrize("body", [[], None, "a", 5, {}], ids=["list", "null", "string", "number", "empty-object"])
@pytest.mark.parametrize("route", POST_ROUTES)
def test_a_body_that_is_not_the_request_object_is_4xx(gateway, route, body):
    r = httpx.post(
        gateway.url + route, content=json.dumps(body), headers={**AUTH, "Content-Type": "application/json"}, timeout=30
    )
    assert r.status_code in (400, 422), (r.status_code, r.text)
    error_of(r)


@pytest.mark.parametrize(
    "ids,bad",
    [([[101, 49152 * 10, 102]], 491520), ([[101, -1, 102]], -1), ([5, -3], -3), ([[101, 102], [101, 30522, 102]], 30522)],
    ids=["huge", "negative", "flat-negative", "just-past-the-vocab"],
)
def test_token_ids_outside_the_vocabulary_are_400(gateway, ids, bad):
    r = _post(gateway, "/v1/embeddings", {"model": EMB, "input": ids})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"].startswith("input") and str(bad) in err["message"] and "vocabulary" in err["message"], err
    ok = _post(gateway, "/v1/embeddings", {"model": EMB, "input": [[101, 30521, 102]]})
    assert ok.status_code == 200, ok.text


# ---- 3. rate limit -----------------------------------------------------------------------

K1 = "sk-rate-key-one-0123456789"
K2 = "sk-rate-key-two-0123456789"


@pytest.fixture(scope="module")
def rate_limited(triton, start_gateway):
    with start_gateway(
        triton.triton_grpc_url, "--rate-limit", "2", "--rate-burst", "3", env={"GATEWAY_API_KEYS": f"{K1},{K2}"}
    ) as gw:
        yield gw


def _drain(client: httpx.Client, url: str, key: str) -> tuple[list[int], float, httpx.Response]:
    """Quick requests until the first 429 (at most 10); statuses, seconds taken, the 429."""
    statuses = []
    started = time.monotonic()
    for _ in range(10):
        r = client.get(url, headers={"Authorization": f"Bearer {key}"})
        statuses.append(r.status_code)
        if r.status_code == 429:
            return statuses, time.monotonic() - started, r
    pytest.fail(f"no 429 in 10 quick requests: {statuses}")


def test_rate_limit_429_with_retry_after_then_recovers_and_spares_other_keys(rate_limited):
    from tests.integration.conftest import GATEWAY_TEST_KEY as unconfigured

    url = f"{rate_limited.url}/v1/models"
    with httpx.Client(timeout=10) as client:
        statuses, took, refused = _drain(client, url, K1)
        # A bucket of 3 refilled at 2/s: at most 3 + 2 * took requests pass before a refusal.
        passed = len(statuses) - 1
        assert all(s == 200 for s in statuses[:-1]), statuses
        assert 3 <= passed <= 3 + int(2 * took), (statuses, took)
        if took < 0.45:
            assert statuses == [200, 200, 200, 429], (statuses, took)
        err = error_of(refused)
        assert err["type"] == "rate_limit_error", err
        retry = refused.headers.get("retry-after")
        assert retry is not None and retry.isdigit() and int(retry) >= 1, refused.headers
        # The other key has its own bucket.
        other = client.get(url, headers={"Authorization": f"Bearer {K2}"})
        assert other.status_code == 200, other.text
        # A key that is not configured is 401, not 429 (auth first).
        assert client.get(url, headers={"Authorization": f"Bearer {unconfigured}"}).status_code == 401
        time.sleep(int(retry))
        again = client.get(url, headers={"Authorization": f"Bearer {K1}"})
        assert again.status_code == 200, again.text
    from openai_gateway.auth import key_id

    assert gateway_metric(rate_limited, "gateway_rate_limited_total", key_id=key_id(K1)) >= 1
    assert gateway_metric(rate_limited, "gateway_rate_limited_total", key_id=key_id(K2)) == 0


def test_the_sdk_with_retries_succeeds_by_honouring_retry_after(rate_limited):
    import openai

    from openai_gateway.auth import key_id

    time.sleep(2)  # a full bucket
    url = f"{rate_limited.url}/v1/models"
    with httpx.Client(timeout=10) as client:
        _drain(client, url, K2)
    refused_before = gateway_metric(rate_limited, "gateway_rate_limited_total", key_id=key_id(K2))
    sdk = openai.OpenAI(base_url=f"{rate_limited.url}/v1", api_key=K2, max_retries=2, timeout=30)
    started = time.monotonic()
    models = sdk.models.list()
    took = time.monotonic() - started
    sdk.close()
    assert {m.id for m in models.data} >= {EMB}, models
    refused = gateway_metric(rate_limited, "gateway_rate_limited_total", key_id=key_id(K2)) - refused_before
    assert refused >= 1, "the SDK's first try was not refused: the bucket was not empty"
    assert took >= 0.4, f"the SDK retried after {took:.2f} s, before the Retry-After"
    no_retry = openai.OpenAI(base_url=f"{rate_limited.url}/v1", api_key=K2, max_retries=0, timeout=30)
    with httpx.Client(timeout=10) as client:
        _drain(client, url, K2)
    with pytest.raises(openai.RateLimitError):
        no_retry.models.list()
    no_retry.close()


# ---- 4. CORS -----------------------------------------------------------------------------

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_is_off_by_default(gateway):
    for path in ("/v1/embeddings", "/v1/models", "/health"):
        r = httpx.options(gateway.url + path, headers={"Origin": "http://app.example", **PREFLIGHT}, timeout=10)
        assert "access-control-allow-origin" not in r.headers, (path, r.status_code, dict(r.headers))
        assert r.status_code < 500
    r = httpx.get(gateway.url + "/v1/models", headers={**AUTH, "Origin": "http://app.example"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, dict(r.headers)


def test_cors_allows_the_configured_origin_only(triton, start_gateway):
    with start_gateway(triton.triton_grpc_url, "--rate-limit", "0", "--cors-origins", "http://app.example") as gw:
        ok = httpx.options(gw.url + "/v1/embeddings", headers={"Origin": "http://app.example", **PREFLIGHT}, timeout=10)
        assert ok.status_code == 200, ok.text
        assert ok.headers.get("access-control-allow-origin") == "http://app.example", dict(ok.headers)
        assert "authorization" in ok.headers.get("access-control-allow-headers", "").lower()
        other = httpx.options(gw.url + "/v1/embeddings", headers={"Origin": "http://evil.example", **PREFLIGHT}, timeout=10)
        assert other.headers.get("access-control-allow-origin") != "http://evil.example", dict(other.headers)
        assert "access-control-allow-origin" not in other.headers and other.status_code < 500
        real = httpx.get(gw.url + "/v1/models", headers={**AUTH, "Origin": "http://app.example"}, timeout=10)
        assert real.status_code == 200 and real.headers.get("access-control-allow-origin") == "http://app.example"
        assert "x-request-id" in real.headers.get("access-control-expose-headers", "").lower()
        foreign = httpx.get(gw.url + "/v1/models", headers={**AUTH, "Origin": "http://evil.example"}, timeout=10)
        assert "access-control-allow-origin" not in foreign.headers, dict(foreign.headers)
        # A preflight carries no key; the request itself still needs one.
        keyless = httpx.get(gw.url + "/v1/models", headers={"Origin": "http://app.example"}, timeout=10)
        assert keyless.status_code == 401


# ---- 5. readiness ------------------------------------------------------------------------


def test_in_front_of_a_dead_triton_health_is_up_and_v1_is_a_quick_503(start_gateway):
    with start_gateway(f"127.0.0.1:{free_port()}", "--rate-limit", "0", wait_ready=False) as gw:
        with httpx.Client(timeout=10) as client:
            for method, path, body, want in [
                ("GET", "/health", None, 200),
                ("GET", "/health/ready", None, 503),
                ("POST", "/v1/embeddings", {"model": EMB, "input": "hi"}, 503),
                ("POST", "/v1/chat/completions", CHAT, 503),
                ("GET", "/v1/models", None, 503),
            ]:
                started = time.monotonic()
                r = client.request(method, gw.url + path, json=body, headers=AUTH)
                took = time.monotonic() - started
                assert r.status_code == want, (path, r.status_code, r.text)
                # answered from the readiness poll's state, not after a try of Triton (up to --triton-timeout, 60 s)
                assert took < 10, f"{path} took {took:.2f} s"
                if want == 503:
                    err = error_of(r)
                    assert err["type"] == "service_unavailable", err
                    retry = r.headers.get("retry-after")
                    assert retry is not None and retry.isdigit() and int(retry) >= 1, dict(r.headers)
            assert client.get(gw.url + "/metrics").status_code == 200
            # Still 401 without a key, whatever Triton's state.
            assert client.post(gw.url + "/v1/embeddings", json={"model": EMB, "input": "hi"}).status_code == 401
        assert gateway_metric(gw, "gateway_triton_ready") == 0


# ---- 6. disconnect cancels ---------------------------------------------------------------

LONG_CHAT = {
    "model": GEN,
    "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
    "max_tokens": 1000,
    "ignore_eos": True,
    "temperature": 0,
}


def _aborts(triton) -> float:
    return triton_metric(triton, "llm_request_success_total", finish_reason="abort")


def test_closing_a_stream_cancels_the_generation(triton, gateway):
    assert wait_until(lambda: generation_idle(triton), 30), "the generation model was busy before the test"
    aborts = _aborts(triton)
    cancelled = gateway_metric(gateway, "gateway_cancelled_total", route="/v1/chat/completions")
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{gateway.url}/v1/chat/completions", json={**LONG_CHAT, "stream": True}, headers=AUTH) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break
        # The engine reports its gauges every 0.5 s from a thread of its own, and a busy
        # machine (2 shared cores) slows its steps: give it time.
        assert wait_until(lambda: triton_metric(triton, "llm_kv_cache_blocks_used") > 0, 15), "no KV blocks held while streaming"
    closed = time.monotonic()
    # Generous on a busy machine: the abort count below tells a cancel from a generation that ran out.
    assert wait_until(lambda: generation_idle(triton), 30), (
        f"the generation still runs {time.monotonic() - closed:.1f} s after the client left"
    )
    took = time.monotonic() - closed
    assert wait_until(lambda: _aborts(triton) == aborts + 1, 10), "the engine did not abort the request"
    assert gateway_metric(gateway, "gateway_cancelled_total", route="/v1/chat/completions") == cancelled + 1
    tokens = triton_metric(triton, "llm_generation_tokens_total")
    time.sleep(0.5)
    assert triton_metric(triton, "llm_generation_tokens_total") == tokens, "tokens still generated after idle"
    print(f"stream closed -> generation idle in {took:.2f} s")


def test_a_client_timeout_on_a_whole_answer_cancels_the_generation(triton, gateway):
    assert wait_until(lambda: generation_idle(triton), 30), "the generation model was busy before the test"
    aborts = _aborts(triton)
    cancelled = gateway_metric(gateway, "gateway_cancelled_total", route="/v1/chat/completions")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{gateway.url}/v1/chat/completions", json=LONG_CHAT, headers=AUTH, timeout=1.0)
    gone = time.monotonic()
    assert wait_until(lambda: generation_idle(triton) and _aborts(triton) == aborts + 1, 30), (
        f"the generation was not aborted within {time.monotonic() - gone:.1f} s of the client's timeout"
    )
    took = time.monotonic() - gone
    assert wait_until(
        lambda: gateway_metric(gateway, "gateway_cancelled_total", route="/v1/chat/completions") == cancelled + 1, 10
    )
    print(f"client timeout -> generation idle in {took:.2f} s")


# ---- 7. fuzz -----------------------------------------------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("GATEWAY_FUZZ_EXAMPLES", "100"))
# The served ids and aliases (None in a draw: keep the generated name, mostly a 404).
MODEL_NAMES = [EMB, "sentence-transformers/all-MiniLM-L6-v2", GEN, "HuggingFaceTB/SmolLM2-135M-Instruct"]
REFUSED_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "response_format",
    "dimensions",
    "suffix",
    "best_of",
    "stream_options",
)


LOOKUPS = re.compile(r"/v1/files|/v1/batches|/v1/responses/")


@pytest.fixture(scope="module")
def fuzz_gateway(triton, start_gateway):
    with start_gateway(triton.triton_grpc_url, "--rate-limit", "0", "--max-tokens-cap", "8", "--no-request-log") as gw:
        yield gw


def test_schemathesis_fuzz_of_the_openapi_schema_finds_no_5xx(fuzz_gateway):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{fuzz_gateway.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {
        "POST /v1/embeddings",
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "POST /v1/rerank",
        "POST /score",
        "POST /v1/files",
        "GET /v1/files/{file_id}/content",
        "POST /v1/batches",
        "POST /v1/batches/{batch_id}/cancel",
        "POST /v1/responses",
        "GET /v1/responses/{response_id}",
        "DELETE /v1/responses/{response_id}",
    } <= labels, labels
    statuses: Counter = Counter()
    refusals: Counter = Counter()
    per_op: dict[str, Counter] = {}
    server_errors = []
    started = time.monotonic()
    import requests

    session = requests.Session()

    def fuzz(op, mode, label: str, names: list, counts: Counter) -> None:
        """Run one operation's cases in one generation mode."""

        @settings(
            # The Batch API's routes and a stored response's only store, look up and list (their lines
            # and answers run through the routes above): fewer cases.
            max_examples=FUZZ_EXAMPLES // 5 if LOOKUPS.search(label) else FUZZ_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode), model=st.sampled_from(names), plain=st.booleans())
        def run(case, model, plain):
            # A free-form model string is a 404 before anything else is looked at: most cases
            # name a served model so that the fuzz reaches the request checks and Triton,
            # and half drop the fields the gateway refuses (tools, response_format...) so that
            # they reach Triton. The key is always valid (auth has its own tests).
            case.headers = {**(case.headers or {}), **AUTH}
            if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and model:
                case.body["model"] = model
            if plain and isinstance(case.body, dict) and mode == schemathesis.GenerationMode.POSITIVE:
                for name in REFUSED_FIELDS:
                    case.body.pop(name, None)
                for message in case.body.get("messages") or ():
                    if isinstance(message, dict) and message.get("role") not in ("system", "user", "assistant"):
                        message["role"] = "user"
                    if isinstance(message, dict) and not (isinstance(message.get("content"), str) and message["content"].strip()):
                        message["content"] = "hi"
            if case.path_parameters and "model" in case.path_parameters and model:
                case.path_parameters["model"] = model
            response = case.call(base_url=fuzz_gateway.url, session=session, timeout=60)
            counts[response.status_code] += 1
            statuses[response.status_code] += 1
            if response.status_code == 400 and mode == schemathesis.GenerationMode.POSITIVE:
                refusals[(label, (response.json()["error"].get("param") or "-").split("[")[0])] += 1
            if response.status_code >= 500:
                server_errors.append((label, case.body, response.status_code, response.text[:300]))
            case.validate_response(response, checks=[not_a_server_error])

        run()

    for op in operations:
        label = f"{op.method.upper()} {op.path}"
        names = (
            MODEL_NAMES[:2]
            if "embeddings" in op.path or "rerank" in op.path or "score" in op.path
            else MODEL_NAMES[2:]
            if "completions" in op.path or "responses" in op.path
            else [MODEL_NAMES[0], MODEL_NAMES[2]]
        )
        names = [*names, None]
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            counts = per_op.setdefault(f"{label} {mode.value}", Counter())
            fuzz(op, mode, label, names, counts)
    took = time.monotonic() - started
    total = sum(statuses.values())
    by_class = Counter(f"{s // 100}xx" for s in statuses.elements())
    print(
        f"schemathesis: {total} cases over {len(operations)} operations in {took:.0f} s; "
        f"{dict(sorted(by_class.items()))}; statuses {dict(sorted(statuses.items()))}"
    )
    for name, c in per_op.items():
        print(f"  {name}: {dict(sorted(c.items()))}")
    print(f"  400s of positive cases by route and param: {dict(refusals.most_common(12))}")
    assert not server_errors, server_errors[:5]
    assert total >= len(operations) * 2, f"only {total} cases ran"
    assert by_class["2xx"] > 0 and by_class["4xx"] > 0, by_class
    assert healthy(fuzz_gateway)


# Requests that must each get a 4xx (or a closed connection), fired while neighbours embed.
def _hostile_requests(gw):
    url = gw.url
    junk_auth = {"Authorization": "Bearer sk-nope-nope-nope-nope"}
    return [
        lambda: httpx.post(f"{url}/v1/embeddings", content=b"{", headers={**AUTH, "Content-Type": "application/json"}),
        lambda: httpx.post(f"{url}/v1/embeddings", json={"model": EMB, "input": 5}, headers=AUTH),
        lambda: httpx.post(f"{url}/v1/embeddings", json={"model": EMB, "input": [[2**80]]}, headers=AUTH),
        lambda: httpx.post(f"{url}/v1/embeddings", json={"model": EMB, "input": [[-1, 5]]}, headers=AUTH),
        lambda: httpx.post(f"{url}/v1/embeddings", json={"model": EMB, "input": "a"}, headers=junk_auth),
        lambda: httpx.post(f"{url}/v1/embeddings", json={"model": "nope", "input": "a"}, headers=AUTH),
        lambda: httpx.post(f"{url}/v1/embeddings", json={"model": EMB, "input": ["a"] * 5000}, headers=AUTH),
        lambda: httpx.post(f"{url}/v1/embeddings", json={"model": EMB, "input": "x" * 20000}, headers=AUTH),
        lambda: httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "temperature": "hot"}, headers=AUTH),
        lambda: httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 2**80}, headers=AUTH),
        lambda: httpx.post(f"{url}/v1/completions", json={"model": GEN, "prompt": [None]}, headers=AUTH),
        lambda: httpx.post(f"{url}/v1/embeddings", content=b"\x00" * 1000, headers={**AUTH, "Content-Type": "application/json"}),
    ]


def _triton_embeddings(http_client, texts: list[str]) -> np.ndarray:
    import tritonclient.http as httpclient

    inp = httpclient.InferInput("TEXT", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t.encode("utf-8")] for t in texts], dtype=object))
    return http_client.infer(EMB, [inp]).as_numpy("EMBEDDING")


def test_valid_neighbours_are_unharmed_by_hostile_traffic(gateway, http_client):
    """Fresh texts (no cache hit) embedded through the gateway while three threads fire hostile
    requests; each vector equals Triton's own for the same text, each hostile request is a 4xx."""
    stop = threading.Event()
    hostile_statuses: Counter = Counter()
    hostile = _hostile_requests(gateway)
    lock = threading.Lock()

    def fire():
        i = 0
        while not stop.is_set():
            try:
                r = hostile[i % len(hostile)]()
                status = r.status_code
            except httpx.TransportError as exc:
                status = type(exc).__name__
            with lock:
                hostile_statuses[status] += 1
            i += 1

    def hostile_done() -> int:
        with lock:
            return sum(hostile_statuses.values())

    def neighbour(w: int):
        out = []
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=60) as client:
            k = 0
            # At least 8 requests, and on until the hostile threads went through their list twice.
            while k < 8 or (hostile_done() < 2 * len(hostile) and time.monotonic() < deadline):
                texts = [f"neighbour {w} request {k} text {j}: {'abcdefgh'[j] * (j + 1)}" for j in range(4)]
                r = client.post(f"{gateway.url}/v1/embeddings", json={"model": EMB, "input": texts}, headers=AUTH)
                out.append((texts, r.status_code, r.json() if r.status_code == 200 else r.text))
                k += 1
        return out

    firing = [threading.Thread(target=fire, daemon=True) for _ in range(3)]
    for t in firing:
        t.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            results = [x for batch in pool.map(neighbour, range(4)) for x in batch]
    finally:
        stop.set()
        for t in firing:
            t.join(timeout=60)
    assert len(results) >= 32
    for _texts, status, body in results:
        assert status == 200, body
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    got = np.array([d["embedding"] for _, _, body in results for d in body["data"]], dtype=np.float32)
    sent = [t for texts, _, _ in results for t in texts]
    want = np.concatenate([_triton_embeddings(http_client, sent[i : i + 64]) for i in range(0, len(sent), 64)])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    print(f"{len(results)} neighbour requests, min cosine {cos.min():.6f}; hostile: {dict(hostile_statuses)}")
    assert cos.min() >= 0.9999, cos.min()
    assert sum(hostile_statuses.values()) >= 2 * len(hostile), hostile_statuses
    numeric = [s for s in hostile_statuses if isinstance(s, int)]
    assert numeric and all(400 <= s < 500 for s in numeric), hostile_statuses
    assert healthy(gateway)


# ---- 8. the key file ---------------------------------------------------------------------


def test_without_keys_a_0600_key_file_is_created_and_its_key_works(triton, start_gateway):
    with start_gateway(triton.triton_grpc_url, "--rate-limit", "0", env={"GATEWAY_API_KEYS": ""}) as gw:
        path = gw.options.api_key_file
        assert path.is_file(), f"no key file at {path}"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, oct(path.stat().st_mode)
        keys = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        assert len(keys) == 1 and len(keys[0]) >= 32, "the key file should hold one long key"
        key = keys[0]
        r = httpx.get(f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{gw.url}/v1/models", headers=AUTH, timeout=10).status_code == 401, (
            "the test key works although $GATEWAY_API_KEYS is empty"
        )
        assert key not in gw.log_path.read_text(encoding="utf-8", errors="replace"), "the new key is in the log"
    # A second start reads the same file: the key stays the same.
    with start_gateway(
        triton.triton_grpc_url, "--rate-limit", "0", "--api-key-file", str(path), env={"GATEWAY_API_KEYS": ""}
    ) as again:
        assert path.read_text(encoding="utf-8").strip() == key
        r = httpx.get(f"{again.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200, r.text


def test_a_key_file_others_can_read_stops_the_start_with_a_clear_message(tmp_path):
    path = tmp_path / "gateway-api-key"
    secret = "sk-triton-readable-by-everyone-0123456789"
    path.write_text(secret + "\n", encoding="utf-8")
    path.chmod(0o644)
    env = {**os.environ, "GATEWAY_API_KEYS": ""}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "openai_gateway",
            "--triton",
            f"127.0.0.1:{free_port()}",
            "--port",
            str(free_port()),
            "--api-key-file",
            str(path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "Traceback" not in output and "refusing to start" in output, output
    assert str(path) in output and "644" in output and "chmod 600" in output, output
    assert secret not in output
    assert stat.S_IMODE(path.stat().st_mode) == 0o644, "the gateway changed the file's mode"


def test_two_gateways_sharing_redis_apply_one_limit_per_key_and_fail_open_when_it_dies(triton, start_gateway, redis_server):
    """Issue 23 item 5: N gateways used to allow N times the rate. Two real gateways with the same
    --rate-limit-redis share each key's bucket; with Redis killed each falls back to its own."""
    env = {"GATEWAY_API_KEYS": K1}
    args = ("--rate-limit", "0.2", "--rate-burst", "6", "--rate-limit-redis", redis_server.url)
    with (
        start_gateway(triton.triton_grpc_url, *args, env=env) as one,
        start_gateway(triton.triton_grpc_url, *args, env=env) as two,
        httpx.Client(timeout=10) as client,
    ):
        headers = {"Authorization": f"Bearer {K1}"}
        statuses = [client.get(f"{gw.url}/v1/models", headers=headers).status_code for _ in range(8) for gw in (one, two)]
        # 16 requests over both gateways; one bucket of 6 (refilling 0.2/s) between them.
        assert statuses.count(200) in (6, 7) and statuses.count(429) == 16 - statuses.count(200), statuses
        redis_server.kill()
        fallback = [client.get(f"{one.url}/v1/models", headers=headers).status_code for _ in range(8)]
        # Redis gone: the gateway's own bucket (fail open), a burst of 6, then 429 again.
        assert fallback[:6] == [200] * 6 and 429 in fallback[6:], fallback
        assert gateway_metric(one, "gateway_rate_limit_redis_errors_total") >= 8
