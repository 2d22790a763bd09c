"""The served models are what the README promises."""

import numpy as np
import tritonclient.http as httpclient


def test_ensemble_metadata(http_client):
    meta = http_client.get_model_metadata("text_embedding")
    assert meta["inputs"] == [
        {"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]},
        # optional: a text over 256 tokens is refused unless the request says how to truncate it
        {"name": "TRUNCATE", "datatype": "BOOL", "shape": [-1, 1]},
        {"name": "TRUNCATION_DIRECTION", "datatype": "BYTES", "shape": [-1, 1]},
    ]
    # The steady-state form: no router, no ENCODER_VERSION (a rollout adds both: docs/versions-and-rollout.md).
    assert meta["outputs"] == [
        {"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 384]},
        {"name": "NUM_TOKENS", "datatype": "INT32", "shape": [-1, 1]},
    ]
    config = http_client.get_model_config("text_embedding")
    assert config["max_batch_size"] >= 64


def test_every_composing_model_batches_without_priority_levels(http_client):
    # Priority levels and queue policies stall tritonserver 2.51's batcher (docs/performance.md).
    from ops.configs import config_from_disk
    from server.layout import ROOT

    for name in ("text_tokenizer", "text_encoder_router", "text_encoder"):
        # The router is loaded during rollouts only: its config as the repository holds it.
        config = (
            config_from_disk(ROOT / "model_repository", name, None)
            if name == "text_encoder_router"
            else http_client.get_model_config(name)
        )
        batching = config["dynamic_batching"]
        assert int(batching.get("priority_levels", 0)) == 0 and "default_queue_policy" not in batching, name
        assert config["max_batch_size"] >= 64, name


def test_priority_request(http_client):
    inp = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[b"urgent"]], dtype=object))
    out = http_client.infer("text_embedding", [inp], priority=1).as_numpy("EMBEDDING")
    assert out.shape == (1, 384)


def test_encoder_runs_on_the_project_backend_without_spinning(triton):
    log = triton.log_path.read_text()
    assert "text_encoder: model.onnx on CPUExecutionProvider" in log


def test_curl_style_json_request(triton):
    import json
    import urllib.request

    body = json.dumps({"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "data": ["hello", "world"]}]})
    req = urllib.request.Request(f"http://{triton.http_url}/v2/models/text_embedding/infer", data=body.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        out = json.loads(r.read())
    outputs = {o["name"]: o for o in out["outputs"]}
    emb = np.array(outputs["EMBEDDING"]["data"], dtype=np.float32).reshape(outputs["EMBEDDING"]["shape"])
    assert emb.shape == (2, 384)
    assert set(outputs) == {"EMBEDDING", "NUM_TOKENS"}  # ENCODER_VERSION only while a rollout routes
    assert outputs["NUM_TOKENS"]["data"] == [3, 3]  # [CLS] hello [SEP]
