"""``/v1/embeddings`` request checks, the context-length check of the model's token counts,
batching, padding and the response body (openai_gateway/embeddings.py), with the model's real
tokenizer file; no server. The counts themselves are the tokenizer step's
(tests/unit/test_tokenization.py), and reach ``usage`` in tests/integration/test_openai_gateway.py."""

import base64
import dataclasses
from pathlib import Path

import numpy as np
import orjson
import pytest

from openai_gateway.catalog import Catalog
from openai_gateway.embeddings import EmbeddingJob, Vocabulary, check_lengths, check_request, pad_ids, response_body
from openai_gateway.errors import APIError
from openai_gateway.schemas import EmbeddingRequest
from openai_gateway.settings import GatewaySettings

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "model_repository"
TOKENIZER = REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json"
VOCAB = 30522  # bert-base-uncased's, all-MiniLM-L6-v2's tokenizer
SETTINGS = GatewaySettings()


@pytest.fixture(scope="module")
def model():
    return Catalog.from_repository(REPOSITORY).models["text_embedding"]


@pytest.fixture(scope="module")
def counter(model):
    if not TOKENIZER.is_file():
        pytest.skip(f"{TOKENIZER.relative_to(ROOT)} is not exported (run `make export`)")
    assert model.tokenizer_file == TOKENIZER
    return Vocabulary(TOKENIZER)


def check(model, counter, input, settings=SETTINGS, **fields):
    return check_request(EmbeddingRequest(input=input, model="text_embedding", **fields), model, counter, settings)


def refusal(model, counter, input, settings=SETTINGS, **fields) -> APIError:
    with pytest.raises(APIError) as err:
        check(model, counter, input, settings, **fields)
    return err.value


# --- input forms and counts ----------------------------------------------------------------


def test_a_string_is_one_text(model, counter):
    job = check(model, counter, "hello world")
    assert job.texts == ["hello world"] and job.ids is None and job.blobs == [b"hello world"]
    assert job.size == 1 and job.encoding_format == "float"


def test_a_list_of_strings_is_one_input_per_text(model, counter):
    texts = ["hello world", "a", "The quick brown fox jumps over the lazy dog."]
    job = check(model, counter, texts)
    assert job.texts == texts and job.size == 3


def test_a_token_array_is_one_input(model, counter):
    job = check(model, counter, [101, 7592, 2088, 102])
    assert job.texts is None
    assert job.ids == [[101, 7592, 2088, 102]]


def test_a_list_of_token_arrays_up_to_the_context_length_goes(model, counter):
    job = check(model, counter, [[101, 102], [101, 7592, 2088, 102], [0] * model.max_tokens])
    assert job.ids is not None and job.size == 3


def test_the_models_counts_over_the_context_length_are_400_naming_the_input(model):
    check_lengths(np.array([4, model.max_tokens], np.int32), model)  # exactly the limit goes
    with pytest.raises(APIError) as err:
        check_lengths(np.array([4, 302, 900], np.int32), model)
    e = err.value
    assert (e.status, e.param, e.code) == (400, "input[1]", "context_length_exceeded")
    assert "302 tokens" in e.message and "256" in e.message and "max_sequence_length" in e.message


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("input", [[], "", [""], ["a", ""], [[]], [[101, 102], []]])
def test_empty_inputs_are_400_naming_the_item(model, counter, input):
    err = refusal(model, counter, input)
    assert err.status == 400
    if input == [] or input == "":
        assert err.param in ("input", "input[0]")
    else:
        assert err.param == f"input[{len(input) - 1}]", err.message


@pytest.mark.parametrize("texts", [["a", " \n\t"], ["a", "\u00a0\u3000"]])
def test_whitespace_only_texts_are_400(model, counter, texts):
    err = refusal(model, counter, texts)
    assert (err.status, err.param) == (400, "input[1]") and "whitespace" in err.message


def test_a_lone_surrogate_is_400_not_sent_to_triton(model, counter):
    # Valid JSON ("\ud800"), but no UTF-8 exists for it.
    err = refusal(model, counter, ["fine", "bad \ud800 text"])
    assert (err.status, err.param) == (400, "input[1]") and "not valid Unicode" in err.message
    job = check(model, counter, ["caf\u00e9", "\U0001f600 ok"])
    assert job.blobs == ["caf\u00e9".encode(), "\U0001f600 ok".encode()]


def test_too_many_inputs_is_413_naming_the_limit(model, counter):
    settings = dataclasses.replace(SETTINGS, max_inputs=3)
    check(model, counter, ["a"] * 3, settings)
    err = refusal(model, counter, ["a"] * 4, settings)
    assert (err.status, err.param) == (413, "input")
    assert "4 items" in err.message and "limit is 3" in err.message and "--max-inputs" in err.message
    err = refusal(model, counter, [[101, 102]] * 4, settings)
    assert (err.status, err.param) == (413, "input")


def test_the_default_input_limit_is_openais_2048(model, counter):
    assert SETTINGS.max_inputs == 2048
    assert refusal(model, counter, ["a"] * 2049).status == 413


def test_one_token_array_is_one_input_however_long(model, counter):
    # Its ids are not inputs: 2,049 ids are one input over the context length, not 2,049 inputs.
    err = refusal(model, counter, [101] * 2049)
    assert (err.status, err.param, err.code) == (400, "input[0]", "context_length_exceeded")
    settings = dataclasses.replace(SETTINGS, max_inputs=2)
    assert check(model, counter, [101, 7592, 2088, 102], settings).size == 1


def test_too_many_characters_is_413_naming_the_text(model, counter):
    settings = dataclasses.replace(SETTINGS, max_input_chars=10)
    check(model, counter, ["x" * 10], settings)
    err = refusal(model, counter, ["ok", "x" * 11], settings)
    assert (err.status, err.param) == (413, "input[1]")
    assert "11 characters" in err.message and "limit is 10" in err.message and "--max-input-chars" in err.message


def test_token_arrays_over_the_context_length_are_400_before_they_are_sent(model, counter):
    check(model, counter, [" ".join(["word"] * 300)])  # a text is counted by the model, not here
    check(model, counter, [[1] * 256])  # exactly the limit goes
    err = refusal(model, counter, [[1] * 3, [1] * 257])
    assert (err.status, err.param, err.code) == (400, "input[1]", "context_length_exceeded")
    err = refusal(model, counter, [1] * 257)
    assert (err.status, err.param) == (400, "input[0]")


@pytest.mark.parametrize(
    "ids, bad",
    [
        ([[101, 102], [101, VOCAB, 102]], VOCAB),
        ([[101, 102], [101, -1, 102]], -1),
        ([[101, 102], [10**12]], 10**12),
    ],
)
def test_token_ids_outside_the_vocabulary_are_400(model, counter, ids, bad):
    err = refusal(model, counter, ids)
    assert (err.status, err.param) == (400, "input[1]")
    assert f"token id {bad}" in err.message and f"[0, {VOCAB})" in err.message


def test_the_last_vocabulary_id_is_accepted(model, counter):
    assert counter.size == VOCAB
    assert check(model, counter, [0, VOCAB - 1]).ids == [[0, VOCAB - 1]]


def test_dimensions_only_as_the_models_own(model, counter):
    assert check(model, counter, "hi", dimensions=384).texts == ["hi"]
    assert check(model, counter, "hi", dimensions=None).texts == ["hi"]
    for dimensions in (256, 0, 1536):
        err = refusal(model, counter, "hi", dimensions=dimensions)
        assert (err.status, err.param) == (400, "dimensions")
        assert "384 dimensions" in err.message


def test_dimensions_is_checked_before_the_input(model, counter):
    assert refusal(model, counter, [], dimensions=128).param == "dimensions"


# --- batching, padding ---------------------------------------------------------------------


def test_chunks_split_at_the_entry_models_batch_limit_in_order(model, counter):
    assert model.max_batch_size == 64
    job = check(model, counter, [f"text {i}" for i in range(150)])
    assert job.chunks() == [(0, 64), (64, 128), (128, 150)]
    assert check(model, counter, ["a"] * 64).chunks() == [(0, 64)]
    assert check(model, counter, "a").chunks() == [(0, 1)]

    small = dataclasses.replace(model, max_batch_size=5, ids_max_batch_size=3)
    texts = EmbeddingJob(small, ["a"] * 11, None, "float")
    assert texts.chunks() == [(0, 5), (5, 10), (10, 11)]
    ids = EmbeddingJob(small, None, [[1]] * 7, "float")  # token arrays: the encoder's limit
    assert ids.chunks() == [(0, 3), (3, 6), (6, 7)]
    spans = ids.chunks()
    assert [i for a, b in spans for i in range(a, b)] == list(range(7))  # every input once, in order


def test_pad_ids_to_the_smallest_bucket_with_a_mask():
    ids, mask = pad_ids([[101, 7, 8, 102], [101, 102]], (16, 32, 64), pad_id=0)
    assert ids.shape == mask.shape == (2, 16)
    assert ids.dtype == mask.dtype == np.int64
    assert ids[0, :4].tolist() == [101, 7, 8, 102] and ids[1, :2].tolist() == [101, 102]
    assert not ids[0, 4:].any() and not ids[1, 2:].any()
    assert mask.sum(axis=1).tolist() == [4, 2]
    assert mask[0, :4].all() and not mask[0, 4:].any()

    assert pad_ids([[1] * 17], (16, 32), 0)[0].shape == (1, 32)
    assert pad_ids([[1] * 16], (16, 32), 0)[0].shape == (1, 16)
    assert pad_ids([[1] * 40], (16, 32), 0)[0].shape == (1, 40)  # beyond the last bucket: its own length
    ids, _ = pad_ids([[5], [5, 5, 5]], (4,), pad_id=9)
    assert ids.tolist() == [[5, 9, 9, 9], [5, 5, 5, 9]]


# --- response ------------------------------------------------------------------------------


def _vectors(n: int, dtype="<f4") -> np.ndarray:
    rng = np.random.default_rng(12)
    v = rng.standard_normal((n, 384)).astype(np.float32)
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(dtype)


def test_response_body_float(model, counter):
    job = check(model, counter, ["hello world", "a", "The quick brown fox"])
    vectors = _vectors(3)
    body = orjson.loads(response_body(job, vectors, 13))
    assert body["object"] == "list" and body["model"] == "text_embedding"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert np.array_equal(got, vectors)  # float32 values survive the JSON text exactly
    assert body["usage"] == {"prompt_tokens": 13, "total_tokens": 13}


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8"])
def test_response_body_base64_decodes_to_the_same_float32_vectors(model, counter, dtype):
    job = check(model, counter, ["hello world", "a"], encoding_format="base64")
    vectors = _vectors(2, dtype)
    body = orjson.loads(response_body(job, vectors, 7))
    for i, d in enumerate(body["data"]):
        assert d["index"] == i and isinstance(d["embedding"], str)
        raw = base64.b64decode(d["embedding"])
        assert len(raw) == 384 * 4
        # What the openai SDK does with a base64 embedding.
        decoded = np.frombuffer(raw, dtype="<f4")
        assert np.array_equal(decoded, vectors[i].astype(np.float32))
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


# --- truncation (TEI's truncate / truncation_direction; docs/embeddings.md#truncation) --------


def test_truncation_fields_default_to_refusing_and_are_carried_to_the_job(model, counter):
    job = check(model, counter, ["a text"])
    assert (job.truncate, job.truncation_direction) == (False, "right")
    job = check(model, counter, ["a text"], truncate=True, truncation_direction="Left")  # TEI's spelling
    assert (job.truncate, job.truncation_direction) == (True, "left")
    err = refusal(model, counter, ["a text"], truncate=True, truncation_direction="middle")
    assert (err.status, err.param) == (400, "truncation_direction")
    assert "must be one of right, left" in err.message
    with pytest.raises(ValueError):  # strict types: no "yes" for true
        EmbeddingRequest(input="x", model="text_embedding", truncate="yes")


def test_token_arrays_over_the_limit_are_truncated_by_direction_keeping_cls_and_sep(model, counter):
    cls, sep = counter.cls_id, counter.sep_id
    row = [cls, *range(1000, 1300), sep]  # 302 ids
    right = check(model, counter, [row, [5, 6]], truncate=True)
    left = check(model, counter, [row], truncate=True, truncation_direction="left")
    assert right.ids[0] == [cls, *range(1000, 1254), sep] and right.ids[1] == [5, 6]
    assert left.ids[0] == [cls, *range(1046, 1300), sep] and len(left.ids[0]) == 256
    bare = check(model, counter, [list(range(1000, 1300))], truncate=True, truncation_direction="left")
    assert bare.ids[0] == list(range(1044, 1300))  # no specials to keep: the last 256 ids
    # Usage counts what was sent, before truncation, as for texts.
    assert right.counts == [302, 2] and left.counts == [302]
    err = refusal(model, counter, [row])
    assert (err.status, err.param, err.code) == (400, "input[0]", "context_length_exceeded")
    assert "302 tokens" in err.message and "256" in err.message and '"truncate": true' in err.message
