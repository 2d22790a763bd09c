"""Served embeddings equal the PyTorch reference (transformers + masked mean + L2 norm)."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from export import reference
from export.texts import reference_texts

MIN_COSINE = 0.9999
TEXTS = reference_texts()


@pytest.fixture(scope="module")
def expected():
    return reference.embed(TEXTS)


def _infer(client, module, texts, truncate=True):
    data = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
    inp = module.InferInput("TEXT", list(data.shape), "BYTES")
    inp.set_data_from_numpy(data)
    inputs = [inp]
    # The reference cuts at 256 tokens as the model was trained, and some texts are longer: a text
    # over the limit is refused unless the request says TRUNCATE (docs/embeddings.md#truncation).
    if truncate:
        flag = module.InferInput("TRUNCATE", list(data.shape), "BOOL")
        flag.set_data_from_numpy(np.ones(data.shape, dtype=np.bool_))
        inputs.append(flag)
    result = client.infer("text_embedding", inputs, outputs=[module.InferRequestedOutput("EMBEDDING")])
    return result.as_numpy("EMBEDDING")


def _check(got, expected, label):
    assert got.shape == expected.shape and got.dtype == np.float32
    cos = reference.cosine_rows(got, expected)
    worst = int(np.argmin(cos))
    print(
        f"\n{label}: min cosine {cos.min():.9f} (text {worst}), mean {cos.mean():.9f}, "
        f"max |norm-1| {np.abs(np.linalg.norm(got, axis=1) - 1).max():.1e}"
    )
    assert cos.min() >= MIN_COSINE, f"text {worst} {TEXTS[worst][:60]!r}: cosine {cos[worst]:.6f} < {MIN_COSINE}"
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_one_text_per_request(protocol, expected, http_client, grpc_client):
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    got = np.concatenate([_infer(client, module, [t]) for t in TEXTS])
    _check(got, expected, f"{protocol}, one text per request")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_many_texts_per_request(protocol, expected, http_client, grpc_client):
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    got = _infer(client, module, TEXTS)
    _check(got, expected, f"{protocol}, {len(TEXTS)} texts in one request")


def test_concurrent_requests_batched_together(expected, http_client):
    """Many in flight at once: the dynamic batcher merges them; results must not mix up."""
    data = [np.array([[t.encode("utf-8")]], dtype=object) for t in TEXTS]
    pending = []
    for d in data:
        inp = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        inp.set_data_from_numpy(d)
        flag = httpclient.InferInput("TRUNCATE", [1, 1], "BOOL")  # some reference texts are over 256 tokens
        flag.set_data_from_numpy(np.ones((1, 1), dtype=np.bool_))
        pending.append(http_client.async_infer("text_embedding", [inp, flag]))
    got = np.concatenate([p.get_result().as_numpy("EMBEDDING") for p in pending])
    _check(got, expected, "http, concurrent single-text requests")


def test_truncation_matches_reference_at_256_tokens(http_client):
    long_a = "alpha beta gamma " * 200
    long_b = long_a + " completely different ending that lies beyond token 256"
    got = _infer(http_client, httpclient, [long_a, long_b])
    np.testing.assert_allclose(got[0], got[1], atol=1e-6)
