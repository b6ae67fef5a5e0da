"""The pure parts of `antiphon bench sessions`: think times, advisory drops, context accounting,
aggregation, pool sizing and the report; no engine, no server."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from pathlib import Path
from types import TracebackType

import pytest

from antiphon.bench import sessions
from antiphon.bench.sessions_clients import TurnResult
from antiphon.bench.sessions_metrics import (
    POINT_METRICS,
    counter_deltas,
    merge_runs,
    percentile,
    prior_context_tokens,
    recomputed_context_tokens,
    summarise_point,
    turn_records,
)
from antiphon.bench.sessions_report import (
    capacity_rows,
    miss_cost_rows,
    point_rows,
    report,
    ttft_ratio_rows,
    users_at_tpot,
    within_run_ratio,
)

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}


def result(prompt: int, completion: int, cached: int, ttft: float = 0.1,
           text: str = "ok") -> TurnResult:
    return TurnResult(ttft, 0.01, prompt, completion, cached, text)


def test_think_time_reads_at_238_and_types_at_52_words_a_minute() -> None:
    reply, message = " ".join(["w"] * 238), " ".join(["w"] * 26)
    assert sessions.think_time_s(reply, message, 1.0) == pytest.approx((60.0, 30.0))
    assert sessions.think_time_s(reply, message, 0.05) == pytest.approx((3.0, 1.5))
    assert sessions.think_time_s("", "", 1.0) == (0.0, 0.0)


def test_advisories_never_precede_the_first_turn_and_none_without_advisories() -> None:
    rng = random.Random(0)
    assert sessions.advisory_flags([4, 1], None, rng) == [(False,) * 4, (False,)]
    assert sessions.advisory_flags([4, 2], 0.0, rng) == [(False, True, True, True),
                                                         (False, True)]


def test_exactly_the_share_of_follow_up_advisories_is_dropped_and_seeded() -> None:
    def flags(seed: str, turns: list[int]) -> list[tuple[bool, ...]]:
        return sessions.advisory_flags(turns, 0.1, random.Random(seed))

    turns = [3] * 16  # 32 follow-ups: 3 dropped (round(3.2)), not anywhere from 0 to 7
    for seed in ("0/16", "1/16", "2/16"):
        dropped = [f for user in flags(seed, turns) for f in user[1:]].count(False)
        assert dropped == 3
        assert all(user[0] is False for user in flags(seed, turns))
    assert flags("0/16", turns) == flags("0/16", turns)
    assert flags("0/16", turns) != flags("1/16", turns)
    assert flags("0/2", [3, 3]) == [(False, True, True)] * 2  # 10% of 4 rounds to none


def test_prior_context_leaves_out_the_last_generated_token_and_is_capped() -> None:
    assert prior_context_tokens(100, 20, 150) == 119  # reply's last token never fed back
    assert prior_context_tokens(100, 20, 110) == 109  # re-rendered shorter: the new prompt caps
    assert prior_context_tokens(1, 0, 1) == 0
    assert recomputed_context_tokens(119, 100) == 19
    assert recomputed_context_tokens(119, 128) == 0  # a cache hit may run into the new message


def test_turn_records_account_each_follow_up_against_its_previous_turn() -> None:
    records = turn_records(4, 2, [result(50, 30, 0), result(120, 40, 0), result(200, 10, 128)])
    assert [(r["users"], r["user"], r["turn"]) for r in records] == [(4, 2, 0), (4, 2, 1),
                                                                     (4, 2, 2)]
    assert [r["prior_context_tokens"] for r in records] == [0, 79, 159]
    assert [r["recomputed_context_tokens"] for r in records] == [0, 79, 31]
    assert all(r["fresh_ttft_s"] is None for r in records)


def test_percentile_interpolates_and_is_none_without_values() -> None:
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert percentile([1.0, 2.0], 0.5) == 1.5
    assert percentile([float(i) for i in range(101)], 0.99) == pytest.approx(99.0)
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None


def test_point_summary_shares_are_of_the_follow_ups_prior_context() -> None:
    records = (turn_records(2, 0, [result(50, 30, 0, 1.0), result(120, 40, 0, 2.0)])
               + turn_records(2, 1, [result(60, 21, 0, 1.0), result(100, 1, 80, 4.0)]))
    # prior contexts 79 and 80, recomputed 79 and 0
    tiering = {"tokens_from_host": 53, "tokens_from_ssd": 0}
    summary = summarise_point(records, tiering)  # type: ignore[arg-type]
    assert summary["recomputed_context_frac"] == pytest.approx(79 / 159)
    assert summary["host_hit_frac"] == pytest.approx(53 / 159)
    assert summary["ssd_hit_frac"] == 0.0
    assert summary["followup_ttft_p50_s"] == pytest.approx(3.0)
    assert summary["followup_ttft_p99_s"] == pytest.approx(3.98)
    assert summary["tpot_p50_s"] == pytest.approx(0.01)  # the 1-token turn has no TPOT
    assert summary["fresh_ttft_p50_s"] is None and summary["followup_over_fresh_p50"] is None
    records[1]["fresh_ttft_s"], records[3]["fresh_ttft_s"] = 1.0, 1.0  # probed follow-ups
    records[0]["fresh_ttft_s"] = 0.01  # a first turn never counts
    probed = summarise_point(records, tiering)  # type: ignore[arg-type]
    assert probed["fresh_ttft_p50_s"] == 1.0 and probed["followup_over_fresh_p50"] == 3.0
    untiered = summarise_point(records, None)
    assert untiered["host_hit_frac"] is None and untiered["ssd_hit_frac"] is None
    # What turns recomputed after a preemption, which their cached tokens (counted at first
    # admission) do not show, is a figure of its own: stock vLLM does not report it.
    preempted = summarise_point(records, {**tiering, "rt_recomputed_tokens": 20})  # type: ignore[dict-item]
    assert preempted["recomputed_context_frac"] == pytest.approx(79 / 159)
    assert preempted["preemption_recomputed_frac"] == pytest.approx(20 / 159)
    stock = summarise_point(records, {**tiering, "rt_recomputed_tokens": 0}, is_stock=True)  # type: ignore[dict-item]
    assert stock["preemption_recomputed_frac"] is None
    # Where each turn says what the tiers loaded for it, the hit fractions are the
    # follow-ups' own, not the server's counter (which counts every admission).
    for record, loads in zip(records, [(5, 0), (40, 10), (1, 0), (30, 0)], strict=False):
        record["host_tokens"], record["ssd_tokens"] = loads
    own = summarise_point(records, tiering)  # type: ignore[arg-type]
    followups = [r for r in records if r["turn"] > 0]
    assert own["host_hit_frac"] == pytest.approx(
        sum(r["host_tokens"] for r in followups) / 159)
    assert own["ssd_hit_frac"] == pytest.approx(
        sum(r["ssd_tokens"] for r in followups) / 159)
    assert probed["missed_advisories"] is None  # no follow-up had an advisory to miss
    assert probed["missed_over_advised_p50"] is None


def test_point_summary_compares_follow_ups_without_their_advisory_to_the_advised() -> None:
    results = [result(50, 30, 0, 1.0), result(120, 40, 0, 0.2), result(200, 40, 0, 0.3)]
    records = (turn_records(2, 0, results, (False, True, True))
               + turn_records(2, 1, [*results[:2], result(200, 40, 0, 0.9)],
                              (False, True, False)))
    assert [r["advised"] for r in records] == [False, True, True, False, True, False]
    summary = summarise_point(records, None)
    assert summary["missed_advisories"] == 1
    assert summary["missed_over_advised_p50"] is None  # no fresh TTFT to weigh them by
    for r, fresh in zip(records, (None, 0.2, 0.15, None, 0.1, 0.3), strict=True):
        r["fresh_ttft_s"] = fresh
    summary = summarise_point(records, None)
    # each over its message alone: advised 1.0, 2.0 and 2.0, missed 3.0
    assert summary["missed_over_advised_p50"] == pytest.approx(3.0 / 2.0)
    assert summary["followup_ttft_p50_s"] == pytest.approx(0.25)


def test_repeated_sweeps_merge_to_the_median_of_each_point() -> None:
    def run(ttfts: list[float | None], turn_ttft: float) -> dict:
        sweep: dict = {k: [None, None] for k in POINT_METRICS}
        sweep.update(users=[2, 4], followup_ttft_p50_s=ttfts, tiering=[None, None],
                     turns=turn_records(2, 0, [result(50, 30, 0, turn_ttft)]))
        return sweep

    merged = merge_runs([run([0.1, 0.5], 1.0), run([0.3, None], 2.0), run([0.2, 0.7], 3.0)])
    assert merged["users"] == [2, 4]
    assert merged["followup_ttft_p50_s"] == pytest.approx([0.2, 0.6])  # None: not measured
    assert merged["tpot_p50_s"] == [None, None]
    assert [(t["run"], t["ttft_s"]) for t in merged["turns"]] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert len(merged["runs"]) == 3 and all("turns" not in r for r in merged["runs"])
    single = run([0.1, 0.5], 1.0)
    assert merge_runs([single]) == single


def test_counter_deltas_tolerate_servers_without_tiers() -> None:
    before = {"tokens_from_host": 10, "tokens_from_ssd": 5, "advisories_received": 1}
    after = {"tokens_from_host": 30, "tokens_from_ssd": 5, "advisories_received": 4}
    deltas = counter_deltas(before, after)
    assert deltas is not None
    assert deltas["tokens_from_host"] == 20 and deltas["tokens_from_ssd"] == 0
    assert deltas["advisories_received"] == 3 and deltas["advisories_expired"] == 0
    assert counter_deltas(None, after) is None and counter_deltas({}, {}) is None


def test_pool_holds_pool_users_conversations_and_one_longest_request() -> None:
    assert sessions.kv_bytes_per_token(SMOLLM2) == 2 * 30 * 3 * 64 * 2
    pages, per_user = sessions.pool_pages([300, 500, 129], 2, 128, 640)
    assert per_user == pytest.approx((3 + 4 + 2) / 3)
    assert pages == 6 + 1  # vLLM keeps one page back
    assert sessions.pool_pages([100], 1, 128, 1024) == (8 + 1, 1.0)  # max_model_len must fit


class FakeChat:
    """Records what a simulated user does, answers every turn at once."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def __aenter__(self) -> FakeChat:
        self.events.append("open")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.events.append("close")

    async def turn(self, message: str) -> TurnResult:
        self.events.append(message)
        return result(10, 5, 0, text="a reply")

    async def typing(self) -> None:
        self.events.append("typing")


async def test_user_sends_advisories_only_before_flagged_turns() -> None:
    chat = FakeChat()
    results = await sessions.run_user(chat, ["m0", "m1", "m2"], (False, False, True), 0.0)
    assert len(results) == 3
    assert chat.events == ["open", "m0", "m1", "typing", "m2", "close"]


async def test_a_long_message_is_advised_again_while_it_is_typed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # One advisory when typing started: at full scale a third of the messages took longer to
    # type than the engine keeps an advisory (30 s), as the browser UI's notices would not.
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(sessions.asyncio, "sleep", sleep)
    chat = FakeChat()
    await sessions.type_message(chat, 40.0, advise=True)
    assert chat.events == ["typing"] * 3 and slept == [15.0, 15.0, 10.0]
    chat = FakeChat()
    await sessions.type_message(chat, 40.0, advise=False)  # a dropped advisory stays dropped
    assert chat.events == [] and slept[3:] == [40.0]


async def test_each_follow_up_is_probed_as_a_fresh_chat_while_the_reply_is_read() -> None:
    # A prober that went through the messages on its own was done, at most points, before
    # the first follow-up: the fresh TTFT the follow-ups were judged against was an idle
    # server's, or the first turns' burst. Probed after the typing, each follow-up went a
    # probe later than read plus type time, and its typing advisory had that much more lead.
    log: list[str] = []
    chats: list[FakeChat] = []

    class Logged(FakeChat):
        async def turn(self, message: str) -> TurnResult:
            log.append(f"{'probe' if self in chats else 'send'} {message}")
            return await super().turn(message)

        async def typing(self) -> None:
            log.append("typing")

    def chat(max_tokens: int) -> FakeChat:
        chats.append(Logged())
        return chats[-1]

    fresh: dict[tuple[int, int], float] = {}
    results = await sessions.run_user(Logged(), ["m0", "m1", "m2"], (False, True, True), 0.0,
                                      sessions.fresh_prober(chat, 3, fresh))
    assert len(results) == 3
    assert log == ["send m0", "probe m1", "typing", "send m1", "probe m2", "typing", "send m2"]
    assert sorted(fresh) == [(3, 1), (3, 2)]  # follow-ups only, each in a new chat
    assert [c.events for c in chats] == [["open", "m1", "close"], ["open", "m2", "close"]]


async def test_a_slow_probe_holds_back_neither_the_typing_nor_the_send(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The follow-up goes at reading plus typing time, a probe that outlasts them running on
    beside it, and the user's run ends only once the probe is done. Typing first waited for
    the probe, then the send did (this test held that behaviour): either way, where the
    probe outlasted reading and typing (stock vLLM's, at many users), that system's users
    thought longer than the reading and typing rates say and offered less load (found by
    reviews)."""
    monkeypatch.setattr(sessions, "think_time_s", lambda *_: (0.1, 0.1))
    started = time.monotonic()
    at: dict[str, float] = {}

    class Timed(FakeChat):
        async def turn(self, message: str) -> TurnResult:
            at.setdefault(message, time.monotonic() - started)
            return await super().turn(message)

        async def typing(self) -> None:
            at["typing"] = time.monotonic() - started

    async def slow_probe(turn: int, message: str) -> None:
        await asyncio.sleep(0.4)
        at["probed"] = time.monotonic() - started

    results = await sessions.run_user(Timed(), ["m0", "m1"], (False, True), 1.0, slow_probe)
    returned = time.monotonic() - started
    first = at["m0"]
    assert at["typing"] - first == pytest.approx(0.1, abs=0.08)  # as the reading ends
    assert at["m1"] - first == pytest.approx(0.2, abs=0.08)  # read plus type: not the probe's 0.4
    assert at["probed"] - first == pytest.approx(0.4, abs=0.1)  # the probe ran to its end,
    assert returned >= at["probed"]  # before the user's run did
    assert [r.send_lag_s for r in results] == [pytest.approx(0.0, abs=0.05)] * 2


async def test_a_turn_sent_late_says_how_late() -> None:
    # A typing advisory that took 0.3 s to go out held the send back by as much.
    class SlowTyping(FakeChat):
        async def typing(self) -> None:
            await asyncio.sleep(0.3)

    results = await sessions.run_user(SlowTyping(), ["m0", "m1"], (False, True), 0.0)
    assert results[0].send_lag_s == pytest.approx(0.0, abs=0.05)
    assert results[1].send_lag_s == pytest.approx(0.3, abs=0.1)
    records = turn_records(1, 0, results)
    assert [r["send_lag_s"] for r in records] == [r.send_lag_s for r in results]
    summary = summarise_point(records, None)
    assert summary["send_lag_max_s"] == results[1].send_lag_s
    assert summary["send_lag_p99_s"] == pytest.approx(
        results[0].send_lag_s + 0.99 * (results[1].send_lag_s - results[0].send_lag_s))


async def test_a_failed_probe_fails_the_user_and_a_pending_one_is_cancelled() -> None:
    # The probe overlaps the turns now: its failure still ends the user's run (its fresh TTFT
    # is missing), and a turn's failure leaves no probe running behind it.
    async def failing_probe(turn: int, message: str) -> None:
        raise ConnectionError("probe refused")

    with pytest.raises(ConnectionError, match="probe refused"):
        await sessions.run_user(FakeChat(), ["m0", "m1"], (False, False), 0.0, failing_probe)
    probes: list[asyncio.Task[None]] = []

    async def hanging_probe(turn: int, message: str) -> None:
        probes.append(asyncio.current_task())  # type: ignore[arg-type]
        await asyncio.sleep(10)

    class FailingTurn(FakeChat):
        async def turn(self, message: str) -> TurnResult:
            if message == "m1":
                raise ConnectionError("turn refused")
            return await super().turn(message)

    with pytest.raises(ConnectionError, match="turn refused"):
        await sessions.run_user(FailingTurn(), ["m0", "m1"], (False, False), 0.0, hanging_probe)
    await asyncio.sleep(0)
    assert len(probes) == 1 and probes[0].cancelled()


async def test_a_users_probes_go_one_after_another(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each user's probe on a connection beside its own, as the server's per-key limits allow
    # (`server_command`): a probe that outlasts a whole turn holds back the next probe, never
    # the user.
    monkeypatch.setattr(sessions, "think_time_s", lambda *_: (0.05, 0.05))
    started = time.monotonic()
    spans: list[tuple[float, float]] = []
    sent: list[float] = []

    class Timed(FakeChat):
        async def turn(self, message: str) -> TurnResult:
            sent.append(time.monotonic() - started)
            return await super().turn(message)

    async def slow_probe(turn: int, message: str) -> None:
        begun = time.monotonic() - started
        await asyncio.sleep(0.3)
        spans.append((begun, time.monotonic() - started))

    await sessions.run_user(Timed(), ["m0", "m1", "m2"], (False,) * 3, 1.0, slow_probe)
    assert len(spans) == 2 and spans[1][0] >= spans[0][1]
    assert [b - a for a, b in itertools.pairwise(sent)] == [pytest.approx(0.1, abs=0.06)] * 2


class ScriptedClock:
    """`time` for `sessions_clients`: `perf_counter` reads the given instants in turn."""

    def __init__(self, *instants: float) -> None:
        self.instants = iter(instants)

    def perf_counter(self) -> float:
        return next(self.instants)


def sse(*chunks: dict) -> bytes:
    """An OpenAI chat completion stream of `chunks`."""
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def content(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"delta": {"content": text}, "finish_reason": finish}]}


async def test_tpot_leaves_out_the_token_a_reply_ended_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The end-of-sequence token counts in the server's completion tokens and brings no text:
    TPOT over completion tokens had a gap too many, and a reply [a, EOS] a TPOT of 0 (found
    by a review). Over the frames, tokens merged into one frame read slow: it is over the
    tokens between the first text and the last; None with no gap."""
    import httpx

    from antiphon.bench import sessions_clients
    from antiphon.bench.sessions_clients import OpenAIChat, WsChat

    usage = {"prompt_tokens": 5, "completion_tokens": 3}
    stream = sse(content("a"), content("b"), content("", "stop"),
                 {"choices": [], "usage": usage})
    async with httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(
            lambda request: httpx.Response(200, content=stream))) as http:
        # sent at 0, "a" at 1.0, "b" at 1.2, the stream's end at 1.5
        monkeypatch.setattr(sessions_clients, "time", ScriptedClock(0.0, 1.0, 1.2, 1.5))
        three = await OpenAIChat(http, "m", 8).turn("hi")
        assert (three.ttft_s, three.tpot_s, three.text) == (1.0, pytest.approx(0.2), "ab")
        stream = sse(content("a"), content("", "stop"),
                     {"choices": [], "usage": {**usage, "completion_tokens": 2}})
        monkeypatch.setattr(sessions_clients, "time", ScriptedClock(0.0, 1.0, 1.5))
        two = await OpenAIChat(http, "m", 8).turn("hi")
        assert (two.ttft_s, two.tpot_s, two.completion_tokens) == (1.0, None, 2)

    class FakeSocket:
        def __init__(self, *frames: dict) -> None:
            self.frames = [json.dumps(f) for f in frames]

        async def send(self, text: str) -> None:
            pass

        async def recv(self) -> str:
            return self.frames.pop(0)

    chat = WsChat("ws://antiphon/v1/ws", 8)
    done = {"type": "done", "text": "ab", "finish_reason": "stop", "usage": {
        **usage, "cached_prompt_tokens": 0, "tier_prompt_tokens": None}}
    chat._ws = FakeSocket({"type": "token", "text": "a"}, {"type": "token", "text": "b"},
                          {"type": "token", "text": ""}, done)
    monkeypatch.setattr(sessions_clients, "time", ScriptedClock(0.0, 1.0, 1.2, 1.5))
    assert (await chat.turn("hi")).tpot_s == pytest.approx(0.2)
    chat._ws = FakeSocket({"type": "token", "text": "a"},
                          {**done, "text": "a", "usage": {**done["usage"], "completion_tokens": 2}})
    monkeypatch.setattr(sessions_clients, "time", ScriptedClock(0.0, 1.0, 1.5))
    assert (await chat.turn("hi")).tpot_s is None
    # four tokens cut short ("length") in two frames, a server's merge: three gaps
    chat._ws = FakeSocket({"type": "token", "text": "ab"}, {"type": "token", "text": "cd"},
                          {**done, "text": "abcd", "finish_reason": "length",
                           "usage": {**done["usage"], "completion_tokens": 4}})
    monkeypatch.setattr(sessions_clients, "time", ScriptedClock(0.0, 1.0, 1.6, 1.7))
    assert (await chat.turn("hi")).tpot_s == pytest.approx(0.2)


def test_replies_without_a_gap_to_time_stay_out_of_the_tpot_median() -> None:
    records = turn_records(1, 0, [result(50, 30, 0), result(120, 2, 0), result(200, 30, 0)])
    records[1]["tpot_s"] = None  # [a, EOS]: one text frame
    records[2]["tpot_s"] = 0.03
    assert summarise_point(records, None)["tpot_p50_s"] == pytest.approx(0.02)


def test_quick_fills_in_sizes_and_systems_are_checked() -> None:
    parser = argparse.ArgumentParser()
    sessions.add_parser(parser.add_subparsers())
    args = sessions._defaults(parser.parse_args(["sessions", "--quick", "--systems", "vllm"]))
    assert (args.time_scale, args.max_turns, args.enforce_eager) == (0.08, 4, True)
    assert (args.users, args.pool_users) == ("2,4,16", 5)
    full = sessions._defaults(parser.parse_args(["sessions", "--time-scale", "0.5"]))
    assert (full.time_scale, full.enforce_eager, full.systems) == (
        0.5, False, "vllm,tiers,advisory,advisory_miss10")
    with pytest.raises(SystemExit):
        parser.parse_args(["sessions", "--systems", "vllm,nope"])


def test_report_writes_the_record_and_the_plot(tmp_path: Path) -> None:
    turns = turn_records(2, 0, [result(50, 30, 0), result(120, 40, 0, 0.4)])
    turns[1]["fresh_ttft_s"] = 0.1
    system = {"users": [2], "recomputed_context_frac": [1.0], "followup_ttft_p50_s": [0.4],
              "followup_ttft_p99_s": [0.4], "fresh_ttft_p50_s": [0.1],
              "followup_over_fresh_p50": [4.0], "tpot_p50_s": [0.01], "host_hit_frac": [None],
              "ssd_hit_frac": [None], "missed_advisories": [None],
              "missed_over_advised_p50": [None], "turns": turns}
    out = tmp_path / "sessions.json"
    report({"benchmark": "sessions", "config": {}, "systems": {"tiers": system}}, out)
    assert json.loads(out.read_text())["systems"]["tiers"]["host_hit_frac"] == [None]
    assert out.with_suffix(".png").stat().st_size > 0
    assert math.isnan(point_rows(system)["u2_host_hit_frac"])
    ratios = ttft_ratio_rows(turns)
    assert ratios["ctx_0_256"] == pytest.approx(4.0) and math.isnan(ratios["ctx_256_512"])
    # What the dropped advisories cost is in the JSON too (it was printed alone), as JSON
    # (no NaN).
    missing = {**system, "missed_advisories": [1], "missed_over_advised_p50": [None],
               "followup_ttft_p50_s": [0.5]}
    report({"benchmark": "sessions", "config": {},
            "systems": {"advisory": system, "advisory_miss10": missing}}, out)
    cost = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(c))[
        "advisory_miss10_cost"]
    assert cost["u2_over_advisory"] == pytest.approx(1.25)
    assert cost["u2_missed_advisories"] == 1 and cost["u2_missed_over_advised"] is None
    assert cost["all_over_advisory"] == pytest.approx(1.0)


def test_capacity_is_the_users_sustained_at_the_baselines_tpot() -> None:
    baseline = {"users": [2, 4, 8, 16], "tpot_p50_s": [0.02, 0.04, 0.08, None]}
    twice = {"users": [2, 4, 8, 16], "tpot_p50_s": [0.01, 0.02, 0.04, 0.08]}
    rows = capacity_rows(twice, baseline)
    assert rows["at_u2_tpot_ratio"] == pytest.approx(2.0)  # TPOT twice as flat: 2x the users
    assert rows["at_u4_tpot_ratio"] == pytest.approx(2.0)
    assert math.isnan(rows["at_u16_tpot_ratio"])  # the baseline measured no TPOT there
    assert users_at_tpot(twice, 0.08) == 16  # capped by the sweep


def test_capacity_does_not_count_noise_as_users() -> None:
    """A reading a hair lower, anywhere in the sweep, counted as users served: curves within
    2% of each other gave 8 times, the baseline against itself 2 times, and a system 10 times
    slower at three points of four 8 times."""
    users = [4, 8, 16, 32]
    vllm = {"users": users, "tpot_p50_s": [0.0300, 0.0302, 0.0305, 0.0310]}
    same = {"users": users, "tpot_p50_s": [0.0301, 0.0300, 0.0303, 0.0299]}
    noisy = {"users": users, "tpot_p50_s": [0.0310, 0.0300, 0.0330, 0.0400]}
    slow = {"users": users, "tpot_p50_s": [0.30, 0.30, 0.30, 0.0299]}
    assert set(capacity_rows(same, vllm).values()) == {1.0}
    assert set(capacity_rows(noisy, noisy).values()) == {1.0}
    assert all(math.isnan(v) for v in capacity_rows(slow, vllm).values())


def test_miss_cost_compares_with_the_advised_system_and_within_the_run() -> None:
    rng = random.Random(1)
    advised = {"users": [2, 16], "followup_ttft_p50_s": [0.05, 0.1],
               "turns": [{"ttft_s": rng.uniform(0.9, 1.1), "fresh_ttft_s": 1.0}
                         for _ in range(40)] + [{"ttft_s": 0.1, "fresh_ttft_s": None}]}
    missing = {"users": [2, 16], "followup_ttft_p50_s": [0.055, 0.104],
               "missed_advisories": [0, 3], "missed_over_advised_p50": [None, 1.2],
               "turns": [{**t, "ttft_s": t["ttft_s"] * 1.5} for t in advised["turns"]]}
    rows = miss_cost_rows(missing, advised)
    assert math.isnan(rows["u2_over_advisory"])  # none dropped there: no cost to show
    assert rows["u16_over_advisory"] == pytest.approx(1.04)
    assert rows["u2_missed_advisories"] == 0 and math.isnan(rows["u2_missed_over_advised"])
    assert rows["u16_missed_over_advised"] == pytest.approx(1.2)
    # Pooled: every turn 1.5 times slower, and the interval tells it from no difference.
    assert rows["all_over_advisory"] == pytest.approx(1.5)
    assert 1.2 < rows["all_over_advisory_lo95"] < 1.5 < rows["all_over_advisory_hi95"]
    same = miss_cost_rows({**missing, "turns": advised["turns"]}, advised)
    assert same["all_over_advisory_lo95"] < 1.0 < same["all_over_advisory_hi95"]
    # A tenth of the turns twice as slow costs a tenth: as a ratio of medians it cost 0 to
    # 4%, whatever the missed turns' slowdown, inside the 6% target (found by a review).
    tenth = [{**t, "ttft_s": t["ttft_s"] * (2.0 if i % 10 == 0 else 1.0)}
             for i, t in enumerate(advised["turns"])]
    assert miss_cost_rows({**missing, "turns": tenth}, advised)["all_over_advisory"] \
        == pytest.approx(1.1, abs=0.01)


def test_the_miss_cost_within_one_run_compares_missed_turns_with_their_advised_neighbours(
        ) -> None:
    """Stop 75's quick run: advisory_miss10's turns over advisory's, pooled, read 1.16 with
    an interval from 0.84 to 1.60, wider than the 6% target, as two engine starts differ; the
    same run's advised turns are the counterfactual one start away from none."""
    rng = random.Random(2)
    turns = [{"ttft_s": rng.uniform(0.9, 1.1), "fresh_ttft_s": 1.0, "advised": i % 10 != 0}
             for i in range(100)] + [{"ttft_s": 0.1, "fresh_ttft_s": None, "advised": False}]
    slow = [{**t, "ttft_s": t["ttft_s"] * (1 if t["advised"] else 2)} for t in turns]
    cost, low, high = within_run_ratio(slow)  # a tenth twice as slow costs a tenth
    assert cost == pytest.approx(1.1, abs=0.01) and low < cost < high
    assert 1.0 < low < 1.1 < high < 1.2
    cost, low, high = within_run_ratio(turns)  # dropped, at no cost
    assert low < 1.0 < high
    # Every turn had its advisory, or none did: nothing to compare.
    assert within_run_ratio([{**t, "advised": True} for t in turns]) == (None, None, None)
    assert within_run_ratio([{**t, "advised": False} for t in turns]) == (None, None, None)
    # In the report beside the comparison with the advisory system, which the start-to-start
    # drift (every turn 1.5 times slower) moves and this does not.
    advised = {"users": [16], "followup_ttft_p50_s": [1.0], "turns": turns}
    drifted = {"users": [16], "followup_ttft_p50_s": [1.5], "missed_advisories": [10],
               "missed_over_advised_p50": [1.0],
               "turns": [{**t, "ttft_s": t["ttft_s"] * 1.5} for t in turns]}
    rows = miss_cost_rows(drifted, advised)
    assert rows["all_over_advisory"] == pytest.approx(1.5)
    assert rows["all_over_advised_lo95"] < 1.0 < rows["all_over_advised_hi95"]


async def test_antiphon_systems_share_one_server_each_with_its_key(tmp_path: Path) -> None:
    """Over a live server (scripted engine): each Antiphon system's turns run under its own
    key, so the engine salts its KV apart; at each point the systems take turns in an order
    rotated from point to point, and every system gets its whole sweep."""
    from antiphon.engine_ext.scripted import ScriptedEngine
    from antiphon.server.auth import Authenticator
    from tests.conftest import scripted_config
    from tests.liveserver import live_server

    systems = [sessions.SYSTEMS[n] for n in ("tiers", "advisory", "advisory_miss10")]
    keys = tuple(sessions.system_key(s) for s in systems)
    engine = ScriptedEngine()
    order: list[str] = []
    real_measure = sessions.measure_point

    async def measure_point(chat, read_counters, system, *args):  # type: ignore[no-untyped-def]
        order.append(system.name)
        return await real_measure(chat, read_counters, system, *args)

    sweep = sessions.Sweep(users=(1, 2), messages=((("a0", "a1"),), (("b0", "b1"), ("c0", "c1"))),
                           max_model_len=4096, kv_pages=8, pages_per_user=1.0)
    args = argparse.Namespace(seed=0, max_tokens=4, time_scale=0.0)
    with live_server(scripted_config(tmp_path, api_keys=keys), engine) as url:
        server = argparse.Namespace(url=url, ws_url=url.replace("http://", "ws://") + "/v1/ws")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sessions, "measure_point", measure_point)
            results = await sessions.measure_systems(systems, server, sweep, args, rotate=1)
    assert order == ["advisory", "advisory_miss10", "tiers",  # point 0: rotated by 1
                     "advisory_miss10", "tiers", "advisory"]  # point 1: by 2
    assert sorted(results) == ["advisory", "advisory_miss10", "tiers"]
    for result in results.values():
        assert result["users"] == [1, 2] and len(result["turns"]) == 2 + 4
    salts = set(engine.cache_salts)
    assert salts == {Authenticator.fingerprint(k) for k in keys}  # each key's own, and no other


async def test_a_failed_turn_names_its_system_and_point() -> None:
    class Refused(FakeChat):
        async def turn(self, message: str) -> TurnResult:
            if message == "b1":
                raise ConnectionError("refused")
            return await super().turn(message)

    async def no_counters() -> None:
        return None

    args = argparse.Namespace(seed=0, max_tokens=4, time_scale=0.0)
    with pytest.raises(RuntimeError, match=r"^vllm at 2 users: .*refused"):
        await sessions.measure_point(lambda max_tokens: Refused(), no_counters,
                                     sessions.SYSTEMS["vllm"], 2, [("a0", "a1"), ("b0", "b1")],
                                     args)


def test_what_was_measured_before_a_failure_is_written(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One failed turn ended the run and took every finished system's results with it: the
    record is written after each server's systems, incomplete until the end, and with the
    error where one ended the run (found by a review)."""
    out = tmp_path / "sessions.json"
    sweep = sessions.Sweep(users=(2,), messages=((("a0", "a1"), ("b0", "b1")),),
                           max_model_len=640, kv_pages=8, pages_per_user=1.0)
    args = argparse.Namespace(repeats=1)
    measured: list[str] = []

    class Server:
        def __init__(self, cmd: list[str], **kwargs: object) -> None:
            pass

        def __enter__(self) -> Server:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    async def measure_systems(group, server, sweep, args, repeat):  # type: ignore[no-untyped-def]
        if group[0].is_stock_vllm:
            raise RuntimeError("vllm at 2 users: a conversation failed")
        measured.extend(s.name for s in group)
        return {s.name: {"users": [2], "turns": []} for s in group}

    monkeypatch.setattr(sessions, "ServerProcess", Server)
    monkeypatch.setattr(sessions, "server_command", lambda *a: ["serve"])
    monkeypatch.setattr(sessions, "measure_systems", measure_systems)
    systems = [sessions.SYSTEMS[n] for n in ("vllm", "tiers", "advisory")]
    # the Antiphon server first, stock vLLM's failing after it
    monkeypatch.setattr(sessions, "alternated", lambda groups, repeat: [groups[1], groups[0]])
    with pytest.raises(RuntimeError, match="vllm at 2 users"):
        sessions.measure_all(systems, tmp_path, sweep, args, {"seed": 0}, out)
    assert measured == ["tiers", "advisory"]
    record = json.loads(out.read_text())
    assert record["complete"] is False and record["config"] == {"seed": 0}
    assert sorted(record["systems"]) == ["advisory", "tiers"]  # kept; vllm has no run
    assert record["error"] == "RuntimeError: vllm at 2 users: a conversation failed"

    monkeypatch.setattr(sessions, "alternated", lambda groups, repeat: [groups[1]])
    runs = sessions.measure_all(systems[1:], tmp_path, sweep, args, {}, out)
    assert json.loads(out.read_text())["complete"] is False  # written before the report
    final = sessions.sessions_record({}, runs, complete=True)
    assert final["complete"] is True and "error" not in final


def test_the_shared_antiphon_server_takes_a_key_per_system(tmp_path: Path) -> None:
    from antiphon.cli import build_parser
    from antiphon.configfields import dataclass_from_args
    from antiphon.server.config import ServerConfig

    sweep = sessions.Sweep(users=(1, 64), messages=(), max_model_len=640, kv_pages=14,
                           pages_per_user=1.0)
    args = argparse.Namespace(dtype="bfloat16", enforce_eager=True, host_tier_bytes=1 << 20,
                              ssd_tier_bytes=1 << 24, policy=None, serve_extra="", model=None)
    cmd = sessions.server_command(sessions.SYSTEMS["advisory"], tmp_path, sweep, args, tmp_path,
                                  num_sharing=3)
    assert cmd[1:3] == ["-m", "antiphon"]
    parsed = build_parser().parse_args(cmd[3:])
    config = dataclass_from_args(ServerConfig, parsed)
    assert config.api_keys == tuple(sessions.system_key(s) for s in sessions.SYSTEMS.values()
                                    if not s.is_stock_vllm)
    # The systems sharing the server have as much tier room each as one had alone.
    assert (parsed.host_tier_bytes, parsed.ssd_tier_bytes) == (3 << 20, 3 << 24)
    # 64 users and their probes: past the per-key defaults of 64 connections and replies
    assert config.max_connections_per_key >= 128 and config.max_inflight_per_key >= 128


def test_the_servers_alternate_which_runs_first() -> None:
    # Stock vLLM ran first in every repeat: a host that drifts favoured one side (found by a
    # review).
    from antiphon.bench.sessions import alternated

    groups: list[list[str]] = [["vllm"], ["antiphon", "antiphon-no-hints"]]
    assert [g[0] for r in range(4) for g in alternated(groups, r)] == [
        "vllm", "antiphon", "antiphon", "vllm", "vllm", "antiphon", "antiphon", "vllm"]
    assert alternated([[], ["antiphon"]], 1) == [["antiphon"]]
