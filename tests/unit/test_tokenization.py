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


def test_truncation_is_the_tokenizers_librarys_and_counts_are_of_the_whole_text(tok):
    """Ours truncates after counting; the library's own truncation gives the same ids, and the
    count is what an untruncated encode gives."""
    from tokenizers import Tokenizer

    theirs = Tokenizer.from_file(str(TOKENIZER_JSON))
    theirs.enable_truncation(max_length=256)
    theirs.no_padding()
    whole = Tokenizer.from_file(str(TOKENIZER_JSON))
    whole.no_truncation()
    whole.no_padding()
    rng = np.random.default_rng(7)
    words = ["river", "unbelievably", "東京", "émigré", "x", ",", "tokenization", "🙂", "4096"]
    texts = [" ".join(rng.choice(words, size=n)) for n in (1, 120, 250, 253, 254, 255, 400, 3000)]
    batch = tok.encode(texts)
    for row, text in enumerate(texts):
        expected = theirs.encode(text).ids
        n = int(batch.lengths[row])
        assert batch.input_ids[row, :n].tolist() == expected
        assert not batch.input_ids[row, n:].any() and batch.attention_mask[row].sum() == n
        assert batch.num_tokens[row] == len(whole.encode(text).ids)
    assert batch.num_tokens.dtype == np.int32 and batch.num_tokens.max() > 256 == batch.lengths.max()


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
    assert out[1].num_tokens.tolist() == whole.num_tokens[2:].tolist() == [5]


def test_the_tokenizer_shim_answers_each_request_from_one_call(tmp_path, monkeypatch):
    from tests.unit.triton_fakes import Request, load_shim, make_pb_utils, model_config, tensor

    version = tmp_path / "text_tokenizer" / "1"
    version.mkdir(parents=True)
    (version / "tokenizer.json").write_bytes(TOKENIZER_JSON.read_bytes())
    pb = make_pb_utils()
    shim = load_shim("text_tokenizer", pb, monkeypatch)
    monkeypatch.setattr("python_backends.shim_base.freeze_loaded_objects", lambda: 0)
    config = model_config(
        "text_tokenizer",
        [tensor("TEXT", [1], "TYPE_STRING")],
        [
            tensor("input_ids", [-1], "TYPE_INT64"),
            tensor("attention_mask", [-1], "TYPE_INT64"),
            tensor("num_tokens", [1], "TYPE_INT32"),
        ],
        parameters={"max_sequence_length": "32", "sequence_buckets": "16,32"},
    )
    shim.initialize({"model_config": config, "model_repository": str(tmp_path / "text_tokenizer"), "model_version": "1"})
    calls, recorded = [], []
    encode = shim.tokenizer.encode
    monkeypatch.setattr(shim.tokenizer, "encode", lambda texts: calls.append(list(texts)) or encode(texts))
    monkeypatch.setattr(shim.metrics, "record", lambda real, padded, requests: recorded.append((real, padded, requests)))

    def text(*values):
        return np.array([[v.encode()] for v in values], dtype=object)

    good, blank, two = shim.execute(
        [Request("a", TEXT=text("hello world")), Request("b", TEXT=text("  ")), Request("c", TEXT=text("one", "two"))]
    )
    assert calls == [["hello world", "one", "two"]]
    ids, _ = hf_tokenize(["hello world"])
    assert good.output("input_ids").tolist() == [ids[0].tolist() + [0] * (16 - ids.shape[1])]
    assert two.output("attention_mask").shape == (2, 16)
    assert good.output("num_tokens").tolist() == [[ids.shape[1]]] and two.output("num_tokens").tolist() == [[3], [3]]
    assert (
        blank.error().code() == pb.TritonError.INVALID_ARG and "TEXT[0]: text contains only whitespace" in blank.error().message()
    )
    # The batch had 3 requests (the refused one included) and 3 texts padded to 16 tokens.
    assert recorded == [(int(good.output("attention_mask").sum() + two.output("attention_mask").sum()), 48, 3)]
