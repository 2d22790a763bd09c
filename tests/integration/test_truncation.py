"""Truncation as the caller chooses, through the real tritonserver (docs/embeddings.md#truncation):
a text over 256 tokens is refused by default with INVALID_ARG (HTTP 400) naming TEXT[i], its
count and the limit; TRUNCATE=true keeps its first tokens, TRUNCATION_DIRECTION=left its last
ones; on the ensemble and the cached entry alike, over HTTP (the front door) and gRPC (the door)."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from contract.errors import CONTEXT_LENGTH, INVALID, MARK, error_data
from server.layout import ROOT

MODELS = ("text_embedding", "text_embedding_cached")
LONG = "the beginning of a long text " + " ".join(f"word{i}" for i in range(300)) + " and its own ending"
SHORT = "a short text that fits"


@pytest.fixture(scope="module")
def data_client(triton):
    """tritonclient.http as the project's clients open it: an error body's data keys kept."""
    from clients.transport import triton_client

    client = triton_client("http", triton.http_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def whole_count():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "model_repository" / "text_tokenizer" / "1" / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return lambda text: len(tok.encode(text).ids)


def inputs(module, texts, truncate=None, direction=None):
    data = np.array([[t.encode()] for t in texts], dtype=object)
    text = module.InferInput("TEXT", list(data.shape), "BYTES")
    text.set_data_from_numpy(data)
    out = [text]
    if truncate is not None:
        flag = module.InferInput("TRUNCATE", list(data.shape), "BOOL")
        flag.set_data_from_numpy(np.full(data.shape, truncate, dtype=np.bool_))
        out.append(flag)
    if direction is not None:
        way = module.InferInput("TRUNCATION_DIRECTION", list(data.shape), "BYTES")
        way.set_data_from_numpy(np.full(data.shape, direction.encode(), dtype=object))
        out.append(way)
    return out


def embed(client, model, texts, truncate=None, direction=None):
    result = client.infer(model, inputs(httpclient, texts, truncate, direction))
    return result.as_numpy("EMBEDDING"), result.as_numpy("NUM_TOKENS").reshape(-1)


def refusal(client, model, texts, truncate=None, direction=None) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, inputs(httpclient, texts, truncate, direction))
    return caught.value


@pytest.mark.parametrize("model", MODELS)
def test_a_text_over_the_limit_is_refused_by_default_naming_the_field_its_count_and_the_limit(data_client, model, whole_count):
    n = whole_count(LONG)
    assert n > 256
    for truncate in (None, False):  # absent and false alike
        err = refusal(data_client, model, [SHORT, LONG], truncate)
        assert err.status() == "400" and MARK not in err.message(), err
        data = error_data(err)  # the front door's body keys
        assert data is not None and (data.code, data.field) == (CONTEXT_LENGTH, "TEXT[1]"), err.message()
        assert data.values == {"index": 1, "tokens": n, "limit": 256}
        assert f"TEXT[1]: text has {n} tokens; the model's limit is 256 tokens" in err.message()
        assert "TRUNCATE=true" in err.message()


@pytest.mark.parametrize("model", MODELS)
def test_right_and_left_differ_for_a_long_text_and_agree_for_a_short_one(http_client, model, whole_count):
    right, right_counts = embed(http_client, model, [LONG, SHORT], True)
    explicit, _ = embed(http_client, model, [LONG, SHORT], True, "right")
    left, left_counts = embed(http_client, model, [LONG, SHORT], True, "Left")  # TEI's spelling
    assert right_counts.tolist() == left_counts.tolist() == [whole_count(LONG), whole_count(SHORT)]
    assert np.array_equal(right, explicit)
    assert float(right[0] @ left[0]) < 0.99  # different ends of the text, different vectors
    np.testing.assert_allclose(right[1], left[1], atol=1e-5)
    short_default, _ = embed(http_client, model, [SHORT])
    np.testing.assert_allclose(short_default[0], right[1], atol=1e-5)
    # Left keeps the last tokens: the text with another beginning gets the same left vector.
    other = "a different opening " * 5 + LONG
    other_left, _ = embed(http_client, model, [other], True, "left")
    np.testing.assert_allclose(other_left[0], left[0], atol=1e-5)
    # Right keeps the first: the text with another ending gets the same right vector.
    other_right, _ = embed(http_client, model, [LONG + " a different ending" * 5], True)
    np.testing.assert_allclose(other_right[0], right[0], atol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_a_bad_direction_is_400_naming_the_field_and_the_allowed_values(data_client, model):
    err = refusal(data_client, model, [SHORT], True, "middle")
    data = error_data(err)
    assert err.status() == "400" and data is not None and (data.code, data.field) == (INVALID, "TRUNCATION_DIRECTION[0]")
    assert "must be one of right, left" in err.message() and data.values["allowed"] == ["right", "left"]


@pytest.mark.parametrize("model", MODELS)
def test_neighbours_of_a_refused_request_are_answered(http_client, model):
    texts = [f"neighbour {i} of {model}" for i in range(12)]
    pending = []
    for i, text in enumerate(texts):
        batch = [LONG + f" {i}"] if i % 3 == 0 else [text]
        pending.append((i, http_client.async_infer(model, inputs(httpclient, batch))))
    for i, p in pending:
        if i % 3 == 0:
            with pytest.raises(InferenceServerException) as caught:
                p.get_result()
            assert caught.value.status() == "400" and "TEXT[0]" in caught.value.message()
        else:
            assert p.get_result().as_numpy("EMBEDDING").shape == (1, 384)


@pytest.mark.parametrize("model", MODELS)
def test_grpc_carries_the_choice_through_the_door(grpc_client, model, whole_count):
    result = grpc_client.infer(model, inputs(grpcclient, [LONG], True, "left"))
    assert result.as_numpy("NUM_TOKENS").reshape(-1).tolist() == [whole_count(LONG)]
    with pytest.raises(InferenceServerException) as caught:
        grpc_client.infer(model, inputs(grpcclient, [LONG]))
    assert "StatusCode.INVALID_ARGUMENT" in str(caught.value.status()) and MARK not in caught.value.message()
    data = error_data(caught.value)  # the gRPC door's error-data trailing metadata
    assert data is not None and data.code == CONTEXT_LENGTH and data.field == "TEXT[0]"
