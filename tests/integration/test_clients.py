"""The clients package against the real server: both protocols agree, batching past
max_batch_size, the CLI end to end, the asyncio client under 64 concurrent requests, and
the server's per-request errors reaching the caller."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

from clients import AsyncEmbeddingClient, EmbeddingClient, EmbeddingError, cosine_similarity_matrix, embed
from clients.embeddings import cli
from server.layout import ROOT

DIM = 384
SAME = 0.9999  # cosine between two computations of the same text (FP32, different batches)

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar.",
    "The stock market fell sharply on Monday.",
]
# Distinct enough that every text is nearest to itself: a row out of order cannot pass.
TOPICS = ["weather", "football", "cooking", "taxes", "astronomy", "gardening", "jazz", "chess"]
MANY = [f"Note {i}: a short remark about {TOPICS[i % len(TOPICS)]} number {i * 7919 % 1000}." for i in range(64)]


def diagonal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.diag(cosine_similarity_matrix(a, b))


@pytest.fixture(scope="module")
def reference(triton) -> np.ndarray:
    """MANY embedded in one HTTP request: the baseline the other paths are compared with."""
    with EmbeddingClient(triton.http_url) as client:
        return client.embed(MANY)


def test_http_and_grpc_agree(triton):
    with EmbeddingClient(triton.http_url, protocol="http") as client:
        http = client.embed(SENTENCES)
    with EmbeddingClient(triton.grpc_url, protocol="grpc") as client:
        grpc = client.embed(SENTENCES)
    assert http.shape == grpc.shape == (3, DIM) and http.dtype == grpc.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(http, axis=1), 1.0, atol=1e-4)
    assert diagonal(http, grpc).min() >= SAME
    sim = cosine_similarity_matrix(http)
    assert sim[0, 1] > sim[0, 2] + 0.2, "paraphrases should be closer than unrelated sentences"


def test_more_than_max_batch_size_texts(triton, reference):
    texts = MANY + MANY[:6] + MANY  # 134 texts: requests of 64, 64 and 6
    out = embed(texts, url=triton.http_url)
    assert out.shape == (134, DIM)
    expected = np.concatenate([reference, reference[:6], reference])
    assert diagonal(out, expected).min() >= SAME


def test_priority_and_timeout_accepted(triton):
    for protocol, url in (("http", triton.http_url), ("grpc", triton.grpc_url)):
        for priority in (1, 2):
            with EmbeddingClient(url, protocol=protocol, priority=priority, timeout_s=60) as client:
                assert client.embed(SENTENCES[:1]).shape == (1, DIM)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_text_raises_with_server_message(triton, protocol):
    url = triton.http_url if protocol == "http" else triton.grpc_url
    with EmbeddingClient(url, protocol=protocol) as client:
        with pytest.raises(EmbeddingError) as info:
            client.embed(["fine", "   "])
    assert "TEXT[1]" in info.value.server_message and "text_embedding" in info.value.server_message
    assert info.value.status


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_long_text_is_refused_unless_the_client_truncates_it(triton, protocol):
    url = triton.http_url if protocol == "http" else triton.grpc_url
    long = " ".join(f"word{i} stands here" for i in range(300))  # far over 256 tokens
    head = " ".join(f"word{i} stands here" for i in range(60))
    with EmbeddingClient(url, protocol=protocol) as client:
        with pytest.raises(EmbeddingError) as info:
            client.embed([SENTENCES[0], long])
    assert "TEXT[1]" in info.value.server_message and "256" in info.value.server_message
    with EmbeddingClient(url, protocol=protocol, truncation="right") as client:
        right = client.embed([SENTENCES[0], long, head])
    left = embed([long], url=url, protocol=protocol, truncation="left")
    assert right.shape == (3, DIM)
    assert diagonal(right[1:2], right[2:3]).min() > 0.9  # right keeps the head of the text
    assert diagonal(right[1:2], left).min() < SAME  # left keeps its end: another vector
    with pytest.raises(ValueError, match="truncation"):
        EmbeddingClient(url, protocol=protocol, truncation="middle")


def test_the_tokenizers_truncate_parameter_is_the_default_of_requests_without_truncate(triton, http_client):
    """A server-level default (TEI's --auto-truncate): text_tokenizer's ``truncate`` parameter set
    true, a long text sent without TRUNCATE is embedded from its first tokens, as with TRUNCATE."""
    config = http_client.get_model_config("text_tokenizer")
    assert config["parameters"]["truncate"] == {"string_value": "false"}
    long = " ".join(f"default{i} truncation here" for i in range(300))
    original = json.dumps(config)
    config["parameters"]["truncate"] = {"string_value": "true"}
    http_client.load_model("text_tokenizer", config=json.dumps(config))
    try:
        with EmbeddingClient(triton.http_url, protocol="http", model="text_embedding") as client:
            by_default = client.embed([long])
        with EmbeddingClient(triton.http_url, protocol="http", model="text_embedding", truncation="right") as client:
            asked = client.embed([long])
        assert diagonal(by_default, asked).min() > SAME
    finally:
        # The file's config again (a load without one keeps the override while the files are unchanged).
        http_client.load_model("text_tokenizer", config=original)
    with EmbeddingClient(triton.http_url, protocol="http", model="text_embedding") as client:
        with pytest.raises(EmbeddingError) as info:
            client.embed([long.replace("default", "again")])  # another text: not one the response cache holds
    assert "TEXT[0]" in info.value.server_message and "256" in info.value.server_message


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unknown_model(triton, protocol):
    url = triton.http_url if protocol == "http" else triton.grpc_url
    with EmbeddingClient(url, protocol=protocol, model="no_such_model") as client:
        with pytest.raises(EmbeddingError) as info:
            client.embed(["hello"])
    # The server's own words name the model (our prefix does too, so check the server's part).
    assert "no_such_model" in info.value.server_message


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_async_64_concurrent_requests_in_order(triton, reference, protocol):
    url = triton.http_url if protocol == "http" else triton.grpc_url

    async def go() -> np.ndarray:
        async with AsyncEmbeddingClient(url, protocol=protocol, priority=1) as client:
            return await client.embed_many(MANY, concurrency=64, per_request=1)

    out = asyncio.run(go())
    assert out.shape == (64, DIM)
    assert diagonal(out, reference).min() >= SAME
    np.testing.assert_array_equal(cosine_similarity_matrix(out, reference).argmax(axis=1), np.arange(64))


def test_async_return_exceptions_fails_only_bad_texts(triton, reference):
    texts = [MANY[0], "", MANY[1], b"\xff\xfe not utf-8", MANY[2]]

    async def go():
        async with AsyncEmbeddingClient(triton.grpc_url, protocol="grpc") as client:
            return await client.embed_many(texts, concurrency=8, return_exceptions=True)

    results = asyncio.run(go())
    assert len(results) == 5
    for i, ref in ((0, 0), (2, 1), (4, 2)):
        assert isinstance(results[i], np.ndarray) and results[i].shape == (DIM,)
        assert diagonal(results[i], reference[ref]).min() >= SAME
    assert isinstance(results[1], EmbeddingError) and "empty" in results[1].server_message
    assert isinstance(results[3], EmbeddingError) and "UTF-8" in results[3].server_message.upper()
    assert (results[3].start, results[3].stop) == (3, 4)


def test_cli_embeds_and_compares(triton, reference, capsys):
    assert cli.main(["--url", triton.http_url, MANY[0], MANY[1]]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["text"] for r in records] == MANY[:2]
    vectors = np.array([r["embedding"] for r in records], dtype=np.float32)
    assert diagonal(vectors, reference[:2]).min() >= SAME

    assert cli.main(["--protocol", "grpc", "--url", triton.grpc_url, "--priority", "1", "--similarity", *SENTENCES]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == f"[0] {SENTENCES[0]}"
    matrix = np.array([row.split()[1:] for row in table[5:]], dtype=float)
    assert matrix.shape == (3, 3) and np.allclose(np.diag(matrix), 1.0, atol=1e-4)

    assert cli.main(["--url", triton.http_url, "--similarity", "--json", *SENTENCES]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["texts"] == SENTENCES and np.allclose(doc["similarity"], matrix, atol=1e-4)


def test_cli_server_error_is_one_line(triton, capsys):
    assert cli.main(["--url", triton.http_url, "--model", "no_such_model", "hello"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "no_such_model" in captured.err
    assert cli.main(["--url", triton.http_url, "fine", ""]) == 1
    assert "text is empty" in capsys.readouterr().err


def test_cli_subprocess_reads_stdin(triton, reference):
    proc = subprocess.run(
        [sys.executable, "-m", "clients", "--protocol", "grpc", "--url", triton.grpc_url, "--vectors-only"],
        input="\n".join(MANY[:3]) + "\n\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    vectors = np.array(json.loads(proc.stdout), dtype=np.float32)
    assert vectors.shape == (3, DIM)
    assert diagonal(vectors, reference[:3]).min() >= SAME
