"""PRECISION=auto on this CPU serves each model's best gated variant, and it keeps its gate served."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from export import reference, variants
from export.texts import heldout_texts
from server.deployment import Deployment, DeploymentOptions

REPO = variants.GATES_FILE.parent.parent / "model_repository"


def _serve_auto(variant_model: str, served_model: str, prefix: str):
    """A server of ``served_model`` with PRECISION=auto as the launcher resolves it; yields (server, served)."""
    if not variants.manifest_path(REPO, variant_model).is_file():
        pytest.skip(f"no gated variants of {variant_model}: run `python -m export` (make test does)")
    config_name, served = variants.resolve_precision(REPO, [variant_model], "auto", gpu=False)
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    deployment = Deployment(
        DeploymentOptions.with_free_ports(workdir=workdir, models=(served_model,), model_config_name=config_name)
    )
    try:
        with deployment:
            yield deployment, served
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def cpu_server():
    yield from _serve_auto("text_encoder", "text_embedding", "triton-precision-")


def test_auto_serves_the_best_cpu_variant_that_passed(cpu_server):
    server, served = cpu_server
    manifest = variants.read_manifest(REPO, "text_encoder")
    assert served["text_encoder"] == manifest["best"]["cpu"]
    assert manifest["variants"][served["text_encoder"]]["status"] == "passed"
    client = httpclient.InferenceServerClient(server.http_url)
    config = client.get_model_config("text_encoder")
    expected_file = variants.VARIANTS[served["text_encoder"]].filename
    assert config.get("default_model_filename", "model.onnx") == expected_file
    runtime = "OpenVINO CPU" if served["text_encoder"] == "openvino" else "CPUExecutionProvider"
    assert config["backend"] == ("openvino" if served["text_encoder"] == "openvino" else "onnxruntime")
    assert f"text_encoder: {expected_file} on {runtime}" in server.log_path.read_text()


def test_served_variant_meets_its_gate_end_to_end(cpu_server):
    """Through the whole ensemble (our tokenizer, the served variant with its pooling) on the held-out texts."""
    server, served = cpu_server
    gate = variants.load_gates()["text_encoder"].get(served["text_encoder"], {"min_cosine": 0.9999})
    texts = heldout_texts()
    client = httpclient.InferenceServerClient(server.http_url)
    got = []
    for start in range(0, len(texts), 32):
        chunk = np.array([[t.encode()] for t in texts[start : start + 32]], dtype=object)
        inp = httpclient.InferInput("TEXT", list(chunk.shape), "BYTES")
        inp.set_data_from_numpy(chunk)
        # Some held-out texts are over 256 tokens; the reference cuts them there (docs/embeddings.md#truncation).
        flag = httpclient.InferInput("TRUNCATE", list(chunk.shape), "BOOL")
        flag.set_data_from_numpy(np.ones(chunk.shape, dtype=np.bool_))
        got.append(client.infer("text_embedding", [inp, flag]).as_numpy("EMBEDDING"))
    cos = reference.cosine_rows(np.concatenate(got), reference.embed(texts))
    print(f"\nserved {served['text_encoder']}: min cosine {cos.min():.6f}, mean {cos.mean():.6f} over {len(texts)} texts")
    assert cos.min() >= gate["min_cosine"]


@pytest.fixture(scope="module")
def generation_server():
    for server, served in _serve_auto("text_generation", "text_generation", "triton-precision-generation-"):
        yield server, served["text_generation"]


def test_auto_serves_the_generation_variant_that_passed_and_it_answers(generation_server):
    """PRECISION=auto serves text_generation in the best weights precision gated on this CPU."""
    import json
    import urllib.request

    server, precision = generation_server
    manifest = variants.read_manifest(REPO, "text_generation")
    assert precision == manifest["best"]["cpu"] and manifest["variants"][precision]["status"] == "passed"
    client = httpclient.InferenceServerClient(server.http_url)
    params = {p: v["string_value"] for p, v in client.get_model_config("text_generation")["parameters"].items()}
    assert params["weights_precision"] == precision
    assert f"generation engine: weights {precision} " in server.log_path.read_text()
    body = json.dumps(
        {
            "text_input": json.dumps([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]),
            "apply_chat_template": True,
            "exclude_input_in_output": True,
            "parameters": {"temperature": 0, "max_tokens": 12},
        }
    ).encode()
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/text_generation/generate", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())["text_output"]
    assert answer.strip() == "The capital of France is Paris."
