"""Bad input gets a clear error for that request only; the server and other requests carry on."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from export import reference

GOOD = "The server keeps answering good requests."


def _text_input(module, values, dtype="BYTES"):
    data = np.array(values, dtype=object) if dtype == "BYTES" else np.array(values)
    inp = module.InferInput("TEXT", list(data.shape), dtype)
    inp.set_data_from_numpy(data)
    return inp


def _error(client, module, inputs, model="text_embedding", version=""):
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs, model_version=version)
    return str(info.value)


@pytest.fixture(params=["http", "grpc"])
def proto(request, http_client, grpc_client):
    return (http_client, httpclient) if request.param == "http" else (grpc_client, grpcclient)


@pytest.mark.parametrize(
    "value, message",
    [
        (b"", "TEXT[0]: text is empty"),
        (b" \t\n ", "TEXT[0]: text contains only whitespace"),
        (b"caf\xe9", "TEXT[0]: not valid UTF-8 (byte 0xe9 at offset 3)"),
        (b"x" * 70000, "TEXT[0]: text is 70000 bytes; the limit is 65536 bytes"),
    ],
    ids=["empty", "whitespace", "non-utf8", "too-long"],
)
def test_bad_text(proto, value, message):
    client, module = proto
    assert message in _error(client, module, [_text_input(module, [[value]])])


def test_bad_element_is_named_in_a_multi_text_request(proto):
    client, module = proto
    msg = _error(client, module, [_text_input(module, [[b"fine"], [b"also fine"], [b""]])])
    assert "TEXT[2]: text is empty" in msg


def test_wrong_dtype(proto):
    client, module = proto
    msg = _error(client, module, [_text_input(module, np.array([[1]], dtype=np.int32), dtype="INT32")])
    assert "TEXT" in msg and "BYTES" in msg and "INT32" in msg


def test_wrong_shape(proto):
    client, module = proto
    msg = _error(client, module, [_text_input(module, [[b"a", b"b"]])])
    assert "TEXT" in msg and "shape" in msg.lower()


def test_batch_above_max_batch_size(proto):
    client, module = proto
    msg = _error(client, module, [_text_input(module, [[b"text"]] * 65)])
    # Over HTTP the front door refuses it before Triton; over gRPC Triton's own check does.
    assert "max_batch_size 64" in msg or "batch-size must be <= 64" in msg, msg


def test_missing_input(proto):
    client, module = proto
    inp = module.InferInput("NOT_TEXT", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[b"x"]], dtype=object))
    assert "NOT_TEXT" in _error(client, module, [inp])


def test_unknown_model(proto):
    client, module = proto
    msg = _error(client, module, [_text_input(module, [[b"x"]])], model="no_such_model")
    assert "no_such_model" in msg


def test_unknown_version(proto):
    client, module = proto
    msg = _error(client, module, [_text_input(module, [[b"x"]])], version="7")
    assert "text_embedding" in msg and "7" in msg


def test_bad_requests_do_not_fail_the_good_ones_batched_with_them(http_client):
    """Good and bad requests in flight together: every good one succeeds with the right vector."""
    expected = reference.embed([GOOD])[0]
    bad_values = [b"", b"   ", b"\xff\xfe", b"x" * 70000]
    jobs = []
    for i in range(32):
        value = bad_values[i % len(bad_values)] if i % 3 == 0 else GOOD.encode()
        inp = _text_input(httpclient, [[value]])
        jobs.append((i % 3 == 0, http_client.async_infer("text_embedding", [inp])))
    good = bad = 0
    for is_bad, job in jobs:
        if is_bad:
            with pytest.raises(InferenceServerException, match="TEXT\\[0\\]"):
                job.get_result()
            bad += 1
        else:
            got = job.get_result().as_numpy("EMBEDDING")[0]
            assert reference.cosine_rows(got[None], expected[None])[0] >= 0.9999
            good += 1
    assert good == 21 and bad == 11


def test_encoder_isolates_a_bad_request_in_its_batch(http_client):
    """Direct calls to text_encoder: an out-of-vocabulary id fails only its own request."""

    def inputs(ids):
        ids = np.array([ids], dtype=np.int64)
        a = httpclient.InferInput("input_ids", list(ids.shape), "INT64")
        a.set_data_from_numpy(ids)
        m = httpclient.InferInput("attention_mask", list(ids.shape), "INT64")
        m.set_data_from_numpy(np.ones_like(ids))
        return [a, m]

    good_ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    # In flight together so the encoder's dynamic batcher puts them in one batch.
    jobs = [http_client.async_infer("text_encoder", inputs([101, 10**7, 2088, 102] if i == 3 else good_ids)) for i in range(8)]
    with pytest.raises(InferenceServerException):
        jobs[3].get_result()
    expected = http_client.infer("text_encoder", inputs(good_ids)).as_numpy("sentence_embedding")
    for i, job in enumerate(jobs):
        if i != 3:
            np.testing.assert_allclose(job.get_result().as_numpy("sentence_embedding"), expected, atol=1e-5)


def test_server_still_healthy_after_bad_input(http_client):
    assert http_client.is_server_live() and http_client.is_server_ready()
    assert http_client.is_model_ready("text_embedding")
