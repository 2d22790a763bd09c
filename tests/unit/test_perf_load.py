"""perf.lib.load's record and drivers, perf.lib.wrk's request functions and perf.lib.lifecycle's
rounds and repository copies, without a server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from perf.lib import lifecycle, load, wrk


@dataclass
class _Window(load.Window):
    cores: float | None = None


def test_points_take_the_median_of_rounds_sum_counts_and_keep_the_largest_max():
    rounds = [
        _Window("after", "w", 4, 1, requests=10, errors=0, rps=5.0, p50_ms=1.0, p99_ms=2.0, max_ms=3.0, cores=0.1),
        _Window("after", "w", 4, 2, requests=12, errors=1, rps=7.0, p50_ms=2.0, p99_ms=4.0, max_ms=9.0, cores=None),
        _Window("after", "w", 4, 3, requests=11, errors=0, rps=6.0, p50_ms=3.0, p99_ms=3.0, max_ms=4.0, cores=0.3),
    ]
    rounds[0].stats = {"m": {"batch": 1.0, "queue_ms": 0.1}}
    rounds[2].stats = {"m": {"batch": 3.0, "queue_ms": 0.3}}
    (point,) = load.points([*rounds, _Window("before", "w", 4, 1, requests=1)])[:1]
    assert (point.round, point.requests, point.errors) == (3, 33, 1)
    assert (point.rps, point.p50_ms, point.p99_ms, point.max_ms) == (6.0, 2.0, 3.0, 9.0)
    assert point.p99_range == (2.0, 4.0) and point.cores == pytest.approx(0.2)
    assert point.stats == {"m": {"batch": 2.0, "queue_ms": pytest.approx(0.2)}}
    assert point.p99_over_p50 == 1.5 and point.max_over_p50 == 4.5


def test_a_tally_gives_the_figures_of_its_200s_and_counts_refusals_apart():
    tally = load.Tally(seconds=2.0)
    for ms in (10, 20, 30, 40):
        tally.add(True, ms / 1000)
    tally.add(False, 0.001, "503 busy", refused=True)
    tally.add(False, 0.002, "400 bad request")
    window = load.Window("p", "w", 1)
    window.take(tally)
    assert (window.requests, window.errors, window.rps, window.first_error) == (4, 2, 2.0, "400 bad request")
    assert (window.p50_ms, window.p99_ms, window.max_ms) == (pytest.approx(20.0), pytest.approx(40.0), pytest.approx(40.0))
    assert tally.refused == [0.001] and load.latency_ms([])["p50_ms"] is None


def test_call_loop_makes_each_numbered_call_once_and_counts_exceptions():
    async def call(n: int) -> None:
        await asyncio.sleep(0)
        if n % 5 == 0:
            raise RuntimeError("no")

    tally = asyncio.run(load.call_loop(call, concurrency=3, count=20))
    assert sorted(tally.ok_index) == [n for n in range(20) if n % 5] and tally.errors == 4
    assert tally.first_error == "RuntimeError: no"


def test_wrk_request_functions_quote_texts_and_make_them_unique():
    body = b'{"inputs": [{"data": ["\\u0000"]}]}'
    after = wrk.unique_texts(['say "hi" ]]'], body, "n0nce")
    assert '[=[say \\"hi\\" ]]]=]' in after and "' (n0nce-' .. tid .. '-' .. n .. ')'" in after
    assert '[=[{"inputs": [{"data": ["]=]' in after and '[=["]}]}]=]' in after
    assert "'n0nce' .. tid .. 'x' .. n .. ' ' .. texts" in wrk.unique_texts(["a"], body, "n0nce", before=True)
    assert "bodies[(n % #bodies) + 1]" in wrk.cycle([b"{}", b"[]"])


def test_rounds_alternate_and_a_linked_repository_rewrites_only_configs(tmp_path):
    assert list(lifecycle.interleaved(["a", "b"], 3)) == [(1, "a"), (1, "b"), (2, "b"), (2, "a"), (3, "a"), (3, "b")]
    source = tmp_path / "repo"
    for model in ("m", "n"):
        (source / model / "1").mkdir(parents=True)
        (source / model / "config.pbtxt").write_text(f"name: {model}")
    (source / "m" / "configs").mkdir()
    (source / "m" / "configs" / "cpu.pbtxt").write_text("cpu")
    repo = lifecycle.linked_repository(source, tmp_path / "out", lambda model, _, text: text.upper() if model == "m" else None)
    assert (repo / "m" / "config.pbtxt").read_text() == "NAME: M" and (repo / "m" / "configs" / "cpu.pbtxt").read_text() == "CPU"
    assert (repo / "n" / "config.pbtxt").is_symlink() and (repo / "m" / "1").is_symlink()
