"""perf.baselines.naive_server without a network: FastAPI's TestClient against the app with the real model.

The naive server must answer the KServe v2 requests perf_analyzer sends (JSON and binary
tensor bodies) with the reference embeddings, and refuse malformed ones with 400 and a
message that says what is wrong.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from fastapi.testclient import TestClient

from export import reference
from perf.baselines import naive_server as ns

INFER = "/v2/models/text_embedding/infer"
TEXTS = [
    "The train to Edinburgh was delayed forty minutes because of a signal failure.",
    "Kurz.",
    "Les enfants jouent dans le parc après l'école.",
]


@pytest.fixture(scope="module")
def client():
    app = ns.create_app(threads=2)
    with TestClient(app) as c:
        yield c


def json_request(texts, **extra) -> dict:
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [len(texts), 1], "data": list(texts)}]}
    body.update(extra)
    return body


def binary_request(texts: list[str]) -> tuple[bytes, dict[str, str]]:
    """A request as perf_analyzer's HTTP client sends it: JSON header, then length-prefixed BYTES."""
    blob = b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)
    header = json.dumps(
        {
            "id": "",
            "inputs": [
                {"name": "TEXT", "datatype": "BYTES", "shape": [len(texts), 1], "parameters": {"binary_data_size": len(blob)}}
            ],
            "outputs": [{"name": "EMBEDDING", "parameters": {"binary_data": True}}],
        }
    ).encode()
    headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
    return header + blob, headers


def test_json_request_matches_the_pytorch_reference(client):
    r = client.post(INFER, json=json_request(TEXTS, id="abc"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == "text_embedding" and body["id"] == "abc"
    (out,) = body["outputs"]
    assert out["name"] == "EMBEDDING" and out["datatype"] == "FP32" and out["shape"] == [3, 384]
    got = np.asarray(out["data"], dtype=np.float32).reshape(3, 384)
    expected = reference.embed(TEXTS)
    cos = reference.cosine_rows(got, expected)
    assert cos.min() > 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_binary_request_and_response_as_perf_analyzer_sends_them(client):
    body, headers = binary_request(TEXTS[:1])
    r = client.post(INFER, content=body, headers=headers)
    assert r.status_code == 200, r.text
    json_length = int(r.headers["Inference-Header-Content-Length"])
    header = json.loads(r.content[:json_length])
    (out,) = header["outputs"]
    assert out["shape"] == [1, 384] and out["parameters"]["binary_data_size"] == 384 * 4
    got = np.frombuffer(r.content[json_length:], dtype="<f4").reshape(1, 384)
    assert reference.cosine_rows(got, reference.embed(TEXTS[:1]))[0] > 0.9999


def test_metadata_config_health_and_statistics(client):
    assert client.get("/v2/health/ready").status_code == 200
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/models/text_embedding/ready").status_code == 200
    meta = client.get("/v2/models/text_embedding").json()
    assert meta["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]}]
    assert meta["outputs"] == [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 384]}]
    config = client.get("/v2/models/text_embedding/config").json()
    assert config["max_batch_size"] == 64 and config["input"][0]["data_type"] == "TYPE_STRING"
    assert client.get("/v2/models/other").status_code == 404

    before = client.get("/v2/models/text_embedding/stats").json()["model_stats"][0]
    assert client.post(INFER, json=json_request(TEXTS[:2])).status_code == 200
    after = client.get("/v2/models/stats").json()["model_stats"][0]
    assert after["inference_count"] == before["inference_count"] + 2
    assert after["execution_count"] == before["execution_count"] + 1
    success = after["inference_stats"]["success"]
    assert success["count"] == before["inference_stats"]["success"]["count"] + 1
    assert after["inference_stats"]["compute_infer"]["ns"] > before["inference_stats"]["compute_infer"]["ns"]


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps({"outputs": []}).encode(), "non-empty 'inputs'"),
        (
            json.dumps({"inputs": [{"name": "IDS", "datatype": "BYTES", "shape": [1, 1], "data": ["x"]}]}).encode(),
            "unexpected input 'IDS'",
        ),
        (
            json.dumps({"inputs": [{"name": "TEXT", "datatype": "INT64", "shape": [1, 1], "data": [1]}]}).encode(),
            "datatype BYTES",
        ),
        (json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}).encode(), "shape [n, 1]"),
        (
            json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2, 1], "data": ["x"]}]}).encode(),
            "needs 2 elements, got 1",
        ),
        (
            json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [65, 1], "data": ["x"] * 65}]}).encode(),
            "between 1 and 64",
        ),
        (
            json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1]}]}).encode(),
            "neither 'data' nor binary_data_size",
        ),
        (
            json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [3]}]}).encode(),
            "must be strings",
        ),
        (json.dumps(json_request(["   "])).encode(), "TEXT[0]: text contains only whitespace"),
        (json.dumps(json_request(["ok", ""])).encode(), "TEXT[1]: text is empty"),
        (json.dumps(json_request(["ok"], outputs=[{"name": "LOGITS"}])).encode(), "unknown output 'LOGITS'"),
    ],
)
def test_malformed_json_bodies_get_400_with_a_clear_message(client, body, message):
    r = client.post(INFER, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert message in r.json()["error"]


def test_malformed_binary_bodies_get_400(client):
    body, headers = binary_request(["hello"])
    r = client.post(INFER, content=body[:-2], headers=headers)  # the data is shorter than declared
    assert r.status_code == 400 and "does not fit the binary data" in r.json()["error"]
    r = client.post(INFER, content=body, headers={**headers, "Inference-Header-Content-Length": "many"})
    assert r.status_code == 400 and "must be an integer" in r.json()["error"]
    r = client.post(INFER, content=body, headers={**headers, "Inference-Header-Content-Length": str(len(body) + 1)})
    assert r.status_code == 400 and "does not fit a body" in r.json()["error"]
    # An element length that runs past the tensor's bytes.
    header = json.dumps(
        {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": 6}}]}
    ).encode()
    r = client.post(
        INFER, content=header + struct.pack("<I", 50) + b"hi", headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert r.status_code == 400 and "runs past the end" in r.json()["error"]
    # Not UTF-8.
    blob = struct.pack("<I", 2) + b"\xff\xfe"
    header = json.dumps(
        {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": len(blob)}}]}
    ).encode()
    r = client.post(INFER, content=header + blob, headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]


def test_unknown_model_or_version_is_404(client):
    assert client.post("/v2/models/other/infer", json=json_request(["x"])).status_code == 404
    assert client.post("/v2/models/text_embedding/versions/7/infer", json=json_request(["x"])).status_code == 404
    r = client.post("/v2/models/text_embedding/versions/1/infer", json=json_request(["x"]))
    assert r.status_code == 200
