"""The gateway app's own behaviour, with Triton down: its backend points at a free port where
nothing listens (the real "Triton is down" condition). Keys, limits, schema and request
checks, errors in OpenAI's shape, health, metrics, request ids and CORS need no Triton."""

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from openai_gateway.app import create_app
from openai_gateway.auth import ApiKeys, key_id
from openai_gateway.settings import GatewaySettings
from server.supervisor import free_port
from tests.metrics_text import metric_sum, metric_values

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-triton-unit-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
EMBED = {"model": "text_embedding", "input": ["hello world"]}
CHAT = {"model": "text_generation", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


REPOSITORY = ROOT / "model_repository"


@pytest.fixture(scope="module", autouse=True)
def repository(tmp_path_factory):
    """The repository the gateway reads. Where `make export` has not run, its configs with the
    tokenizer the gateway counts tokens with from the packaged model (what the export copies):
    the unit tier needs no export output."""
    global REPOSITORY
    if not (REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json").is_file():
        from export import reference

        REPOSITORY = tmp_path_factory.mktemp("gateway-repository")
        for config in (ROOT / "model_repository").glob("*/config.pbtxt"):
            (REPOSITORY / config.parent.name).mkdir()
            shutil.copyfile(config, REPOSITORY / config.parent.name / "config.pbtxt")
        (REPOSITORY / "text_tokenizer" / "1").mkdir()
        shutil.copyfile(reference.model_dir() / "tokenizer.json", REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json")
    yield REPOSITORY
    REPOSITORY = ROOT / "model_repository"


def _settings(**changes) -> GatewaySettings:
    base = GatewaySettings(
        triton_url=f"127.0.0.1:{free_port()}", model_repository=REPOSITORY, api_keys=(KEY,), rate_limit_rps=0, ready_poll_s=0.2
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def client(repository):
    with TestClient(create_app(_settings(), ApiKeys([KEY])), raise_server_exceptions=False) as c:
        yield c


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


# --- health, metrics -----------------------------------------------------------------------


def test_health_is_200_without_a_key(client):
    r = client.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_ready_is_503_while_triton_is_down(client):
    r = client.get("/health/ready")
    err = error_of(r, 503)
    assert err["code"] == "triton_unavailable" and r.headers["retry-after"] == "1"


def test_metrics_are_prometheus_text_without_a_key(client):
    client.get("/v1/models")  # a 401 to count
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert metric_values(text, "gateway_request_duration_seconds_bucket")
    assert metric_values(text, "gateway_requests_in_flight")
    assert metric_sum(text, "gateway_triton_ready", series=True) == 0
    assert metric_sum(text, "gateway_requests_total", series=True, route="/v1/models", status="401") >= 1


def test_metrics_routes_are_bounded(client):
    # Paths a client makes up are one label value, so they cannot grow the metrics without end.
    def counts(text: str) -> tuple[float, float]:
        return (
            metric_sum(text, "gateway_requests_total", route="other", status="404"),
            metric_sum(text, "gateway_requests_total", route="/v1/models/{model}", status="401"),
        )

    before = counts(client.get("/metrics").text)
    for i in range(3):
        client.get(f"/made-up-{i}")
        client.get(f"/v1/models/made-up-{i}")
    text = client.get("/metrics").text
    assert "made-up" not in text
    after = counts(text)
    assert (after[0] - before[0], after[1] - before[1]) == (3, 3), (before, after)


# --- keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer sk-triton-wrong-key-000000000"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}],
)
@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("GET", "/v1/models/text_embedding"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/nothing"),
    ],
)
def test_v1_without_a_valid_key_is_401(client, headers, method, path):
    r = client.request(method, path, headers=headers, json=EMBED if method == "POST" else None)
    err = error_of(r, 401)
    assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")


def test_the_key_is_checked_before_the_body(client):
    # A bad body without a key is a 401, not a 422: nothing is parsed for strangers.
    assert client.post("/v1/embeddings", content=b"{not json").status_code == 401


# --- body limits and bad bodies --------------------------------------------------------------


def test_a_body_over_the_limit_is_413():
    settings = _settings(max_body_bytes=1000)
    with TestClient(create_app(settings, ApiKeys([KEY]))) as c:
        body = json.dumps({"model": "text_embedding", "input": "x" * 2000}).encode()
        err = error_of(c.post("/v1/embeddings", headers={**AUTH, "Content-Type": "application/json"}, content=body), 413)
        assert err["code"] == "request_too_large" and "1000" in err["message"]
        # No Content-Length (a chunked upload): counted while it is read.
        err = error_of(c.post("/v1/embeddings", headers=AUTH, content=iter([body[:600], body[600:]])), 413)
        assert err["code"] == "request_too_large"
        # Just under the limit passes the gate (then 503: Triton is down).
        small = json.dumps({"model": "text_embedding", "input": "x" * 900}).encode()
        assert len(small) <= 1000
        assert c.post("/v1/embeddings", headers=AUTH, content=small).status_code == 503


def test_invalid_json_is_400(client):
    err = error_of(
        client.post(
            "/v1/embeddings",
            headers={**AUTH, "Content-Type": "application/json"},
            content=b'{"model": "text_embedding", "input": ',
        ),
        400,
    )
    assert err["code"] == "invalid_json"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"model": "text_embedding"}, "input"),
        ("/v1/embeddings", {"input": "hi"}, "model"),
        ("/v1/embeddings", {"model": "text_embedding", "input": 5}, "input"),
        ("/v1/embeddings", {"model": "text_embedding", "input": ["a", 1]}, "input"),
        ("/v1/embeddings", {"model": "text_embedding", "input": "a", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"model": "text_embedding", "input": "a", "dimensions": "384"}, "dimensions"),
        ("/v1/chat/completions", {"model": "text_generation"}, "messages"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "4"}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
        ("/v1/completions", {"model": "text_generation", "prompt": 5}, "prompt"),
        ("/v1/embeddings", [1, 2], None),
    ],
)
def test_schema_violations_are_422_naming_the_field(client, path, body, param):
    err = error_of(client.post(path, headers=AUTH, json=body), 422)
    assert err["code"] == "invalid_request"
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err


def test_a_form_content_type_is_read_as_json(client):
    # curl -d sends application/x-www-form-urlencoded.
    r = client.post(
        "/v1/embeddings",
        headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
        content=json.dumps({"model": "text_embedding", "input": []}).encode(),
    )
    assert error_of(r, 400)["param"] == "input"


# --- models and request checks before readiness -----------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/embeddings", {"model": "gpt-4o", "input": "hi"}),
        ("/v1/embeddings", {"model": "text_generation", "input": "hi"}),
        ("/v1/embeddings", {"model": "text_embedding_cached", "input": "hi"}),
        ("/v1/chat/completions", {**CHAT, "model": "text_embedding"}),
        ("/v1/completions", {"model": "sentence-transformers/all-MiniLM-L6-v2", "prompt": "hi"}),
    ],
)
def test_an_unknown_model_is_404(client, path, body):
    err = error_of(client.post(path, headers=AUTH, json=body), 404)
    assert (err["type"], err["param"], err["code"]) == ("not_found_error", "model", "model_not_found")


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/embeddings", {"model": "text_embedding", "input": []}, 400, "input"),
        ("/v1/embeddings", {"model": "text_embedding", "input": "hi", "dimensions": 128}, 400, "dimensions"),
        ("/v1/embeddings", {"model": "text_embedding", "input": [[1] * 300]}, 400, "input[0]"),
        ("/v1/embeddings", {"model": "text_embedding", "input": ["a"] * 2049}, 413, "input"),
        ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, 400, "temperature"),
        ("/v1/completions", {"model": "text_generation", "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ],
)
def test_request_checks_answer_while_triton_is_down(client, path, body, status, param):
    assert error_of(client.post(path, headers=AUTH, json=body), status)["param"] == param


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/embeddings", EMBED),
        ("/v1/embeddings", {"model": "sentence-transformers/all-MiniLM-L6-v2", "input": [[101, 102]]}),
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/completions", {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "prompt": "Once"}),
    ],
)
def test_valid_requests_are_503_while_triton_is_down(client, path, body):
    r = client.post(path, headers=AUTH, json=body)
    err = error_of(r, 503)
    assert (err["type"], err["code"]) == ("service_unavailable", "triton_unavailable")
    assert r.headers["retry-after"] == "1"


def test_models_list_is_503_while_triton_is_down(client):
    assert error_of(client.get("/v1/models", headers=AUTH), 503)["code"] == "triton_unavailable"
    for model in ("text_embedding", "HuggingFaceTB/SmolLM2-135M-Instruct", "no-such-model"):
        r = client.get(f"/v1/models/{model}", headers=AUTH)
        assert error_of(r, 503)["code"] == "triton_unavailable" and r.headers["retry-after"] == "1"


def test_unknown_paths_and_methods_get_openai_errors(client):
    error_of(client.get("/v1/nothing", headers=AUTH), 404)
    error_of(client.get("/nothing"), 404)
    error_of(client.get("/v1/embeddings", headers=AUTH), 405)


# --- rate limit ----------------------------------------------------------------------------


def test_rate_limit_is_429_with_retry_after():
    with TestClient(create_app(_settings(rate_limit_rps=0.01, rate_limit_burst=2), ApiKeys([KEY]))) as c:
        assert [c.get("/v1/models", headers=AUTH).status_code for _ in range(2)] == [503, 503]
        r = c.get("/v1/models", headers=AUTH)
        err = error_of(r, 429)
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert r.headers["retry-after"] == "100"  # 1 token at 0.01/s
        assert c.get("/health").status_code == 200  # not limited
        metrics = c.get("/metrics").text
        assert metric_sum(metrics, "gateway_rate_limited_total", series=True, key_id=key_id(KEY)) == 1


# --- request ids, logs -----------------------------------------------------------------------


def test_a_request_id_is_echoed_or_made(client):
    r = client.get("/health", headers={"X-Request-Id": "trace-42.a:b"})
    assert r.headers["x-request-id"] == "trace-42.a:b"
    r = client.get("/v1/models", headers={"X-Request-Id": "abc-123"})  # a 401 has it too
    assert (r.status_code, r.headers["x-request-id"]) == (401, "abc-123")
    for bad in ("has space", "x" * 65, "semi;colon", ""):
        made = client.get("/health", headers={"X-Request-Id": bad}).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", made), made
    ids = {client.get("/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3


def test_one_log_line_per_request_with_the_key_id_never_the_key(client, caplog):
    caplog.set_level(logging.INFO, logger="openai_gateway.access")
    client.post("/v1/embeddings", headers={**AUTH, "X-Request-Id": "log-1"}, json={"model": "text_embedding", "input": []})
    client.post(
        "/v1/embeddings", headers={"Authorization": "Bearer sk-triton-wrong-key-000000000", "X-Request-Id": "log-2"}, json=EMBED
    )
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "openai_gateway.access"]
    assert [line["request_id"] for line in lines] == ["log-1", "log-2"]
    first, second = lines
    assert (first["status"], first["key_id"], first["path"], first["method"]) == (400, key_id(KEY), "/v1/embeddings", "POST")
    assert first["model"] == "text_embedding" and first["error"] == "invalid_request_error"
    assert (second["status"], second["key_id"]) == (401, "-")
    assert all(isinstance(line["ms"], float) for line in lines)
    text = caplog.text
    assert KEY not in text and "sk-triton-wrong-key" not in text


# --- CORS ----------------------------------------------------------------------------------

PREFLIGHT = {
    "Origin": "https://app.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


def test_cors_is_off_by_default(client):
    r = client.options("/v1/embeddings", headers=PREFLIGHT)
    assert not any(h.startswith("access-control-") for h in r.headers)
    r = client.get("/health", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_allows_the_configured_origins_only():
    with TestClient(create_app(_settings(cors_origins=("https://app.example",)), ApiKeys([KEY]))) as c:
        r = c.options("/v1/embeddings", headers=PREFLIGHT)  # a preflight needs no key
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.post("/v1/embeddings", headers={**AUTH, "Origin": "https://app.example"}, json=EMBED)
        assert r.status_code == 503 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()

        r = c.options("/v1/embeddings", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"
        r = c.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
