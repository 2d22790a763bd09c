import numpy as np
import pytest

from export.reference import model_dir
from export.reference import tokenize as hf_tokenize
from python_backends.errors import ConfigError, InputError
from python_backends.text.tokenization import BatchTokenizer, bucket_length, decode_texts

TOKENIZER_JSON = model_dir() / "tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    return BatchTokenizer(TOKENIZER_JSON, max_length=256, buckets=(16, 32, 64, 128, 256))


def test_decode_accepts_bytes_and_str():
    values = np.array([[b"hello"], ["w\xf6rld"]], dtype=object)
    assert decode_texts(values, "TEXT", 100) == ["hello", "wörld"]


@pytest.mark.parametrize(
    "value, message",
    [
        (b"", r"TEXT\[1\]: text is empty"),
        (b"  \t\n", r"TEXT\[1\]: text contains only whitespace"),
        (b"ok \xff\xfe", r"TEXT\[1\]: not valid UTF-8 \(byte 0xff at offset 3\)"),
        (b"x" * 101, r"TEXT\[1\]: text is 101 bytes; the limit is 100 bytes"),
        (12, r"TEXT\[1\]: expected a UTF-8 string, got int"),
    ],
)
def test_decode_rejects_with_field_and_reason(value, message):
    with pytest.raises(InputError, match=message):
        decode_texts(np.array([b"fine", value], dtype=object), "TEXT", 100)


def test_bucket_length():
    buckets = [16, 32, 64, 128, 256]
    assert [bucket_length(n, buckets) for n in (1, 16, 17, 64, 200, 256, 300)] == [16, 16, 32, 64, 256, 256, 256]


def test_pads_to_bucket_of_longest(tok):
    batch = tok.encode(["hi", "a somewhat longer sentence with more than a few tokens in it, really"])
    assert batch.input_ids.shape == (2, 32)
    assert batch.input_ids.dtype == np.int64 and batch.attention_mask.dtype == np.int64
    assert batch.lengths[0] == 3  # [CLS] hi [SEP]
    assert batch.attention_mask[0].sum() == 3 and batch.input_ids[0, 3:].max() == 0


def test_truncates_at_max_length(tok):
    batch = tok.encode(["word " * 1000])
    assert batch.input_ids.shape == (1, 256)
    assert batch.attention_mask.all()
    assert batch.input_ids[0, -1] == tok._tok.token_to_id("[SEP]")


def test_same_ids_as_transformers_tokenizer(tok):
    from export.texts import reference_texts

    texts = reference_texts()
    ours = tok.encode(texts)
    ids, mask = hf_tokenize(texts)
    width = ids.shape[1]
    np.testing.assert_array_equal(ours.input_ids[:, :width], ids)
    np.testing.assert_array_equal(ours.attention_mask[:, :width], mask)
    assert not ours.attention_mask[:, width:].any()


def test_config_errors():
    with pytest.raises(ConfigError, match="tokenizer file not found"):
        BatchTokenizer("/nonexistent/tokenizer.json", 256)
    with pytest.raises(ConfigError, match="largest sequence bucket"):
        BatchTokenizer(TOKENIZER_JSON, 256, buckets=(16, 128))


def test_an_unexpected_tokenizer_error_fails_only_the_request_that_caused_it(tok):
    from python_backends.text.tokenization import encode_isolated

    calls = []

    def encode(texts):
        calls.append(list(texts))
        if "poison" in texts:
            raise RuntimeError("tokenizer broke on this text")
        return tok.encode(texts)

    texts = ["first request", "poison", "second request, two texts", "a much longer text " * 5, "third"]
    spans = [(0, 1), (1, 2), (2, 4), (4, 5)]
    out = encode_isolated(encode, texts, spans)
    assert len(out) == 4
    assert isinstance(out[1], RuntimeError) and "broke" in str(out[1])
    for (a, b), got in zip(spans, out):
        if isinstance(got, Exception):
            continue
        alone = tok.encode(texts[a:b])  # each retried request is padded to its own bucket
        np.testing.assert_array_equal(got.input_ids, alone.input_ids)
        np.testing.assert_array_equal(got.attention_mask, alone.attention_mask)
    assert calls[0] == texts and len(calls) == 1 + len(spans)  # one batched call, then one per request


def test_a_good_batch_is_one_call_sliced_per_request(tok):
    texts = ["one", "two words", "three words here"]
    out = tok.encode_requests(texts, [(0, 2), (2, 3)])
    whole = tok.encode(texts)
    np.testing.assert_array_equal(out[0].input_ids, whole.input_ids[:2])
    np.testing.assert_array_equal(out[1].attention_mask, whole.attention_mask[2:])
    assert out[1].lengths.tolist() == whole.lengths[2:].tolist()
