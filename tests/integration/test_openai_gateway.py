"""The OpenAI gateway in front of the session's real tritonserver, spoken to with the official
``openai`` SDK (and raw HTTP where the SDK hides what is checked).

Covered: embeddings from texts, lists, token arrays and lists of token arrays, as floats and
base64, equal to Triton's own ``text_embedding`` vectors; real token counts in ``usage``;
lists larger than the model's batch limit split and merged in order; the Hugging Face alias;
404/400 errors in OpenAI's shape (unknown model, ``dimensions``, over the context length).
Chat and text completions, streamed and not, equal to the same greedy request sent straight to
Triton (``clients.generation``), with their finish reasons, usage counts, ``stream_options``,
``max_completion_tokens``, ``stop``, ``echo``, ``seed`` and ``n``. The models endpoints.
Request ids in the response header and the log line; the API key never in the log; the
Prometheus metrics of the requests (routes and statuses, tokens per key id, latency).

Generation runs on the CPU: answers stay at 16 tokens or fewer, except one that ends by itself.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
import urllib.request

import numpy as np
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from server.layout import ROOT
from tests.integration.conftest import GATEWAY_TEST_KEY

EMBEDDING = "text_embedding"
GENERATION = "text_generation"
EMBEDDING_ALIAS = "sentence-transformers/all-MiniLM-L6-v2"
GENERATION_ALIAS = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENIZER_FILE = ROOT / "model_repository" / "text_tokenizer" / "1" / "tokenizer.json"
DIMENSIONS = 384
MAX_BATCH = 64  # text_embedding's and text_embedding_cached's max_batch_size
MAX_TOKENS = 256  # the tokenizer's max_sequence_length
COSINE_MIN = 0.9999
KEY_ID = hashlib.sha256(GATEWAY_TEST_KEY.encode("utf-8")).hexdigest()[:12]

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Triton serves models over HTTP and gRPC.",
    "Le chat dort sur le canapé.",
    "北京是中国的首都。",
    "ok",
]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "Here is a short list of three fruits and their colours:"


# --- helpers and fixtures ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_FILE))
    tok.no_truncation()
    tok.no_padding()
    return tok


@pytest.fixture(scope="module")
def triton_embed(grpc_client):
    """Triton's own ``text_embedding`` vectors for a list of texts (in chunks of its batch limit)."""
    import tritonclient.grpc as grpcclient

    def embed(texts: list[str]) -> np.ndarray:
        parts = []
        for start in range(0, len(texts), MAX_BATCH):
            chunk = texts[start : start + MAX_BATCH]
            t = grpcclient.InferInput("TEXT", [len(chunk), 1], "BYTES")
            t.set_data_from_numpy(np.array([s.encode("utf-8") for s in chunk], dtype=object).reshape(-1, 1))
            result = grpc_client.infer(EMBEDDING, [t], outputs=[grpcclient.InferRequestedOutput("EMBEDDING")])
            parts.append(result.as_numpy("EMBEDDING"))
        return np.concatenate(parts, axis=0).astype(np.float64)

    return embed


@pytest.fixture(scope="module")
def direct(triton):
    """The generation model straight through Triton's gRPC (no gateway)."""
    from clients.generation import GenerationClient

    with GenerationClient(triton.grpc_url, protocol="grpc") as client:
        yield client


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def vectors(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data], dtype=np.float64)


def assert_same_vectors(got, expected) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == np.asarray(expected).shape, (got.shape, np.asarray(expected).shape)
    cos = cosines(got, expected)
    assert cos.min() >= COSINE_MIN, f"cosines {np.round(cos, 6).tolist()}"


def decode_base64(value: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(value), dtype="<f4")


def auth(**extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {GATEWAY_TEST_KEY}", **extra}


def assert_openai_error(response: requests.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == error_type, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]


def log_lines(gateway) -> list[dict]:
    """The gateway's per-request log lines (JSON after the logger name), in order."""
    out = []
    for line in gateway.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        marker = "openai_gateway.access INFO "
        if marker in line:
            out.append(json.loads(line.split(marker, 1)[1]))
    return out


def metric_samples(gateway) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of the gateway's /metrics (no key needed)."""
    response = requests.get(f"{gateway.url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    assert GATEWAY_TEST_KEY not in response.text
    out = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# --- embeddings ----------------------------------------------------------------------------


def test_embedding_of_one_string_equals_triton(openai_client, triton_embed, tokenizer):
    response = openai_client.embeddings.create(model=EMBEDDING, input=TEXTS[0], encoding_format="float")
    assert response.object == "list" and response.model == EMBEDDING
    assert len(response.data) == 1 and len(response.data[0].embedding) == DIMENSIONS
    assert_same_vectors(vectors(response), triton_embed(TEXTS[:1]))
    n = len(tokenizer.encode(TEXTS[0]).ids)
    assert response.usage.prompt_tokens == n and response.usage.total_tokens == n


def test_embeddings_of_a_list_equal_triton_with_real_token_counts(openai_client, triton_embed, tokenizer):
    response = openai_client.embeddings.create(model=EMBEDDING, input=TEXTS, encoding_format="float")
    assert_same_vectors(vectors(response), triton_embed(TEXTS))
    counts = [len(tokenizer.encode(t).ids) for t in TEXTS]
    assert len(set(counts)) > 2  # the texts differ in length, so a wrong count shows
    assert response.usage.prompt_tokens == sum(counts)
    assert response.usage.total_tokens == sum(counts)


def test_token_arrays_give_the_vectors_of_their_texts(openai_client, triton_embed, tokenizer):
    ids = [tokenizer.encode(t).ids for t in TEXTS]
    one = openai_client.embeddings.create(model=EMBEDDING, input=ids[1], encoding_format="float")
    assert_same_vectors(vectors(one), triton_embed(TEXTS[1:2]))
    assert one.usage.prompt_tokens == len(ids[1])
    many = openai_client.embeddings.create(model=EMBEDDING, input=ids, encoding_format="float")
    assert_same_vectors(vectors(many), triton_embed(TEXTS))
    assert many.usage.prompt_tokens == sum(len(r) for r in ids)
    texts = openai_client.embeddings.create(model=EMBEDDING, input=TEXTS, encoding_format="float")
    assert_same_vectors(vectors(many), vectors(texts))


def test_base64_encoding(openai_client, gateway, triton_embed):
    expected = triton_embed(TEXTS)
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    decoded_by_sdk = openai_client.embeddings.create(model=EMBEDDING, input=TEXTS)
    assert_same_vectors(vectors(decoded_by_sdk), expected)
    # Asked for explicitly, the SDK hands the base64 strings over as they came.
    raw = openai_client.embeddings.create(model=EMBEDDING, input=TEXTS, encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in raw.data)
    assert_same_vectors([decode_base64(d.embedding) for d in raw.data], expected)
    # Raw HTTP: little-endian float32 bytes, the same numbers as the float encoding.
    url = f"{gateway.url}/v1/embeddings"
    as_b64 = requests.post(
        url, json={"model": EMBEDDING, "input": TEXTS, "encoding_format": "base64"}, headers=auth(), timeout=60
    )
    as_float = requests.post(
        url, json={"model": EMBEDDING, "input": TEXTS, "encoding_format": "float"}, headers=auth(), timeout=60
    )
    assert as_b64.status_code == 200 and as_float.status_code == 200, (as_b64.text, as_float.text)
    b64_rows = [decode_base64(d["embedding"]) for d in as_b64.json()["data"]]
    float_rows = [d["embedding"] for d in as_float.json()["data"]]
    assert all(len(r) == DIMENSIONS for r in b64_rows)
    np.testing.assert_allclose(np.array(b64_rows), np.array(float_rows, dtype=np.float32), rtol=0, atol=1e-7)
    assert as_b64.json()["usage"] == as_float.json()["usage"]


def test_a_list_over_the_batch_limit_comes_back_whole_and_in_order(openai_client, triton_embed, tokenizer):
    texts = [f"Sentence number {i}: {TEXTS[i % len(TEXTS)]} ({'x' * (i % 7)})" for i in range(150)]
    assert len(texts) > 2 * MAX_BATCH
    response = openai_client.embeddings.create(model=EMBEDDING, input=texts, encoding_format="float")
    assert len(response.data) == len(texts)
    got, expected = vectors(response), triton_embed(texts)
    assert_same_vectors(got, expected)
    # In order: each vector is nearest to its own text's, not to a neighbour's.
    similarity = (got / np.linalg.norm(got, axis=1, keepdims=True)) @ (
        expected / np.linalg.norm(expected, axis=1, keepdims=True)
    ).T
    assert (similarity.argmax(axis=1) == np.arange(len(texts))).all()
    assert response.usage.prompt_tokens == sum(len(e.ids) for e in tokenizer.encode_batch(texts))


def test_the_hugging_face_name_is_an_alias(openai_client, triton_embed):
    response = openai_client.embeddings.create(model=EMBEDDING_ALIAS, input=TEXTS[2], encoding_format="float")
    assert_same_vectors(vectors(response), triton_embed(TEXTS[2:3]))


def test_unknown_model_is_not_found_in_openai_shape(openai_client):
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.embeddings.create(model="text-embedding-3-small", input="hello")
    exc = caught.value
    assert exc.status_code == 404
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"
    assert body["error"]["type"] == "not_found_error"
    assert "text-embedding-3-small" in body["error"]["message"] and EMBEDDING in body["error"]["message"]
    # A generation model is no embedding model either.
    with pytest.raises(openai.NotFoundError):
        openai_client.embeddings.create(model=GENERATION, input="hello")


def test_dimensions_is_refused(openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.embeddings.create(model=EMBEDDING, input="hello", dimensions=128)
    error = caught.value.response.json()["error"]
    assert error["param"] == "dimensions"
    assert "dimensions is not supported" in error["message"]
    # The model's own size is no shortening: accepted.
    same = openai_client.embeddings.create(model=EMBEDDING, input="hello", dimensions=DIMENSIONS)
    assert len(same.data[0].embedding) == DIMENSIONS


def test_a_text_over_the_token_limit_is_refused_naming_the_limit(openai_client, tokenizer):
    long_text = "tokens " * 300
    n = len(tokenizer.encode(long_text).ids)
    assert n > MAX_TOKENS
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.embeddings.create(model=EMBEDDING, input=["fine", long_text])
    error = caught.value.response.json()["error"]
    assert error["param"] == "input[1]" and error["code"] == "context_length_exceeded"
    assert str(MAX_TOKENS) in error["message"] and str(n) in error["message"]
    # The same limit for token arrays.
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.embeddings.create(model=EMBEDDING, input=[tokenizer.encode(long_text).ids])
    assert str(MAX_TOKENS) in caught.value.response.json()["error"]["message"]


def test_truncate_as_tei_names_it_through_the_sdks_extra_body(openai_client, tokenizer, grpc_client):
    """truncate (default false) and truncation_direction, as TEI names them: the same vectors as
    Triton's ensemble with the same choice, usage still the whole texts' counts."""
    import tritonclient.grpc as grpcclient

    long_text = "the opening of the text " + " ".join(f"w{i}" for i in range(300)) + " and its very end"
    n = len(tokenizer.encode(long_text).ids)
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.embeddings.create(model=EMBEDDING, input=["fine", long_text], extra_body={"truncate": False})
    error = caught.value.response.json()["error"]
    assert (error["param"], error["code"]) == ("input[1]", "context_length_exceeded") and str(n) in error["message"]
    right = openai_client.embeddings.create(model=EMBEDDING, input=["fine", long_text], extra_body={"truncate": True})
    left = openai_client.embeddings.create(
        model=EMBEDDING, input=["fine", long_text], extra_body={"truncate": True, "truncation_direction": "Left"}
    )
    assert right.usage.prompt_tokens == left.usage.prompt_tokens == len(tokenizer.encode("fine").ids) + n
    r, lft = vectors(right), vectors(left)
    assert cosines(r[:1], lft[:1])[0] > 0.99999 and cosines(r[1:], lft[1:])[0] < 0.99
    # The same vectors as Triton's ensemble asked directly with the same choice.
    for got, way in ((r[1], "right"), (lft[1], "left")):
        inputs = [
            grpcclient.InferInput(name, [1, 1], dt)
            for name, dt in (("TEXT", "BYTES"), ("TRUNCATE", "BOOL"), ("TRUNCATION_DIRECTION", "BYTES"))
        ]
        inputs[0].set_data_from_numpy(np.array([[long_text.encode()]], dtype=object))
        inputs[1].set_data_from_numpy(np.ones((1, 1), dtype=np.bool_))
        inputs[2].set_data_from_numpy(np.array([[way.encode()]], dtype=object))
        want = grpc_client.infer(EMBEDDING, inputs).as_numpy("EMBEDDING")
        assert cosines(got[None, :], want)[0] > 0.99999, way
    # Token arrays: truncated by direction too, [CLS] and [SEP] kept; usage the arrays' lengths.
    ids = tokenizer.encode(long_text).ids
    by_ids = openai_client.embeddings.create(
        model=EMBEDDING, input=[ids], extra_body={"truncate": True, "truncation_direction": "left"}
    )
    assert by_ids.usage.prompt_tokens == n and cosines(vectors(by_ids), lft[1:])[0] > 0.9999
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.embeddings.create(model=EMBEDDING, input="x", extra_body={"truncate": True, "truncation_direction": "up"})
    assert caught.value.response.json()["error"]["param"] == "truncation_direction"


# --- chat completions ----------------------------------------------------------------------


def test_chat_greedy_equals_triton(openai_client, direct):
    expected = direct.chat(QUESTION, max_tokens=12, temperature=0)
    response = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=12, temperature=0)
    assert response.object == "chat.completion" and response.model == GENERATION
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert expected.text.strip()
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == expected.num_input_tokens
    assert response.usage.completion_tokens == expected.num_output_tokens
    assert response.usage.total_tokens == expected.num_input_tokens + expected.num_output_tokens


def test_penalties_min_p_and_logit_bias_are_served_as_through_triton(openai_client, direct):
    """OpenAI's presence/frequency penalties and logit_bias (and vLLM's min_p) reach the engine:
    the gateway's answer is Triton's for the same fields, and a banned first token is gone."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "model_repository" / "text_generation" / "1"))
    plain = direct.chat(QUESTION, max_tokens=12, temperature=0)
    first = tok.encode(plain.text, add_special_tokens=False)[0]
    fields = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "logit_bias": {str(first): -100}}
    expected = direct.chat(QUESTION, max_tokens=12, temperature=0, **fields)
    response = openai_client.chat.completions.create(
        model=GENERATION, messages=QUESTION, max_tokens=12, temperature=0, extra_body={"min_p": 0.05}, **fields
    )
    text = response.choices[0].message.content
    assert text == expected.text and text.strip()
    assert tok.encode(text, add_special_tokens=False)[0] != first and text != plain.text
    # Out of range: 400 naming the field, from the engine's checks.
    for bad, param in (
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"logit_bias": {"10000000": 1}}, "logit_bias['10000000']"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=2, **bad)
        assert caught.value.response.json()["error"]["param"] == param, caught.value.response.text


def test_logprobs_of_chat_and_completions_streamed_and_whole(openai_client, direct):
    """OpenAI's logprobs: chat's content objects (top_logprobs alternatives each, the chosen token
    first when greedy) spell the message, a stream's chunks carry their own tokens, and the
    legacy completions shape has tokens, token_logprobs, top_logprobs and text offsets."""
    import math

    whole = openai_client.chat.completions.create(
        model=GENERATION, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    assert len(content) == whole.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token and t.logprob <= 0
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1.0 + 1e-6
    expected = direct.chat(QUESTION, max_tokens=12, temperature=0, logprobs=2)
    # The same tokens and values; within 1e-4, because one of the two may find the prompt's blocks
    # in the prefix cache and compute only its tail (other matrix shapes, other rounding).
    assert [e["token"] for e in expected.logprobs] == [t.token for t in content]
    assert max(abs(e["logprob"] - t.logprob) for e, t in zip(expected.logprobs, content)) < 1e-4
    plain = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    chunks = list(
        openai_client.chat.completions.create(
            model=GENERATION, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, stream=True
        )
    )
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 1e-4
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            assert "".join(t.token for t in c.choices[0].logprobs.content) == (c.choices[0].delta.content or "")
    legacy = openai_client.completions.create(model=GENERATION, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1, echo=True)
    lp = legacy.choices[0].logprobs  # with echo the prompt's tokens lead, the first one's logprob null
    assert legacy.choices[0].text == "".join(lp.tokens) and legacy.choices[0].text.startswith(PROMPT)
    assert lp.text_offset[0] == 0 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(d) == 1 for d in lp.top_logprobs[1:])
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))


STRUCTURED_PROMPTS = [
    "Invent a character for a fantasy novel.",
    "Describe the teacher you remember best.",
    "Make up a person who lives in Lisbon.",
    "Tell me about a famous painter.",
    "Describe a neighbour who owns a bakery.",
    "Invent a detective for a mystery story.",
    "Describe an astronaut on her first mission.",
    "Make up a farmer from Kenya.",
    "Ecris une personne qui habite à Lyon.",
    "Beschreibe eine Ärztin aus Hamburg.",
    "Describe a child who loves trains.",
    "Invent a chess champion.",
]


def test_structured_outputs_parse_into_the_clients_pydantic_model_every_time(openai_client, gateway):
    """The openai SDK's parse() with a Pydantic model, sampled at temperature 1 on varied prompts
    at once: the schema is enforced by the engine, so every answer parses (not most of them).
    vLLM's guided_choice and guided_regex work through extra_body; a bad schema is a 400 naming
    response_format. (make structured-bench measures validity with and without the guide.)"""
    import re
    from concurrent.futures import ThreadPoolExecutor
    from typing import Annotated

    import pydantic

    # Every field bounded, so an answer always completes within max_tokens (a 135M model can loop
    # inside an unbounded string: valid so far, but cut).
    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=24)
        age: int = pydantic.Field(ge=0, le=130)
        city: str = pydantic.Field(max_length=24)
        hobbies: list[Annotated[str, pydantic.StringConstraints(max_length=24)]] = pydantic.Field(max_length=3)

    def ask(prompt):
        return openai_client.chat.completions.parse(
            model=GENERATION,
            messages=[{"role": "user", "content": prompt}],
            response_format=Person,
            max_tokens=160,
            temperature=1.0,
        )

    with ThreadPoolExecutor(len(STRUCTURED_PROMPTS)) as pool:
        answers = list(pool.map(ask, STRUCTURED_PROMPTS))
    for a in answers:
        assert a.choices[0].finish_reason == "stop", a.choices[0].message.content
        assert isinstance(a.choices[0].message.parsed, Person), a.choices[0].message.content
    choice = openai_client.chat.completions.create(
        model=GENERATION, messages=QUESTION, max_tokens=8, extra_body={"guided_choice": ["Paris", "London", "Rome"]}
    )
    assert choice.choices[0].message.content in ("Paris", "London", "Rome")
    # vLLM's current field, as outlines and vLLM's own clients send it: enforced, not dropped.
    for _ in range(3):
        current = openai_client.chat.completions.create(
            model=GENERATION,
            messages=QUESTION,
            max_tokens=8,
            temperature=1.0,
            extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
        )
        assert current.choices[0].message.content in ("red", "blue"), current.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=GENERATION, messages=QUESTION, max_tokens=4, extra_body={"structured_outputs": {"structural_tag": "{}"}}
        )
    assert caught.value.response.json()["error"]["param"] == "structured_outputs.structural_tag.structures"
    # A structural tag, as vLLM's field and as response_format: served (its enforcement: test_generation_structured).
    tag = {
        "structures": [
            {
                "begin": "<function=pick>",
                "schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
                "end": "</function>",
            }
        ],
        "triggers": ["<function="],
    }
    for extra in ({"structured_outputs": {"structural_tag": tag}}, {"response_format": {"type": "structural_tag", **tag}}):
        tagged = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=6, extra_body=extra)
        assert tagged.choices[0].finish_reason in ("stop", "length"), tagged
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=GENERATION,
            messages=QUESTION,
            max_tokens=4,
            extra_body={"response_format": {"type": "structural_tag", "triggers": []}},
        )
    assert caught.value.response.json()["error"]["param"] == "response_format.structures"
    regex = openai_client.completions.create(
        model=GENERATION, prompt="My phone number is", max_tokens=12, extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"}
    )
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", regex.choices[0].text)
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
    }
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=4, response_format=bad)
    error = caught.value.response.json()["error"]
    assert error["param"] == "response_format" and "strin" in error["message"], error


def test_chat_stream_equals_the_whole_answer_with_usage_last(openai_client, direct):
    expected = direct.chat(QUESTION, max_tokens=12, temperature=0)
    whole = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=12, temperature=0)
    chunks = list(
        openai_client.chat.completions.create(
            model=GENERATION, messages=QUESTION, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in text_chunks)
    assert len([c for c in text_chunks if c.choices[0].delta.content]) > 1  # really streamed
    assert streamed == whole.choices[0].message.content == expected.text
    reasons = [c.choices[0].finish_reason for c in text_chunks]
    assert reasons[-1] == whole.choices[0].finish_reason and all(r is None for r in reasons[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.prompt_tokens == expected.num_input_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == expected.num_output_tokens == whole.usage.completion_tokens


def test_chat_stream_without_usage_and_its_done_event(openai_client, gateway):
    chunks = list(
        openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=4, temperature=0, stream=True)
    )
    assert chunks and all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    # On the wire: SSE events, the last one data: [DONE].
    with requests.post(
        f"{gateway.url}/v1/chat/completions",
        headers=auth(),
        stream=True,
        timeout=60,
        json={"model": GENERATION, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert all(json.loads(e[6:])["object"] == "chat.completion.chunk" for e in events[:-1])


def test_chat_finish_reasons(openai_client, direct):
    # max_tokens hit.
    cut = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=3, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    # The model ends by itself (its answer is about 8 tokens).
    ended = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=40, temperature=0)
    expected = direct.chat(QUESTION, max_tokens=40, temperature=0)
    assert ended.choices[0].finish_reason == "stop" == expected.finish_reason
    assert ended.choices[0].message.content == expected.text
    assert ended.usage.completion_tokens < 40
    assert "Paris" in expected.text
    # A stop string hits: the text ends before it.
    stopped = openai_client.chat.completions.create(
        model=GENERATION, messages=QUESTION, max_tokens=16, temperature=0, stop=["Paris"]
    )
    expected_stop = direct.chat(QUESTION, max_tokens=16, temperature=0, stop=["Paris"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == expected_stop.text
    assert "Paris" not in stopped.choices[0].message.content
    assert expected.text.startswith(stopped.choices[0].message.content)
    assert stopped.usage.completion_tokens < ended.usage.completion_tokens
    # Streamed, the last chunk says the same.
    chunks = list(
        openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=3, temperature=0, stream=True)
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_completion_tokens(openai_client):
    response = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_completion_tokens=5, temperature=0)
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_completion_tokens=0)
    assert caught.value.response.json()["error"]["param"] == "max_completion_tokens"


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_held(openai_client):
    import uuid

    # A prompt no other test sent: only the chat template's first block can be cached before it.
    passage = " ".join(f"{uuid.uuid4().hex[:6]} river" for _ in range(120))
    messages = [{"role": "user", "content": f"Repeat the first word of: {passage}"}]
    first = openai_client.chat.completions.create(model=GENERATION, messages=messages, max_tokens=2, temperature=0)
    again = openai_client.chat.completions.create(model=GENERATION, messages=messages, max_tokens=2, temperature=0)
    prompt = again.usage.prompt_tokens
    cold, warm = first.usage.prompt_tokens_details.cached_tokens, again.usage.prompt_tokens_details.cached_tokens
    assert prompt > 300 and cold <= 32 and prompt - 16 <= warm <= prompt, (prompt, cold, warm)
    # The same in the usage chunk of a stream.
    stream = openai_client.chat.completions.create(
        model=GENERATION, messages=messages, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == warm


def triton_counter(triton, name: str) -> float:
    """A counter of the generation model on Triton's metrics port."""
    with urllib.request.urlopen(triton.metrics_url, timeout=10) as r:
        body = r.read().decode("utf-8")
    return sum(
        s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == name and s.labels.get("model") == GENERATION
    )


def test_n_choices_come_from_one_prefill(openai_client, triton):
    """n = 4: four choices, each its own seeded draw; the prompt runs through the model once
    (Triton's metrics: prompt tokens computed = the prompt less its prefix-cache hits, three
    sequences forked); streamed, each choice's deltas add up to the whole answer's choice."""
    messages = [{"role": "user", "content": f"Name a colour. ({time.time_ns()})"}]  # a prompt never seen
    computed = triton_counter(triton, "llm_prompt_tokens_computed_total")
    forked = triton_counter(triton, "llm_sequences_forked_total")
    whole = openai_client.chat.completions.create(
        model=GENERATION, messages=messages, max_tokens=12, temperature=1.0, seed=11, n=4
    )
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in whole.choices)
    assert len({c.message.content for c in whole.choices}) > 1, "four seeded draws, all the same"
    cached = whole.usage.prompt_tokens_details.cached_tokens
    assert triton_counter(triton, "llm_prompt_tokens_computed_total") - computed == whole.usage.prompt_tokens - cached
    assert triton_counter(triton, "llm_sequences_forked_total") - forked == 3
    # The prompt once, the tokens of every choice.
    assert (
        whole.usage.completion_tokens >= 4
        and whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    )

    stream = openai_client.chat.completions.create(
        model=GENERATION,
        messages=messages,
        max_tokens=12,
        temperature=1.0,
        seed=11,
        n=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                assert c.index not in reasons, "a choice finished twice"
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens

    legacy = openai_client.completions.create(model=GENERATION, prompt=PROMPT, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in legacy.choices] == [0, 1, 2]
    assert len({c.text for c in legacy.choices}) == 1  # greedy: three forks, the same tokens


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused_naming_it(openai_client, n):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=4, n=n)
    error = caught.value.response.json()["error"]
    assert error["param"] == "n" and "16" in error["message"]


def test_seed_makes_sampling_reproducible(openai_client, direct):
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]

    def sampled(seed: int) -> str:
        response = openai_client.chat.completions.create(
            model=GENERATION, messages=messages, max_tokens=12, temperature=1, seed=seed
        )
        return response.choices[0].message.content

    first = sampled(1234)
    assert sampled(1234) == first
    # The same seed straight through Triton: the gateway passes it on unchanged.
    assert direct.chat(messages, max_tokens=12, temperature=1, seed=1234).text == first
    # Sampling is really random at temperature 1: other seeds give other texts.
    others = {sampled(seed) for seed in (1, 2, 3)}
    assert len(others | {first}) > 1, others


def test_concurrent_streams_with_the_async_sdk_each_get_their_own_answer(gateway, direct):
    """Streams share the gateway's one gRPC channel: each must still get its own answer."""
    import asyncio

    questions = [
        [{"role": "user", "content": q}]
        for q in (
            "What is the capital of France? Answer in one sentence.",
            "Name three colours.",
            "What is 2 + 2?",
            "Say hello in Spanish.",
        )
    ]
    expected = [direct.chat(q, max_tokens=8, temperature=0).text for q in questions]
    assert len(set(expected)) == len(expected), expected

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key=GATEWAY_TEST_KEY, max_retries=0, timeout=120
        ) as client:

            async def one(messages) -> str:
                stream = await client.chat.completions.create(
                    model=GENERATION, messages=messages, max_tokens=8, temperature=0, stream=True
                )
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            return await asyncio.gather(*(one(q) for q in questions))

    assert asyncio.run(run()) == expected


def test_unknown_chat_model_is_not_found(openai_client):
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=4)
    assert caught.value.response.json()["error"]["code"] == "model_not_found"


# --- text completions ----------------------------------------------------------------------


def test_completion_greedy_equals_triton_streamed_or_not(openai_client, direct):
    expected = direct.generate(PROMPT, max_tokens=12, temperature=0)
    whole = openai_client.completions.create(model=GENERATION, prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].text == expected.text and expected.text.strip()
    assert whole.choices[0].finish_reason == expected.finish_reason == "length"
    assert whole.usage.prompt_tokens == expected.num_input_tokens
    assert whole.usage.completion_tokens == expected.num_output_tokens == 12
    chunks = list(
        openai_client.completions.create(
            model=GENERATION, prompt=PROMPT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert len([c for c in text_chunks if c.choices[0].text]) > 1
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == expected.num_input_tokens


def test_completion_echo_prepends_the_prompt(openai_client, direct):
    expected = direct.generate(PROMPT, max_tokens=6, temperature=0)
    echoed = openai_client.completions.create(model=GENERATION, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + expected.text
    assert echoed.usage.completion_tokens == expected.num_output_tokens
    chunks = list(
        openai_client.completions.create(model=GENERATION, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
    )
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + expected.text


def test_completion_stop_and_default_length(openai_client, direct):
    expected = direct.generate(PROMPT, max_tokens=16, temperature=0)
    # A stop string taken from the greedy answer itself, so it surely hits.
    words = expected.text.split()
    assert len(words) >= 3, expected.text
    stop = words[2]
    stopped = openai_client.completions.create(model=GENERATION, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    assert expected.text.startswith(stopped.choices[0].text)
    # Without max_tokens /v1/completions generates 16 tokens, as OpenAI does.
    default = openai_client.completions.create(model=GENERATION, prompt=PROMPT, temperature=0)
    assert default.usage.completion_tokens == 16 and default.choices[0].text == expected.text


# --- models --------------------------------------------------------------------------------


def test_without_max_tokens_a_long_prompt_gets_the_rest_of_the_context(openai_client):
    # 4,086 prompt tokens: the completions default of 16 would pass the 4,096-token context, so
    # the engine generates the 10 tokens left (fit_to_context), as OpenAI fills the rest of it.
    prompt = "hello " * 4085
    done = openai_client.completions.create(
        model="text_generation", prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.usage.prompt_tokens + done.usage.completion_tokens == 4096, done.usage
    assert done.choices[0].finish_reason == "length"
    # A max_tokens the client chose is not changed: the engine's refusal names it.
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model="text_generation", prompt=prompt, max_tokens=16)
    assert "context limit of 4096" in str(info.value) and info.value.body["param"] == "max_tokens"


# The engine judges the sampling values (contract/sampling.py); its errors come
# back through Triton as data and reach the client as OpenAI's 400/413 naming the request's field.
ENGINE_REFUSALS = [
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": -5}, 400, "max_tokens"),
    ({"max_tokens": 2049}, 400, "max_tokens"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"max_completion_tokens": 4096}, 400, "max_completion_tokens"),
    ({"max_tokens": 10, "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"seed": -1}, 400, "seed"),
    ({"seed": 2**63}, 400, "seed"),
    ({"stop": "x" * 257}, 400, "stop"),
    ({"stop": ["ok", ""]}, 400, "stop"),
    ({"top_k": -1}, 400, "top_k"),
    ({"min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"repetition_penalty": 11}, 400, "repetition_penalty"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "system", "content": "  "}, {"role": "user", "content": "\n"}]}, 400, "messages"),
    # 65,536 four-byte characters (the gateway's character limit) and the JSON around them: over
    # the model's max_text_bytes (262,144).
    ({"messages": [{"role": "user", "content": "\U0001f600" * 65536}]}, 413, "messages"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": " \n\t"}, 400, "prompt"),
]


@pytest.mark.parametrize("fields, status, param", ENGINE_REFUSALS)
def test_the_engines_refusals_reach_the_client_naming_its_field(gateway, fields, status, param):
    chat = "prompt" not in fields
    body = {"model": GENERATION, **({"messages": [{"role": "user", "content": "Hi"}]} if chat else {}), **fields}
    if not chat or not any(k.startswith("max_") for k in fields):
        body.setdefault("max_tokens", 4)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for stream in (False, True):
        response = requests.post(f"{gateway.url}{path}", json={**body, "stream": stream}, headers=auth(), timeout=60)
        error = assert_openai_error(response, status, "invalid_request_error")
        assert error["param"] == param, (stream, error)
        assert "#error-data" not in error["message"]


def test_models_list_and_retrieve(openai_client):
    ids = [m.id for m in openai_client.models.list()]
    assert EMBEDDING in ids and GENERATION in ids
    model = openai_client.models.retrieve(GENERATION_ALIAS)
    assert model.id == GENERATION and model.object == "model"
    assert openai_client.models.retrieve(EMBEDDING).id == EMBEDDING
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.models.retrieve("no-such-model")
    assert caught.value.response.json()["error"]["param"] == "model"


# --- request ids, logs, metrics ------------------------------------------------------------


def _wait_for_log(gateway, request_id: str, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in log_lines(gateway) if line["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, f"{len(found)} log lines for {request_id}:\n{gateway.log_tail()}"
            return found[0]
        time.sleep(0.1)


def test_request_id_is_echoed_and_logged(openai_client, gateway, tokenizer):
    raw = openai_client.embeddings.with_raw_response.create(
        model=EMBEDDING, input=TEXTS[0], encoding_format="float", extra_headers={"X-Request-Id": "abc-123"}
    )
    assert raw.headers["x-request-id"] == "abc-123"
    assert raw.parse().data[0].embedding
    line = _wait_for_log(gateway, "abc-123")
    assert line["path"] == "/v1/embeddings" and line["status"] == 200 and line["method"] == "POST"
    assert line["key_id"] == KEY_ID and line["model"] == EMBEDDING
    assert line["prompt_tokens"] == len(tokenizer.encode(TEXTS[0]).ids)
    # Without the header the gateway makes one, different for each request.
    a = openai_client.models.with_raw_response.list().headers["x-request-id"]
    b = openai_client.models.with_raw_response.list().headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", a) and re.fullmatch(r"[0-9a-f]{32}", b) and a != b
    assert _wait_for_log(gateway, a)["path"] == "/v1/models"
    # A failed request is logged with its status and error, and errors carry the id too.
    bad = requests.post(
        f"{gateway.url}/v1/embeddings",
        json={"model": "nope", "input": "x"},
        headers=auth(**{"X-Request-Id": "bad-model-1"}),
        timeout=30,
    )
    assert_openai_error(bad, 404, "not_found_error")
    assert bad.headers["x-request-id"] == "bad-model-1"
    failed = _wait_for_log(gateway, "bad-model-1")
    assert failed["status"] == 404 and failed["error"] == "not_found_error"
    # A streamed chat is logged once, when it ends, with its token counts.
    stream = openai_client.chat.completions.with_raw_response.create(
        model=GENERATION,
        messages=QUESTION,
        max_tokens=3,
        temperature=0,
        stream=True,
        extra_headers={"X-Request-Id": "chat-stream-1"},
    )
    assert stream.headers["x-request-id"] == "chat-stream-1"
    assert list(stream.parse())
    chat_line = _wait_for_log(gateway, "chat-stream-1")
    assert chat_line["status"] == 200 and chat_line["completion_tokens"] == 3 and chat_line["prompt_tokens"] > 0


def test_metrics_count_requests_tokens_and_latency(openai_client, gateway, tokenizer):
    before = metric_samples(gateway)
    response = openai_client.embeddings.create(model=EMBEDDING, input=TEXTS, encoding_format="float")
    chat = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError):
        openai_client.embeddings.create(model="nope", input="x")
    after = metric_samples(gateway)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    embeddings = {"route": "/v1/embeddings"}
    assert delta("gateway_requests_total", **embeddings, status="200") == 1
    assert delta("gateway_requests_total", **embeddings, status="404") == 1
    assert delta("gateway_requests_total", route="/v1/chat/completions", status="200") == 1
    tokens_in = sum(len(tokenizer.encode(t).ids) for t in TEXTS)
    assert response.usage.prompt_tokens == tokens_in
    assert delta("gateway_tokens_total", key_id=KEY_ID, model=EMBEDDING, direction="in") == tokens_in
    assert delta("gateway_tokens_total", key_id=KEY_ID, model=GENERATION, direction="in") == chat.usage.prompt_tokens
    assert delta("gateway_tokens_total", key_id=KEY_ID, model=GENERATION, direction="out") == 4
    # Every key_id label is a 12-hex id, and ours is the test key's.
    key_ids = {dict(labels)["key_id"] for (name, labels) in after if name == "gateway_tokens_total"}
    assert KEY_ID in key_ids and all(re.fullmatch(r"[0-9a-f]{12}", k) for k in key_ids), key_ids
    # The latency histogram: one more observation in +Inf and in the count, a positive sum.
    hist = "gateway_request_duration_seconds"
    assert delta(f"{hist}_count", **embeddings, status="200") == 1
    assert delta(f"{hist}_bucket", **embeddings, status="200", le="+Inf") == 1
    assert delta(f"{hist}_sum", **embeddings, status="200") > 0
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in after.items()
        if name == f"{hist}_bucket" and dict(labels).get("route") == "/v1/embeddings" and dict(labels).get("status") == "200"
    )
    assert len(buckets) > 5 and [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative


def test_the_api_key_is_never_logged(gateway):
    # Last in the module: every request above has been logged by now.
    text = gateway.log_path.read_text(encoding="utf-8", errors="replace")
    assert "openai_gateway.access" in text and KEY_ID in text
    assert GATEWAY_TEST_KEY not in text
    assert GATEWAY_TEST_KEY[len("sk-") :] not in text
