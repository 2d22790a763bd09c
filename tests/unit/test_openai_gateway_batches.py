"""The Batch API's parts without a server: the store's exactly-once results and leases, the
checks of an input file, and the multipart parser of uploads."""

from __future__ import annotations

import json
import time

import pytest

from openai_gateway.batch_store import BatchStore
from openai_gateway.batches import check_lines, new_batch
from openai_gateway.errors import APIError
from openai_gateway.routes.files import parse_form


def line(custom_id: str, url: str = "/v1/embeddings", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", "input": "x", **body}}


@pytest.fixture
def store(tmp_path):
    s = BatchStore(tmp_path)
    yield s
    s.close()


def test_a_result_counts_once_and_survives_a_reopen(store, tmp_path):
    store.add_file("file-a", "batch", "a.jsonl", 1, 1)
    batch = new_batch("batch_a", "/v1/embeddings", "file-a", "24h", None, 3, [])
    assert store.add_batch(batch, 3, "key")
    assert store.add_result("batch_a", 1, True, b"{}")
    assert not store.add_result("batch_a", 1, False, b"{}")  # a second answer of the line is dropped
    store.add_result("batch_a", 2, False, b"{}")
    store.close()
    again = BatchStore(tmp_path)
    assert again.done_lines("batch_a") == {1, 2}
    assert again.get_batch("batch_a")["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    again.close()


def test_one_gateway_holds_a_batch_until_its_lease_lapses(store):
    store.add_file("file-b", "batch", "b.jsonl", 1, 1)
    assert store.add_batch(new_batch("batch_b", "/v1/embeddings", "file-b", "24h", None, 1, []), 1, "key")
    assert store.take_leases("one", 0.2, 16) == ["batch_b"]
    assert store.take_leases("two", 0.2, 16) == []
    assert store.renew_lease("one", "batch_b", 0.2)
    time.sleep(0.3)
    assert store.take_leases("two", 30, 16) == ["batch_b"]
    assert not store.renew_lease("one", "batch_b", 30)  # the first learns it lost the batch
    assert store.transition("batch_b", "cancelling", ("in_progress", "validating"))
    assert not store.transition("batch_b", "cancelling", ("in_progress", "validating"))
    assert store.get_batch("batch_b")["cancelling_at"]


def test_the_lines_of_a_file_are_checked_with_their_numbers(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [line("a"), line("a"), {**line("b"), "method": "GET"}, line("c", "/v1/chat/completions"), line("d", dimensions="x")]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\nnot json\n")
    total, errors = check_lines(path, 100, "/v1/embeddings")
    assert total == 6
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (2, "duplicate_custom_id", "custom_id"),
        (3, "invalid_method", "method"),
        (4, "mismatched_endpoint", "url"),
        (5, "invalid_request", "body.dimensions"),
        (7, "invalid_json_line", None),
    ]
    assert check_lines(path, 3, None)[1][-1]["code"] == "too_many_tasks"


def test_parse_form_finds_the_file_and_the_purpose(tmp_path):
    body = (
        b"preamble\r\n--XyZ\r\n"
        b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XyZ\r\n'
        b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
        b'{"a": 1}\r\n{"b": 2}\r\n--XyZ--\r\n'
    )
    path = tmp_path / "body"
    path.write_bytes(body)
    fields, upload = parse_form(path, b"XyZ")
    assert fields == {"purpose": "batch"} and upload is not None
    start, end, filename = upload
    assert (body[start:end], filename) == (b'{"a": 1}\r\n{"b": 2}', "in.jsonl")
    path.write_bytes(body[:-30])
    with pytest.raises(APIError) as info:
        parse_form(path, b"XyZ")
    assert info.value.status == 400 and info.value.param == "file"


def test_a_batch_resumed_after_its_window_runs_no_line_and_expires(tmp_path):
    """A gateway that takes up a batch whose completion window has passed (it was down at the
    time) sends none of its remaining lines: they go to the error file as batch_expired."""
    import asyncio

    runner = _runner(tmp_path)
    store = runner.store()
    store.file_path("file-in").write_text("".join(json.dumps(line(c)) + "\n" for c in "abc"))
    store.add_file("file-in", "batch", "in.jsonl", 1, 1)
    batch = new_batch("batch_late", "/v1/embeddings", "file-in", "24h", None, 3, [])
    store.add_batch({**batch, "status": "in_progress", "expires_at": int(time.time()) - 1}, 3, "key")
    assert store.take_leases(runner.owner, 30, 16) == [batch["id"]]
    sent: list = []

    async def call(url, body, key_id):
        sent.append(body)
        return 200, {}, "req"

    runner.call = call  # type: ignore[method-assign]

    async def run():
        runner._slots = asyncio.Semaphore(4)
        await runner._drive("batch_late")

    asyncio.run(run())
    done = store.get_batch("batch_late")
    assert sent == [] and done["status"] == "expired" and done["output_file_id"] is None
    errors = store.file_path(done["error_file_id"]).read_text().splitlines()
    assert [json.loads(e)["error"]["code"] for e in errors] == ["batch_expired"] * 3
    store.close()


def test_an_expired_batchs_files_list_each_line_once_when_a_result_lands_during_finalize(tmp_path):
    """A line whose commit lands while the files are written (its request was in flight when the
    window passed) is in the output file or expired in the error file, never both."""
    import asyncio

    runner = _runner(tmp_path)
    store = runner.store()
    store.file_path("file-in").write_text("".join(json.dumps(line(c)) + "\n" for c in "abc"))
    store.add_file("file-in", "batch", "in.jsonl", 1, 1)
    batch = new_batch("batch_race", "/v1/embeddings", "file-in", "24h", None, 3, [])
    store.add_batch({**batch, "status": "in_progress", "expires_at": int(time.time()) - 1}, 3, "key")
    assert store.take_leases(runner.owner, 30, 16) == [batch["id"]]
    for n in (1, 2):
        store.add_result("batch_race", n, True, json.dumps({"custom_id": "abc"[n - 1]}).encode())
    late = [b'{"custom_id": "c"}']

    def after_first_read(method):
        def read(*args, **kwargs):
            out = method(*args, **kwargs)
            while late:  # the in-flight line's commit, right after the finalizer's first read
                store.add_result("batch_race", 3, True, late.pop())
            return out

        return read

    for name in ("done_lines", "records", "result_rows"):
        if hasattr(store, name):
            setattr(store, name, after_first_read(getattr(store, name)))
    asyncio.run(runner._finalize(store.get_batch("batch_race"), "expired"))
    done = store.get_batch("batch_race")
    listed = [
        json.loads(r)["custom_id"]
        for field in ("output_file_id", "error_file_id")
        if done[field]
        for r in store.file_path(done[field]).read_text().splitlines()
    ]
    assert done["status"] == "expired" and sorted(listed) == ["a", "b", "c"]
    store.close()


def _runner(tmp_path):
    from types import SimpleNamespace
    from unittest import mock

    from openai_gateway.batches import BatchRunner
    from openai_gateway.settings import GatewaySettings

    app = SimpleNamespace(state=SimpleNamespace(gateway=SimpleNamespace(metrics=mock.MagicMock())))
    return BatchRunner(app, GatewaySettings(batch_dir=tmp_path))  # type: ignore[arg-type]


def _in_progress(store, batch_id: str, lines: str = "abc") -> None:
    store.file_path("file-in").write_text("".join(json.dumps(line(c)) + "\n" for c in lines))
    store.add_file("file-in", "batch", "in.jsonl", 1, int(time.time()))
    batch = new_batch(batch_id, "/v1/embeddings", "file-in", "24h", None, len(lines), [])
    assert store.add_batch({**batch, "status": "in_progress"}, len(lines), "key")


def test_a_file_cannot_be_deleted_under_a_batch_nor_a_batch_created_on_a_deleted_file(store):
    """Both checks are one statement each, so DELETE /v1/files racing POST /v1/batches leaves
    either the file and its batch or neither."""
    store.file_path("file-x").write_text("{}\n")
    store.add_file("file-x", "batch", "x.jsonl", 3, 1)
    assert store.add_batch(new_batch("batch_x", "/v1/embeddings", "file-x", "24h", None, 1, []), 1, "key")
    assert store.delete_file("file-x") == "batch_x"
    assert store.get_file("file-x") is not None and store.file_path("file-x").exists()
    store.transition("batch_x", "cancelled", ("validating",))
    assert store.delete_file("file-x") is True
    assert not store.add_batch(new_batch("batch_y", "/v1/embeddings", "file-x", "24h", None, 1, []), 1, "key")
    assert store.get_batch("batch_y") is None and store.delete_file("file-x") is False


def test_a_batch_that_keeps_failing_to_run_fails_after_a_few_attempts(tmp_path):
    import asyncio

    from openai_gateway.batches import RUN_ATTEMPTS

    runner = _runner(tmp_path)
    store = runner.store()
    _in_progress(store, "batch_gone")
    store.file_path("file-in").unlink()  # its input lost: every attempt fails
    assert store.take_leases(runner.owner, 30, 16) == ["batch_gone"]

    async def run():
        runner._slots = asyncio.Semaphore(4)
        for _ in range(RUN_ATTEMPTS):
            await runner._run("batch_gone")

    asyncio.run(run())
    done = store.get_batch("batch_gone")
    assert done["status"] == "failed" and done["failed_at"]
    (error,) = done["errors"]["data"]
    assert error["code"] == "batch_run_failed" and "FileNotFoundError" in error["message"]
    assert str(tmp_path) not in error["message"]  # the server's folders are not shown
    store.close()


def test_a_gateway_that_lost_the_lease_does_not_commit_the_output(tmp_path):
    """Finalising is fenced by the lease: the files are written under names of the writer's own
    and moved in place in the transaction that checks the lease and records them."""
    import asyncio

    one, two = _runner(tmp_path), _runner(tmp_path)
    store = one.store()
    _in_progress(store, "batch_f")
    for n, c in enumerate("abc", 1):
        store.add_result("batch_f", n, True, json.dumps({"custom_id": c}).encode())
    assert store.take_leases(one.owner, 0.01, 16) == ["batch_f"]
    time.sleep(0.05)
    assert two.store().take_leases(two.owner, 30, 16) == ["batch_f"]
    asyncio.run(one._finalize(store.get_batch("batch_f"), "completed"))
    batch = store.get_batch("batch_f")
    assert batch["status"] == "in_progress" and batch["output_file_id"] is None
    assert sorted(p.name for p in store.files_dir.iterdir()) == ["file-in.jsonl"]
    asyncio.run(two._finalize(two.store().get_batch("batch_f"), "completed"))
    batch = store.get_batch("batch_f")
    assert batch["status"] == "completed" and len(store.file_path(batch["output_file_id"]).read_text().splitlines()) == 3
    store.close()
    two.store().close()


def test_close_stops_the_runs_before_the_store_and_a_cancel_is_not_swallowed(tmp_path):
    """At shutdown the lines in flight are dropped (not committed), the batch is not finalised,
    and its lease is given up."""
    import asyncio

    runner = _runner(tmp_path)
    store = runner.store()
    _in_progress(store, "batch_s")
    sent: list = []

    async def call(url, body, key_id):
        sent.append(body)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)  # a line that takes a moment to stop
            raise

    runner.call = call  # type: ignore[method-assign]
    runner.poll_s = 0.02

    async def run():
        await runner.start()
        for _ in range(500):
            if sent:
                break
            await asyncio.sleep(0.01)
        await runner.close()
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.sleep(0.2)  # anything left running would finalise the batch here
        return left

    assert asyncio.run(run()) == []
    again = BatchStore(tmp_path)
    assert sent and runner._running == {}
    assert again.get_batch("batch_s")["status"] == "in_progress" and again.done_lines("batch_s") == set()
    assert again.batch_row("batch_s") is not None
    assert again._one("SELECT lease_owner FROM batches WHERE id = 'batch_s'") == (None,)
    again.close()
