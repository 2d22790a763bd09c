"""Canary routing without Triton: weights, the sticky choice, pins, groups, fallbacks."""

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from contract.errors import ConfigError, InputError
from contract.model_config import ModelConfig
from python_backends.routing import RoutingError, choose_version, format_weights, parse_weights, route_bucket
from python_backends.routing.router import (
    Decision,
    RouterSettings,
    decide,
    fallback_versions,
    group_by,
    parse_parameters,
)


def test_weights_round_trip():
    assert parse_weights("2:10, 1:90") == {1: 90, 2: 10}
    assert format_weights({2: 10, 1: 90}) == "1:90,2:10"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("1:90,2:20", "weights sum to 110"),
        ("1:50", "weights sum to 50"),
        ("1:100,1:0", "version 1 is given twice"),
        ("0:100", "version 0 must be >= 1"),
        ("1:120,2:-20", "each weight must be 0..100"),
        ("one:100", "must be two integers"),
        ("1=100", "is not 'version:percent'"),
    ],
)
def test_bad_weights_name_the_field_and_the_limit(text, message):
    with pytest.raises(RoutingError, match=message) as err:
        parse_weights(text, field="parameter 'weights'")
    assert "parameter 'weights'" in str(err.value)


def test_split_follows_the_weights_within_one_point():
    counts = Counter(choose_version({1: 90, 2: 10}, f"request-{i}") for i in range(20_000))
    assert abs(counts[2] / 20_000 - 0.10) < 0.01
    rng = random.Random(1)
    counts = Counter(choose_version({1: 50, 2: 50}, None, rng) for _ in range(20_000))
    assert abs(counts[2] / 20_000 - 0.50) < 0.015


def test_sticky_key_stays_on_its_side_and_moves_only_to_the_canary():
    keys = [f"user-{i}" for i in range(5_000)]
    at10 = {k: choose_version({1: 90, 2: 10}, k) for k in keys}
    at50 = {k: choose_version({1: 50, 2: 50}, k) for k in keys}
    assert at10 == {k: choose_version({1: 90, 2: 10}, k) for k in keys}  # same split, same side
    assert all(at50[k] == 2 for k in keys if at10[k] == 2)  # 10 % -> 50 %: nobody leaves the canary
    assert route_bucket("user-1") == route_bucket(b"user-1")  # stable across processes (BLAKE2b, not hash())


def test_zero_weight_never_serves():
    assert {choose_version({1: 0, 2: 100}, f"k{i}") for i in range(500)} == {2}


def test_pin_and_routing_key_parameters():
    weights = {1: 100}
    assert decide(weights, {"encoder_version": "2"}, "", known_versions=[1, 2]) == Decision(2, True)
    with pytest.raises(InputError, match="encoder_version: version 7 is not served; versions: 1, 2"):
        decide(weights, {"encoder_version": 7}, "", known_versions=[1, 2])
    with pytest.raises(InputError, match="must be an integer"):
        decide(weights, {"encoder_version": "latest"})
    split = {1: 50, 2: 50}
    by_key = decide(split, {"routing_key": "k-9"}, "ignored-id")
    assert by_key == decide(split, {"routing_key": "k-9"}, "other-id")
    assert decide(split, {}, "id-3") == Decision(choose_version(split, "id-3"), False)
    assert parse_parameters(json.dumps({"routing_key": "x"})) == {"routing_key": "x"}
    assert parse_parameters("") == {} and parse_parameters("not json") == {}


def test_groups_split_by_version_length_and_pin():
    d1, d2, p2 = Decision(1, False), Decision(2, False), Decision(2, True)
    groups = group_by([(0, d1, 16), (1, d1, 16), (2, d1, 32), (3, d2, 16), (4, p2, 16)])
    assert groups == {(1, 16, False): [0, 1], (1, 32, False): [2], (2, 16, False): [3], (2, 16, True): [4]}


def test_fallback_goes_to_the_heaviest_other_version_first():
    assert fallback_versions({1: 90, 2: 10}, 2, ready=[1, 2]) == [1]
    assert fallback_versions({1: 100}, 1, ready=[2, 3]) == [3, 2]  # configured version not loaded


def _router_config(weights):
    return ModelConfig({"name": "text_encoder_router", "parameters": {"weights": {"string_value": weights}}})


def test_router_settings_check_the_version_folders(tmp_path: Path):
    (tmp_path / "text_encoder" / "1").mkdir(parents=True)
    assert RouterSettings.from_config(_router_config("1:100"), tmp_path).weights == {1: 100}
    with pytest.raises(
        ConfigError, match=r"names version 2 of 'text_encoder', which has no folder text_encoder/2 .*versions there: 1"
    ):
        RouterSettings.from_config(_router_config("1:90,2:10"), tmp_path)
    with pytest.raises(ConfigError, match="weights sum to 90"):
        RouterSettings.from_config(_router_config("1:90"), tmp_path)


def test_call_tally_counts_between_flushes_with_cumulative_buckets():
    from python_backends.routing.router import CallTally

    now = [0.0]
    tally = CallTally(interval_s=0.5, clock=lambda: now[0])
    assert not tally.due()
    tally.record(2, "ok", ms=4.0)  # a call of one request
    tally.record(2, "ok", ms=12.0, requests=3)  # one call of three requests: one latency sample
    tally.record(2, "error")
    tally.record(2, "rejected", requests=2)
    assert not tally.due()
    now[0] = 0.6
    assert tally.due()
    results, buckets = tally.drain()
    assert results == {(2, "ok"): 4, (2, "error"): 1, (2, "rejected"): 2}
    assert (2, "3") not in buckets and buckets[(2, "5")] == 1 and buckets[(2, "15")] == 2 and buckets[(2, "+Inf")] == 2
    assert tally.drain() == ({}, {}) and not tally.due()
