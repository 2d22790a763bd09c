"""The gateway's API keys and per-key rate limit, without a server (openai_gateway/auth.py, ratelimit.py)."""

import os
import re
import stat

import pytest

from openai_gateway.auth import KEY_PREFIX, ApiKeys, ensure_key_file, key_id
from openai_gateway.ratelimit import RateLimiter

KEY = "sk-triton-unit-test-key-0123456789"
OTHER = "sk-triton-another-key-abcdefghij"


# --- ApiKeys.check -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        f"Bearer {KEY}",
        f"bearer {KEY}",  # the scheme is case-insensitive (RFC 9110)
        f"BEARER {KEY}",
        f"Bearer   {KEY}",  # extra spaces between scheme and key
        f"Bearer {KEY}  ",
    ],
)
def test_a_right_key_gives_its_key_id(header):
    keys = ApiKeys([OTHER, KEY])
    assert keys.check(header) == key_id(KEY)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        KEY,  # no scheme
        f"Basic {KEY}",
        f"Token {KEY}",
        "Bearer",
        "Bearer ",
        "Bearer    ",
        f"Bearer {KEY[:-1]}",  # a prefix of a key
        f"Bearer {KEY}x",  # a key with more after it
        f"Bearer {KEY.upper()}",  # keys are case-sensitive
        f"Bearer {KEY} {KEY}",
        "Bearer sk-triton-wrong-key-0000000000",
    ],
)
def test_a_wrong_or_missing_key_is_refused(header):
    assert ApiKeys([KEY, OTHER]).check(header) is None


def test_each_key_has_its_own_id():
    keys = ApiKeys([KEY, OTHER])
    assert len(keys) == 2
    assert keys.check(f"Bearer {KEY}") != keys.check(f"Bearer {OTHER}")


def test_key_id_is_12_hex_digits_and_not_the_key():
    kid = key_id(KEY)
    assert re.fullmatch(r"[0-9a-f]{12}", kid), kid
    assert kid not in KEY and KEY not in kid
    assert kid == key_id(KEY)  # stable: the same key is the same id in logs and metrics
    assert kid != key_id(OTHER)


def test_short_or_no_keys_are_refused_without_showing_the_key():
    with pytest.raises(ValueError, match="at least 16 characters") as err:
        ApiKeys([KEY, "short-key-123"])
    assert "short-key-123" not in str(err.value)
    assert key_id("short-key-123") in str(err.value)
    with pytest.raises(ValueError, match="no API keys"):
        ApiKeys([])
    ApiKeys(["x" * 16])  # 16 is enough


# --- ensure_key_file -----------------------------------------------------------------------


def test_ensure_key_file_creates_one_0600_key_and_reuses_it(tmp_path):
    path = tmp_path / "state" / "gateway-api-key"  # the folder is created too
    first = ensure_key_file(path)
    assert len(first) == 1
    key = first[0]
    assert key.startswith(KEY_PREFIX) and len(key) >= len(KEY_PREFIX) + 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == key + "\n"
    assert ApiKeys(first).check(f"Bearer {key}") == key_id(key)

    assert ensure_key_file(path) == [key]  # the second start keeps the key
    assert path.read_text() == key + "\n"
    assert ensure_key_file(tmp_path / "elsewhere") != [key]  # each new file a new random key


def test_ensure_key_file_refuses_a_file_others_can_read(tmp_path):
    path = tmp_path / "gateway-api-key"
    path.write_text(KEY + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="644"):
        ensure_key_file(path)
    os.chmod(path, 0o640)
    with pytest.raises(PermissionError):
        ensure_key_file(path)
    os.chmod(path, 0o600)
    assert ensure_key_file(path) == [KEY]


def test_ensure_key_file_ignores_comments_and_blank_lines(tmp_path):
    path = tmp_path / "gateway-api-key"
    path.write_text(f"# keys of the gateway\n\n  {KEY}  \n# {OTHER}\n{OTHER}\n")
    os.chmod(path, 0o600)
    assert ensure_key_file(path) == [KEY, OTHER]

    path.write_text("# nothing but a comment\n\n")
    with pytest.raises(ValueError, match="holds no API key"):
        ensure_key_file(path)


# --- RateLimiter (a fake clock) ------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_burst_goes_then_refusal_with_retry_after():
    clock = Clock()
    limiter = RateLimiter(rate=2.0, burst=3, clock=clock)
    assert limiter.enabled
    assert [limiter.check("k") for _ in range(3)] == [0, 0, 0]
    # 0 tokens left at 2/s: one is back in 0.5 s, rounded up to a whole second.
    assert limiter.check("k") == 1
    assert limiter.check("k") == 1  # a refusal takes no token


@pytest.mark.parametrize("rate, expected", [(0.4, 3), (0.25, 4), (0.1, 10), (3.0, 1), (1000.0, 1)])
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_1(rate, expected):
    clock = Clock()
    limiter = RateLimiter(rate=rate, burst=1, clock=clock)
    assert limiter.check("k") == 0
    retry = limiter.check("k")
    assert retry == expected
    # Waiting the Retry-After is always enough.
    clock.t += retry
    assert limiter.check("k") == 0


def test_tokens_refill_over_time_up_to_the_burst():
    clock = Clock()
    limiter = RateLimiter(rate=2.0, burst=3, clock=clock)
    for _ in range(3):
        assert limiter.check("k") == 0
    assert limiter.check("k") > 0
    clock.t += 0.5  # one token back
    assert limiter.check("k") == 0
    assert limiter.check("k") > 0
    clock.t += 0.25  # half a token: not enough yet
    assert limiter.check("k") == 1
    clock.t += 0.25
    assert limiter.check("k") == 0
    clock.t += 3600  # a long pause refills to the burst, not beyond
    assert [limiter.check("k") for _ in range(4)] == [0, 0, 0, 1]


def test_rate_0_turns_the_limit_off():
    clock = Clock()
    limiter = RateLimiter(rate=0, burst=0, clock=clock)
    assert not limiter.enabled
    assert all(limiter.check("k") == 0 for _ in range(10_000))


def test_each_key_has_its_own_bucket():
    clock = Clock()
    limiter = RateLimiter(rate=1.0, burst=2, clock=clock)
    assert [limiter.check("a") for _ in range(3)] == [0, 0, 1]
    assert [limiter.check("b") for _ in range(3)] == [0, 0, 1]  # a's refusals did not touch b
    clock.t += 1.0
    assert limiter.check("a") == 0
    assert limiter.check("b") == 0


def test_a_burst_below_1_is_refused_when_limiting():
    with pytest.raises(ValueError, match="burst must be >= 1"):
        RateLimiter(rate=5.0, burst=0)
