"""The gateway's coalescing of concurrent embeddings requests (openai_gateway.triton.Coalescer).

The Triton side is a small in-process stand-in that records each call and answers with
vectors derived from the texts, so order, splitting and error isolation can be checked
exactly; the real path is covered by the integration tests against tritonserver.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from openai_gateway.errors import APIError
from openai_gateway.triton import Coalescer


class Recorder:
    """embed_rows as the Coalescer calls it: one vector per text, [len(text), first byte], and
    a token count per text, len(text) + 2."""

    def __init__(self, fail_when=lambda blobs: False):
        self.calls: list[tuple[list[bytes], str]] = []
        self.batches: list[int] = []
        self.options: list[list[tuple[bool, str]]] = []  # each call's (truncate, direction) per text
        self.fail_when = fail_when

    async def embed_rows(self, model, blobs, request_id, priority_class, options):
        self.calls.append((list(blobs), request_id))
        self.options.append(list(options))
        await asyncio.sleep(0)
        if self.fail_when(blobs):
            raise APIError(400, "refused")
        return expected(blobs)

    def on_batch(self, n):
        self.batches.append(n)


class Model:
    id = "text_embedding"
    max_batch_size = 4


def expected(blobs):
    return np.array([[len(b), b[0]] for b in blobs], dtype=np.float32), np.array([len(b) + 2 for b in blobs], np.int32)


def assert_rows(got, blobs):
    """``got`` is the (vectors, token counts) of ``blobs``, in their order."""
    vectors, counts = expected(blobs)
    np.testing.assert_array_equal(got[0], vectors)
    np.testing.assert_array_equal(got[1], counts)


def run(coro):
    return asyncio.run(coro)


def test_requests_of_one_turn_go_together_and_come_back_in_order():
    backend = Recorder()

    async def main():
        c = Coalescer(backend, Model())
        futures = [c.submit([f"t{i}".encode()], f"r{i}") for i in range(3)]
        return await asyncio.gather(*futures)

    results = run(main())
    assert len(backend.calls) == 1
    assert backend.calls[0] == ([b"t0", b"t1", b"t2"], "r0,r1,r2")
    assert backend.batches == [3]
    for i, r in enumerate(results):
        assert_rows(r, [f"t{i}".encode()])


def test_a_batch_never_exceeds_max_batch_size_and_requests_are_not_split():
    backend = Recorder()

    async def main():
        c = Coalescer(backend, Model())
        sizes = [2, 2, 1, 3, 1]
        futures = [c.submit([f"{k}-{j}".encode() for j in range(n)], f"r{k}") for k, n in enumerate(sizes)]
        return sizes, await asyncio.gather(*futures)

    sizes, results = run(main())
    assert [len(blobs) for blobs, _ in backend.calls] == [4, 4, 1]
    assert [rid for _, rid in backend.calls] == ["r0,r1", "r2,r3", "r4"]
    for k, (n, r) in enumerate(zip(sizes, results)):
        assert_rows(r, [f"{k}-{j}".encode() for j in range(n)])


def test_a_batch_is_cut_at_max_rows_below_max_batch_size():
    backend = Recorder()

    async def main():
        c = Coalescer(backend, Model(), max_rows=2)
        return await asyncio.gather(*(c.submit([f"t{i}".encode()], f"r{i}") for i in range(5)))

    results = run(main())
    assert [len(blobs) for blobs, _ in backend.calls] == [2, 2, 1]
    assert [r[0][0][0] for r in results] == [2.0] * 5  # each its own row back
    assert Coalescer(backend, Model(), max_rows=64).limit == Model.max_batch_size


def test_requests_of_later_turns_form_new_batches():
    backend = Recorder()

    async def main():
        c = Coalescer(backend, Model())
        first = await c.submit([b"a"], "r0")
        second = await c.submit([b"b"], "r1")
        return first, second

    run(main())
    assert [rid for _, rid in backend.calls] == ["r0", "r1"]


def test_a_failed_batch_is_retried_alone_so_only_the_bad_request_fails():
    backend = Recorder(fail_when=lambda blobs: b"bad" in blobs)

    async def main():
        c = Coalescer(backend, Model())
        futures = [c.submit([b"ok1"], "r0"), c.submit([b"bad"], "r1"), c.submit([b"ok2"], "r2")]
        return await asyncio.gather(*futures, return_exceptions=True)

    ok1, bad, ok2 = run(main())
    assert isinstance(bad, APIError) and bad.status == 400
    assert_rows(ok1, [b"ok1"])
    assert_rows(ok2, [b"ok2"])
    assert [rid for _, rid in backend.calls] == ["r0,r1,r2", "r0", "r1", "r2"]


def test_a_batch_refused_for_capacity_is_not_sent_again_request_by_request():
    """UNAVAILABLE (503) means the class is at capacity: each request gets the refusal at once,
    and the gateway does not add the load of one retry per request."""

    class Full(Recorder):
        async def embed_rows(self, model, blobs, request_id, priority_class, options):
            self.calls.append((list(blobs), request_id, priority_class))
            raise APIError(503, "at capacity")

    backend = Full()

    async def main():
        c = Coalescer(backend, Model(), "bulk")
        futures = [c.submit([b"a"], "r0"), c.submit([b"b"], "r1")]
        return await asyncio.gather(*futures, return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, APIError) and r.status == 503 for r in results)
    assert backend.calls == [([b"a", b"b"], "r0,r1", "bulk")]


def test_a_request_cancelled_before_its_batch_leaves_is_not_sent():
    backend = Recorder()

    async def main():
        c = Coalescer(backend, Model())
        gone = c.submit([b"gone"], "r0")
        kept = c.submit([b"kept"], "r1")
        gone.cancel()
        return await kept

    assert_rows(run(main()), [b"kept"])
    assert backend.calls == [([b"kept"], "r1")]


@pytest.mark.parametrize("n", [1, 7])
def test_every_request_gets_exactly_its_rows(n):
    backend = Recorder()

    async def main():
        c = Coalescer(backend, Model())
        futures = [c.submit([bytes([65 + i]) * (i + 1)], f"r{i}") for i in range(n)]
        return await asyncio.gather(*futures)

    for i, (vectors, counts) in enumerate(run(main())):
        assert vectors.shape == (1, 2) and counts.shape == (1,)
        assert vectors[0, 0] == i + 1 and vectors[0, 1] == 65 + i and counts[0] == i + 3


def test_requests_that_chose_different_truncation_share_a_batch_each_text_with_its_own_choice():
    backend = Recorder(fail_when=lambda blobs: b"long" in blobs)

    async def main():
        c = Coalescer(backend, Model())
        plain = c.submit([b"a", b"b"], "r0")
        left = c.submit([b"c"], "r1", (True, "left"))
        refused = c.submit([b"long"], "r2")
        return await asyncio.gather(plain, left, refused, return_exceptions=True)

    plain, left, refused = run(main())
    assert backend.options[0] == [(False, "right"), (False, "right"), (True, "left"), (False, "right")]
    # The batch failed (as the model refuses an over-long text): each request alone, with its own choice.
    assert backend.options[1:] == [[(False, "right")] * 2, [(True, "left")], [(False, "right")]]
    assert_rows(plain, [b"a", b"b"])
    assert_rows(left, [b"c"])
    assert isinstance(refused, APIError)
