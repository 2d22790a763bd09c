import numpy as np
import pytest

from contract.errors import ConfigError, InputError
from contract.model_config import bucket_length
from export.reference import model_dir
from export.reference import tokenize as hf_tokenize
from python_backends.text.tokenization import BatchTokenizer, decode_texts

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
        [
            tensor("TEXT", [1], "TYPE_STRING"),
            tensor("TRUNCATE", [1], "TYPE_BOOL"),
            tensor("TRUNCATION_DIRECTION", [1], "TYPE_STRING"),
        ],
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
    monkeypatch.setattr(shim.tokenizer, "encode", lambda texts, left=None: calls.append(list(texts)) or encode(texts, left))
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


# --- truncation as the caller chooses (contract/truncation.py) ------------------


def _whole(text):
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(TOKENIZER_JSON))
    whole.no_truncation()
    whole.no_padding()
    return whole.encode(text).ids


LONG = " ".join(f"word{i}" for i in range(400))  # about 1,200 tokens


def test_a_text_over_the_limit_is_refused_by_default_naming_it_its_count_and_the_limit(tok):
    from contract.errors import CONTEXT_LENGTH, format_error, parse_error
    from contract.truncation import ContextLengthError

    texts = ["short", "fits", LONG, "after"]
    out = tok.encode_requests(texts, [(0, 1), (1, 3), (3, 4)])
    assert isinstance(out[1], ContextLengthError)
    n = len(_whole(LONG))
    assert n > 256
    assert out[1].code == CONTEXT_LENGTH and out[1].field == "TEXT[1]"
    assert out[1].values == {"index": 1, "tokens": n, "limit": 256}
    assert f"text has {n} tokens" in str(out[1]) and "limit is 256" in str(out[1]) and "TRUNCATE=true" in str(out[1])
    data = parse_error(format_error(out[1]))  # what crosses the hop: the code and values as data
    assert data is not None and data.code == CONTEXT_LENGTH and data.values["tokens"] == n
    # The neighbours of the same batch are answered.
    assert out[0].num_tokens.tolist() == [len(_whole("short"))] and out[2].num_tokens.tolist() == [len(_whole("after"))]


def test_right_keeps_the_first_tokens_and_left_the_last_with_cls_and_sep_in_place(tok):
    from tokenizers import Tokenizer

    from contract.truncation import LEFT, RIGHT, Truncation

    whole = _whole(LONG)
    cls, sep = tok._tok.token_to_id("[CLS]"), tok._tok.token_to_id("[SEP]")
    right, left, short_left = tok.encode_requests(
        [LONG, LONG, "a short one"],
        [(0, 1), (1, 2), (2, 3)],
        [Truncation(True, RIGHT), Truncation(True, LEFT), Truncation(True, LEFT)],
    )
    r, lft = right.input_ids[0].tolist(), left.input_ids[0].tolist()
    assert r == whole[:255] + [sep]
    assert lft == [cls] + whole[-255:]  # whole ends with [SEP]
    assert lft[0] == cls and lft[-1] == sep and r[0] == cls and r != lft
    # The tokenizers library's own left truncation (truncates the text, then adds the specials) agrees.
    theirs = Tokenizer.from_file(str(TOKENIZER_JSON))
    theirs.enable_truncation(max_length=256, direction="left")
    theirs.no_padding()
    assert lft == theirs.encode(LONG).ids
    # Counts are of the whole text, whichever end was kept; a text that fits is untouched.
    assert right.num_tokens.tolist() == left.num_tokens.tolist() == [len(whole)]
    assert right.lengths.tolist() == left.lengths.tolist() == [256] and left.attention_mask.all()
    assert short_left.input_ids[0, : short_left.lengths[0]].tolist() == _whole("a short one")


def test_truncation_options_are_checked_where_they_enter():
    from contract.truncation import LEFT, RIGHT, Truncation, parse_direction, parse_truncation

    assert parse_truncation(None, None, 2) == [Truncation(False, RIGHT)] * 2
    assert parse_truncation(None, None, 2, default=True) == [Truncation(True, RIGHT)] * 2  # the model's `truncate`
    assert parse_truncation(np.array([[False]]), None, 1, default=True) == [Truncation(False, RIGHT)]  # a request's own wins
    got = parse_truncation(np.array([[True], [False]]), np.array([[b"Left"], ["RIGHT "]], dtype=object), 2)
    assert got == [Truncation(True, LEFT), Truncation(False, RIGHT)] and got[0].left and not got[1].left
    assert not Truncation(False, LEFT).left  # a direction without truncate truncates nothing
    with pytest.raises(InputError, match=r"TRUNCATION_DIRECTION\[1\]: must be one of right, left, got 'middle'") as bad:
        parse_truncation(None, np.array([[b"left"], [b"middle"]], dtype=object), 2)
    assert bad.value.values["allowed"] == ["right", "left"]
    with pytest.raises(InputError, match=r"TRUNCATE: has 1 values for 2 texts"):
        parse_truncation(np.array([[True]]), None, 2)
    with pytest.raises(InputError, match=r"X: must be one of"):
        parse_direction(b"\xff", "X")


def test_the_tokenizer_shim_refuses_or_truncates_per_request(tmp_path, monkeypatch):
    from tests.unit.triton_fakes import Request, load_shim, make_pb_utils, model_config, tensor

    version = tmp_path / "text_tokenizer" / "1"
    version.mkdir(parents=True)
    (version / "tokenizer.json").write_bytes(TOKENIZER_JSON.read_bytes())
    pb = make_pb_utils()
    shim = load_shim("text_tokenizer", pb, monkeypatch)
    monkeypatch.setattr("python_backends.shim_base.freeze_loaded_objects", lambda: 0)
    config = model_config(
        "text_tokenizer",
        [
            tensor("TEXT", [1], "TYPE_STRING"),
            tensor("TRUNCATE", [1], "TYPE_BOOL"),
            tensor("TRUNCATION_DIRECTION", [1], "TYPE_STRING"),
        ],
        [
            tensor("input_ids", [-1], "TYPE_INT64"),
            tensor("attention_mask", [-1], "TYPE_INT64"),
            tensor("num_tokens", [1], "TYPE_INT32"),
        ],
        parameters={"max_sequence_length": "32", "sequence_buckets": "16,32"},
    )
    shim.initialize({"model_config": config, "model_repository": str(tmp_path / "text_tokenizer"), "model_version": "1"})
    text = np.array([[LONG.encode()]], dtype=object)
    refused, right, left, bad = shim.execute(
        [
            Request("a", TEXT=text),
            Request("b", TEXT=text, TRUNCATE=np.array([[True]])),
            Request("c", TEXT=text, TRUNCATE=np.array([[True]]), TRUNCATION_DIRECTION=np.array([[b"LEFT"]], dtype=object)),
            Request("d", TEXT=text, TRUNCATION_DIRECTION=np.array([[b"up"]], dtype=object)),
        ]
    )
    n = len(_whole(LONG))
    assert refused.error().code() == pb.TritonError.INVALID_ARG
    assert f"TEXT[0]: text has {n} tokens; the model's limit is 32 tokens" in refused.error().message()
    assert bad.error().code() == pb.TritonError.INVALID_ARG and "TRUNCATION_DIRECTION[0]: must be one of right, left" in (
        bad.error().message()
    )
    assert right.output("num_tokens").tolist() == left.output("num_tokens").tolist() == [[n]]
    assert right.output("input_ids")[0, :31].tolist() == _whole(LONG)[:31]
    assert left.output("input_ids")[0, 1:].tolist() == _whole(LONG)[-31:]


def test_the_cached_entry_reads_truncate_from_the_tokenizers_config(tmp_path):
    from contract.errors import ConfigError
    from python_backends.cache.entry import tokenizer_config
    from server.layout import ROOT

    shipped = tokenizer_config(ROOT / "model_repository", "text_tokenizer")
    assert shipped.param_bool("truncate", True) is False and shipped.param_int("max_sequence_length", 0) == 256
    (tmp_path / "tok").mkdir()
    config = tmp_path / "tok" / "config.pbtxt"
    limit = 'parameters { key: "max_sequence_length" value: { string_value: "128" } }\n'
    config.write_text(limit + 'parameters { key: "truncate" value: { string_value: "True" } }\n')
    assert tokenizer_config(tmp_path, "tok").param_bool("truncate", False) is True
    config.write_text(limit)
    assert tokenizer_config(tmp_path, "tok").param_bool("truncate", False) is False  # absent: refuse
    config.write_text(limit + 'parameters { key: "truncate" value: { string_value: "maybe" } }\n')
    with pytest.raises(ConfigError, match="must be a boolean"):
        tokenizer_config(tmp_path, "tok").param_bool("truncate", False)
    config.write_text("")
    with pytest.raises(ConfigError, match="no max_sequence_length"):
        tokenizer_config(tmp_path, "tok")
