"""The advisory filter on its own: which of a session's advisories reach the engine."""

from __future__ import annotations

import time

import pytest

from antiphon.server import advisories
from antiphon.server.advisories import Advised, AdvisoryFilter


def test_an_advisory_repeats_the_last_only_over_an_unchanged_conversation() -> None:
    f = AdvisoryFilter(typing_interval_s=1.0, repeat_interval_s=60.0)
    assert f.repeat_of("s1", (1.0, 2), None) is None  # nothing sent yet
    f.sent("s1", (1.0, 2), None, 300)
    assert f.repeat_of("s1", (1.0, 2), None) == Advised(300, repeat=True)
    assert f.repeat_of("s1", (1.0, 2), 30.0) == Advised(300, repeat=True)  # later: nothing new
    assert f.repeat_of("s1", (2.0, 4), None) is None  # the conversation moved on: send it
    assert f.repeat_of("s2", (1.0, 2), None) is None  # another session's
    f.sent("s1", (2.0, 4), None, 420)
    assert f.repeat_of("s1", (2.0, 4), None) == Advised(420, repeat=True)


def test_a_much_sooner_arrival_goes_through_and_the_halvings_are_few() -> None:
    """A turn now expected far sooner moves its prefetch ahead of others': sent. Each one
    sent must at least halve the time the last had left, so a loop gets few through."""
    f = AdvisoryFilter(typing_interval_s=1.0, repeat_interval_s=60.0)
    f.sent("s1", "r", 60.0, 10)
    assert f.repeat_of("s1", "r", 40.0) is not None  # sooner, not by half
    assert f.repeat_of("s1", "r", 20.0) is None
    sent, arrival = 1, 600.0
    while sent < 100:
        if f.repeat_of("s1", "r", arrival) is None:
            f.sent("s1", "r", arrival, 10)
            sent += 1
        elif arrival == 0.0:
            break
        arrival = max(0.0, arrival * 0.9 - 0.001)
    assert sent < 25  # 600 s down to 0 in a halving series: one per halving


def test_a_repeat_goes_through_once_the_interval_has_passed() -> None:
    f = AdvisoryFilter(typing_interval_s=1.0, repeat_interval_s=0.05)
    f.sent("s1", "r", None, None)
    assert f.repeat_of("s1", "r", None) is not None
    time.sleep(0.06)
    assert f.repeat_of("s1", "r", None) is None
    off = AdvisoryFilter(typing_interval_s=1.0, repeat_interval_s=0.0)
    off.sent("s1", "r", None, 5)
    assert off.repeat_of("s1", "r", None) is None  # 0: every advisory is sent


def test_typing_counts_once_per_interval() -> None:
    f = AdvisoryFilter(typing_interval_s=0.05, repeat_interval_s=1.0)
    assert not f.is_typing_repeat("s1")
    assert f.is_typing_repeat("s1") and not f.is_typing_repeat("s2")
    time.sleep(0.06)
    assert not f.is_typing_repeat("s1")


def test_sessions_gone_quiet_are_forgotten_past_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(advisories, "MAX_SESSIONS", 4)
    f = AdvisoryFilter(typing_interval_s=0.01, repeat_interval_s=0.01)
    for i in range(4):
        f.sent(f"s{i}", "r", None, 1)
        f.is_typing_repeat(f"s{i}")
    time.sleep(0.02)
    f.sent("s9", "r", None, 1)
    f.is_typing_repeat("s9")
    assert list(f._last_sent) == ["s9"] and list(f._last_typing_s) == ["s9"]


def test_a_turn_begun_or_an_advisory_expired_in_the_engine_ends_the_repeats() -> None:
    f = AdvisoryFilter(typing_interval_s=1.0, repeat_interval_s=60.0)
    f.sent("s1", "r", None, 7)
    f.forget("s1")  # a turn of s1 began: it uses the advisory up
    assert f.repeat_of("s1", "r", None) is None
    short = AdvisoryFilter(typing_interval_s=1.0, repeat_interval_s=60.0, advisory_ttl_s=0.05)
    short.sent("s1", "r", None, 7)
    assert short.repeat_of("s1", "r", None) is not None
    time.sleep(0.06)  # the engine has expired it
    assert short.repeat_of("s1", "r", None) is None
