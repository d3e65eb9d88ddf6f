"""gateway.admission: per-key, per-secret and per-address bounds on calls held and opened."""

from __future__ import annotations

import pytest

from gateway.admission import Admission, TooManyCalls
from gateway.auth import Grant
from gateway.config import ConfigError, LimitsConfig, parse_config

KEY = Grant(ephemeral=False, holder="key:a")
SECRET = Grant(ephemeral=True, holder="secret:b")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_client_secret_holds_at_most_its_calls_and_gets_them_back() -> None:
    admission = Admission(LimitsConfig(calls_per_client_secret=2))
    for call in ("c1", "c2"):
        admission.admit(call, admission.check(SECRET, "10.0.0.1"))
    with pytest.raises(TooManyCalls, match="calls_per_client_secret"):
        admission.check(SECRET, "10.0.0.2")
    admission.check(KEY, "10.0.0.1")  # an API key is counted apart (no limit by default)
    admission.release("c1")
    admission.release("c1")  # twice is harmless
    admission.check(SECRET, "10.0.0.1")


def test_an_address_holds_at_most_its_calls() -> None:
    admission = Admission(LimitsConfig(calls_per_address=1, calls_per_client_secret=None))
    admission.admit("c1", admission.check(KEY, "10.0.0.1"))
    with pytest.raises(TooManyCalls, match=r"10\.0\.0\.1 holds 1"):
        admission.check(SECRET, "10.0.0.1")
    admission.check(KEY, "10.0.0.2")


def test_new_calls_a_minute_per_address_with_the_wait_to_retry() -> None:
    clock = Clock()
    admission = Admission(LimitsConfig(new_calls_per_address_per_minute=3), clock)
    for i in range(3):
        admission.admit(f"c{i}", admission.check(KEY, "10.0.0.1"))
        admission.release(f"c{i}")  # short calls count too: it is a rate
        clock.now += 10
    with pytest.raises(TooManyCalls, match="in the last minute") as refused:
        admission.check(KEY, "10.0.0.1")
    assert refused.value.retry_after_s == 31  # the oldest leaves the window at 60 s
    admission.check(KEY, "10.0.0.9")  # another address is not held back
    clock.now += 31
    admission.check(KEY, "10.0.0.1")


def test_auth_off_on_a_network_address_is_refused_unless_on_purpose() -> None:
    off = {"enabled": False}
    with pytest.raises(ConfigError, match="allow_off_on_network"):
        parse_config({"gateway": {"host": "0.0.0.0", "auth": off}})
    parse_config({"gateway": {"host": "127.0.0.2", "auth": off}})
    parse_config({"gateway": {"host": "::1", "auth": off}})
    parse_config({"gateway": {"host": "0.0.0.0", "auth": {**off, "allow_off_on_network": True}}})


def test_wrong_keys_from_an_address_are_throttled_for_the_minute() -> None:
    clock = Clock()
    admission = Admission(LimitsConfig(auth_failures_per_address_per_minute=3), clock)
    for _ in range(3):
        admission.check_auth_rate("10.0.0.1")
        admission.auth_failed("10.0.0.1")
    with pytest.raises(TooManyCalls, match="wrong or missing keys") as refused:
        admission.check_auth_rate("10.0.0.1")  # even with the right key, until the minute ends
    assert refused.value.retry_after_s == 61
    admission.check_auth_rate("10.0.0.2")
    clock.now += 61
    admission.check_auth_rate("10.0.0.1")
