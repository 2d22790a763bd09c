"""The clients package without a server: batching, encoding, options, cosine matrix, the
CLI's input and output, error mapping, and both clients against fakes and a closed port."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from clients import AsyncEmbeddingClient, EmbeddingClient, EmbeddingError, cosine_similarity_matrix
from clients.embeddings import (
    ClientOptions,
    as_text_list,
    cli,
    encode_texts,
    server_timeout_us,
    split_batches,
    to_embedding_error,
)
from clients.embeddings import core as core_module
from server.process import free_port

DIM = 4


def fake_embeddings(texts) -> np.ndarray:
    """Distinct unit rows that encode each text's length, so order is checkable."""
    rows = np.zeros((len(texts), DIM), dtype=np.float32)
    for i, t in enumerate(texts):
        rows[i] = [len(t), 1.0, 0.0, 0.0]
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


class FakeResult:
    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def as_numpy(self, name: str):
        return self.rows if name == "EMBEDDING" else None


# --- pure helpers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "count, size, expected",
    [
        (0, 64, []),
        (1, 64, [(0, 1)]),
        (64, 64, [(0, 64)]),
        (65, 64, [(0, 64), (64, 65)]),
        (130, 64, [(0, 64), (64, 128), (128, 130)]),
        (5, 2, [(0, 2), (2, 4), (4, 5)]),
    ],
)
def test_split_batches_covers_all_in_order(count, size, expected):
    ranges = split_batches(count, size)
    assert ranges == expected
    assert [i for a, b in ranges for i in range(a, b)] == list(range(count))


def test_split_batches_refuses_zero_size():
    with pytest.raises(ValueError):
        split_batches(3, 0)


def test_as_text_list_accepts_sequences_and_bytes():
    assert as_text_list(("a", b"b")) == ["a", b"b"]


@pytest.mark.parametrize("bad, error", [([], ValueError), ("hello", TypeError), (b"hello", TypeError), (["a", 3], TypeError)])
def test_as_text_list_refuses(bad, error):
    with pytest.raises(error):
        as_text_list(bad)


def test_encode_texts_is_utf8_object_column():
    data = encode_texts(["héllo", b"\xff raw", "caf\udce9"])
    assert data.shape == (3, 1) and data.dtype == object
    # str -> UTF-8; bytes unchanged; a surrogate escape goes back to its original byte.
    assert data[:, 0].tolist() == ["héllo".encode(), b"\xff raw", b"caf\xe9"]


def test_options_default_url_per_protocol():
    assert ClientOptions.create(protocol="http").url == "127.0.0.1:8000"
    assert ClientOptions.create(protocol="grpc").url == "127.0.0.1:8001"
    assert ClientOptions.create("http://localhost:9000/").url == "localhost:9000"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"protocol": "ftp"},
        {"priority": -1},
        {"priority": 1.5},
        {"batch_size": 0},
        {"batch_size": 65},
        {"timeout_s": 0},
        {"model": ""},
        {"url": "https://host:1"},
    ],
)
def test_options_refuse_bad_values(kwargs):
    with pytest.raises(ValueError):
        ClientOptions.create(**kwargs)


def test_infer_kwargs_per_protocol():
    http = ClientOptions.create(protocol="http", priority=1, timeout_s=1.5).infer_kwargs()
    assert http == {"model_version": "", "priority": 1, "timeout": 1_500_000}
    grpc = ClientOptions.create(protocol="grpc", priority=2, timeout_s=0.25, model_version="1").infer_kwargs()
    assert grpc == {"model_version": "1", "priority": 2, "timeout": 250_000, "client_timeout": 0.25}
    assert ClientOptions.create().infer_kwargs() == {"model_version": "", "priority": 0}
    assert server_timeout_us(1e-9) == 1


def test_cosine_matrix_of_known_vectors():
    a = np.array([[3.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    sim = cosine_similarity_matrix(a)
    assert sim.dtype == np.float32 and sim.shape == (3, 3)
    s = np.sqrt(0.5)
    np.testing.assert_allclose(sim, [[1, 0, s], [0, 1, s], [s, s, 1]], atol=1e-6)
    np.testing.assert_allclose(cosine_similarity_matrix(a, np.array([-1.0, 0.0])), [[-1], [0], [-s]], atol=1e-6)


def test_cosine_matrix_zero_row_and_mismatch():
    sim = cosine_similarity_matrix(np.array([[0.0, 0.0], [1.0, 0.0]]))
    assert not np.isnan(sim).any()
    np.testing.assert_allclose(sim, [[0, 0], [0, 1]])
    with pytest.raises(ValueError, match="dimension mismatch"):
        cosine_similarity_matrix(np.ones((2, 3)), np.ones((2, 4)))
    with pytest.raises(ValueError):
        cosine_similarity_matrix(np.ones((2, 2, 2)))


def test_error_keeps_server_message_and_names_the_slice():
    options = ClientOptions.create()
    server = InferenceServerException("in ensemble 'text_embedding', TEXT[1]: text is empty", status="400")
    err = to_embedding_error(server, options, 64, 128, 130)
    assert err.server_message == "in ensemble 'text_embedding', TEXT[1]: text is empty"
    assert (err.status, err.start, err.stop) == ("400", 64, 128)
    assert str(err) == "model 'text_embedding', texts[64:128] [400]: in ensemble 'text_embedding', TEXT[1]: text is empty"
    # Unsplit calls do not name a slice.
    assert "texts[" not in str(to_embedding_error(server, options, 0, 3, 3))
    refused = to_embedding_error(ConnectionRefusedError(111, "Connection refused"), options, 0, 1, 1)
    assert "cannot reach the http server at 127.0.0.1:8000" in str(refused)


# --- sync client against a fake transport ----------------------------------------------


class FakeSyncTransport:
    def __init__(self, fail_on: str | None = None):
        self.calls: list[tuple[list, dict]] = []
        self.fail_on = fail_on

    def infer(self, model, inputs, outputs=None, **kwargs):
        texts = [t.decode() for t in inputs]
        self.calls.append((texts, kwargs))
        if self.fail_on in texts:
            raise InferenceServerException(f"TEXT[{texts.index(self.fail_on)}]: refused", status="400")
        return FakeResult(fake_embeddings(texts))

    def close(self):
        pass


@pytest.fixture
def raw_requests(monkeypatch):
    """build_request returns the encoded texts, so fakes can see what each request holds."""
    fake = lambda options, texts: (list(encode_texts(texts)[:, 0]), [])  # noqa: E731
    monkeypatch.setattr(core_module, "build_request", fake)  # both clients' requests are core's


def test_sync_embed_splits_into_max_batch_requests(raw_requests):
    texts = ["x" * (i % 7 + 1) + str(i) for i in range(130)]
    with EmbeddingClient(priority=1, timeout_s=2.0) as client:
        client._client = fake = FakeSyncTransport()
        out = client.embed(texts)
    assert [len(t) for t, _ in fake.calls] == [64, 64, 2]
    assert [t for call, _ in fake.calls for t in call] == texts
    assert all(kw == {"model_version": "", "priority": 1, "timeout": 2_000_000} for _, kw in fake.calls)
    np.testing.assert_array_equal(out, fake_embeddings(texts))


def test_sync_embed_failure_names_the_request(raw_requests):
    texts = [f"t{i}" for i in range(100)]
    client = EmbeddingClient(batch_size=30)
    client._client = FakeSyncTransport(fail_on="t65")
    with pytest.raises(EmbeddingError) as info:
        client.embed(texts)
    assert (info.value.start, info.value.stop, info.value.status) == (60, 90, "400")
    assert info.value.server_message == "TEXT[5]: refused"
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.embed(["a"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sync_client_unreachable_server(protocol):
    with EmbeddingClient(f"127.0.0.1:{free_port()}", protocol=protocol, timeout_s=5) as client:
        with pytest.raises(EmbeddingError, match=f"cannot reach the {protocol} server"):
            client.embed(["hello"])


# --- asyncio client against a fake transport --------------------------------------------


class FakeAsyncTransport:
    def __init__(self, fail_on: str | None = None):
        self.in_flight = 0
        self.max_in_flight = 0
        self.sizes: list[int] = []
        self.fail_on = fail_on

    async def infer(self, model, inputs, outputs=None, **kwargs):
        texts = [t.decode() for t in inputs]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            # Later texts finish first, so input order must be restored by the client.
            await asyncio.sleep(0.001 * (len(texts[0]) % 5))
            if self.fail_on in texts:
                raise InferenceServerException("text is empty", status="400")
            self.sizes.append(len(texts))
            return FakeResult(fake_embeddings(texts))
        finally:
            self.in_flight -= 1

    async def close(self):
        pass


def run_async(texts, fake, **kwargs):
    async def go():
        async with AsyncEmbeddingClient() as client:
            client._client = fake
            return await client.embed_many(texts, **kwargs)

    return asyncio.run(go())


def test_async_embed_many_bounds_concurrency_and_keeps_order(raw_requests):
    texts = ["y" * (20 - i % 20) for i in range(50)]
    fake = FakeAsyncTransport()
    out = run_async(texts, fake, concurrency=8, per_request=1)
    assert fake.max_in_flight == 8
    np.testing.assert_array_equal(out, fake_embeddings(texts))


def test_async_return_exceptions_fails_only_that_request(raw_requests):
    texts = ["aa", "cccc", "bad", "dd", "eeeee"]
    out = run_async(texts, FakeAsyncTransport(fail_on="bad"), per_request=2, return_exceptions=True)
    assert len(out) == 5
    # per_request=2: "bad" shares its request (texts[2:4]) with "dd", so both carry its error.
    assert isinstance(out[2], EmbeddingError) and out[3] is out[2]
    assert (out[2].start, out[2].stop, out[2].server_message) == (2, 4, "text is empty")
    for i in (0, 1, 4):
        np.testing.assert_array_equal(out[i], fake_embeddings([texts[i]])[0])


def test_async_raises_first_error_without_return_exceptions(raw_requests):
    with pytest.raises(EmbeddingError, match="text is empty"):
        run_async(["a", "bad", "c"], FakeAsyncTransport(fail_on="bad"))


def test_async_embed_uses_batch_size(raw_requests):
    async def go():
        fake = FakeAsyncTransport()
        async with AsyncEmbeddingClient(batch_size=10) as client:
            client._client = fake
            out = await client.embed([f"t{i}" for i in range(25)])
        return fake, out

    fake, out = asyncio.run(go())
    assert sorted(fake.sizes) == [5, 10, 10] and out.shape == (25, DIM)


@pytest.mark.parametrize("kwargs", [{"concurrency": 0}, {"per_request": 0}, {"per_request": 65}])
def test_async_refuses_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        run_async(["a"], FakeAsyncTransport(), **kwargs)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_async_client_unreachable_server(protocol):
    async def go():
        async with AsyncEmbeddingClient(f"127.0.0.1:{free_port()}", protocol=protocol, timeout_s=5) as client:
            results = await client.embed_many(["a", "b"], return_exceptions=True)
            with pytest.raises(EmbeddingError, match=f"cannot reach the {protocol} server"):
                await client.embed(["a"])
        return results

    results = asyncio.run(go())
    assert len(results) == 2 and all(isinstance(r, EmbeddingError) for r in results)


# --- CLI ------------------------------------------------------------------------------------


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def test_split_lines_strips_endings_and_skips_blank_lines():
    assert cli.split_lines("first\r\nsecond\n\n   \nthird\x0cstill third\n") == ["first", "second", "third\x0cstill third"]


def test_collect_texts_sources(tmp_path):
    assert cli.collect_texts(parse("a b", "c"), io.StringIO("ignored")) == ["a b", "c"]
    assert cli.collect_texts(parse(), io.StringIO("x\ny\n")) == ["x", "y"]
    assert cli.collect_texts(parse("-"), io.StringIO("x\n")) == ["x"]
    # Raw bytes that are not UTF-8 survive as surrogate escapes, for the server to judge.
    assert cli.collect_texts(parse(), io.BytesIO(b"ok\n\xff\n")) == ["ok", "\udcff"]
    path = tmp_path / "texts.txt"
    path.write_bytes(b"one\r\ntwo\n\n")
    assert cli.collect_texts(parse("--file", str(path)), io.StringIO()) == ["one", "two"]


@pytest.mark.parametrize(
    "argv, stdin, message",
    [
        (["--file", "x.txt", "text"], "", "not both"),
        (["-", "text"], "", "cannot be mixed"),
        ([], "\n \n", "no texts to embed in stdin"),
        (["--file", "/nonexistent/texts.txt"], "", "cannot read"),
    ],
)
def test_collect_texts_usage_errors(argv, stdin, message):
    with pytest.raises(cli.UsageError, match=message):
        cli.collect_texts(parse(*argv), io.StringIO(stdin))


def test_float32_list_prints_shortest_digits():
    assert cli.float32_list(np.array([0.1, -0.5, 1 / 3], dtype=np.float32)) == [0.1, -0.5, 0.33333334]
    assert json.dumps(cli.float32_list(np.array([0.1], dtype=np.float32))) == "[0.1]"


def test_output_formats():
    texts = ["a", "bb"]
    vectors = fake_embeddings(texts)
    records = json.loads(cli.format_embeddings(texts, vectors))
    assert [r["text"] for r in records] == texts
    np.testing.assert_allclose(np.array([r["embedding"] for r in records]), vectors, rtol=1e-6)
    np.testing.assert_allclose(np.array(json.loads(cli.format_embeddings(texts, vectors, vectors_only=True))), vectors, rtol=1e-6)

    matrix = cosine_similarity_matrix(vectors)
    table = cli.format_similarity_table(["a\tsentence", "x" * 100], matrix)
    lines = table.splitlines()
    assert lines[0] == "[0] a\\tsentence" and lines[1].endswith("…") and len(lines[1]) < 80
    assert lines[3].split() == ["[0]", "[1]"]
    assert lines[4].split()[0] == "[0]" and lines[4].split()[1] == "1.0000"
    doc = json.loads(cli.format_similarity_json(texts, matrix))
    assert doc["texts"] == texts and doc["similarity"][0][0] == 1.0


class FakeClient:
    """Stands in for EmbeddingClient in the CLI; records its options."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        ClientOptions.create(**kwargs)  # the real client's validation
        FakeClient.made.append(kwargs)

    def embed(self, texts):
        return fake_embeddings(texts)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def fake_cli_client(monkeypatch):
    FakeClient.made = []
    monkeypatch.setattr(cli, "EmbeddingClient", FakeClient)
    return FakeClient


def test_main_prints_json_records(fake_cli_client, capsys):
    argv = ["--protocol", "grpc", "--priority", "1", "--timeout", "2.5", "--model", "m", "hello", "world!"]
    assert cli.main(argv) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["text"] for r in records] == ["hello", "world!"] and len(records[0]["embedding"]) == DIM
    made = fake_cli_client.made[0]
    assert (made["protocol"], made["priority"], made["timeout_s"], made["model"], made["url"]) == ("grpc", 1, 2.5, "m", None)


def test_main_reads_stdin_and_prints_similarity(fake_cli_client, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("a\nbbbbbbbbbb\nthe third text\n"))
    assert cli.main(["--similarity"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["[0] a", "[1] bbbbbbbbbb", "[2] the third text"]
    matrix = np.array([line.split()[1:] for line in lines[5:]], dtype=float)
    np.testing.assert_allclose(matrix, cosine_similarity_matrix(fake_embeddings(["a", "b" * 10, "c" * 14])), atol=1e-4)


@pytest.mark.parametrize(
    "argv",
    [
        ["--similarity", "--vectors-only", "x"],
        ["--priority", "-1", "x"],
        ["--timeout", "0", "x"],
        ["--batch-size", "65", "x"],
        ["--protocol", "ftp", "x"],
        ["--url", "https://secure:1", "x"],
        ["--no-such-flag"],
    ],
)
def test_main_usage_errors_exit_2(fake_cli_client, capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_main_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    assert "--similarity" in capsys.readouterr().out


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_main_unreachable_server_is_one_line_exit_1(capsys, protocol):
    assert cli.main(["--protocol", protocol, "--url", f"127.0.0.1:{free_port()}", "hello"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("embed: error: ") and captured.err.count("\n") == 1
    assert "cannot reach" in captured.err and "Traceback" not in captured.err
