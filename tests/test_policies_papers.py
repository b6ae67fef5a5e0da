"""HyGen, Echo and LARRY policies, and invariants every registered policy keeps: hand-built
request views, no engine, no torch."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import random
import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from antiphon.engine_ext.costforms import BrosForm, EchoForm
from antiphon.engine_ext.costmodel import CostModel, StepShape
from antiphon.engine_ext.policies import POLICIES, make_policy, policy_class
from antiphon.engine_ext.policies.base import admission_pages, new_pages
from antiphon.engine_ext.policies.bros import BrosPolicy
from antiphon.engine_ext.policies.echo import EchoPolicy
from antiphon.engine_ext.policies.hygen import HygenPolicy
from antiphon.engine_ext.policies.larry import LarryPolicy
from antiphon.engine_ext.policies.prefix import ResidentPrefixes, dfs_order
from antiphon.engine_ext.policies.stepbatch import StepBatch, ttft_floor
from antiphon.engine_ext.types import RequestClass
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan
from tests.test_policies import PAGE, budget, constant_cost, decoding, per_request_cost, view

RT, BE = RequestClass.RT, RequestClass.BE


def chain(*labels: str) -> tuple[bytes, ...]:
    """Chained page hashes as vLLM makes them: page k's hash covers pages 0..k."""
    hashes, prev = [], b""
    for label in labels:
        prev = hashlib.sha256(prev + label.encode()).digest()
        hashes.append(prev)
    return tuple(hashes)


def token_cost(per_token_s: float, step_s: float = 0.0) -> CostModel:
    """Every new token costs `per_token_s` (a decode request computes one), a step `step_s`."""
    return CostModel("hygen", {"prefill_token_s": per_token_s,
                               "decode_request_s": per_token_s, "intercept_s": step_s})


def predicted_s(cost: CostModel, views: list[RequestView], plan: StepPlan) -> float:
    """The cost model's latency of the step `plan` chooses."""
    by_id = {v.request_id: v for v in views}
    reqs = []
    for rid in plan.order:
        v = by_id[rid]
        new = plan.token_limits.get(rid, v.num_new_tokens)
        reqs.append((new, v.num_computed_tokens + new))
    return cost.predict_s(StepShape.of(reqs))


GUARDED = ["bros", "hygen", "echo"]


@pytest.mark.parametrize("name", GUARDED)
def test_arrival_guard_chunks_be_prefills_when_no_rt_is_present(name: str) -> None:
    """With no RT request the paper policies have no time limit: one step would prefill three
    1,000-token documents (3 s at 1 ms a token) and a turn arriving meanwhile would wait for
    all of them. The guard keeps BE steps within 0.25 s, cutting the prefill that crosses it."""
    cost = token_cost(1e-3)
    docs = [view(f"doc{i}", BE, arrival=i, prompt=1000) for i in range(3)]
    unguarded = make_policy(name, cost).plan(docs, budget())
    assert predicted_s(cost, docs, unguarded) > 2.0
    step = dataclasses.replace(budget(), max_be_step_s=0.25)
    plan = make_policy(name, cost).plan(docs, step)
    assert plan.order == ["doc0"] and plan.token_limits == {"doc0": 250}
    assert predicted_s(cost, docs, plan) <= 0.25 + 1e-12


@pytest.mark.parametrize("name", GUARDED)
def test_arrival_guard_still_lets_every_step_progress(name: str) -> None:
    """A guard shorter than any chunk leaves the first BE request a page of tokens."""
    cost = token_cost(1e-3, step_s=0.5)
    docs = [view("doc", BE, prompt=1000)]
    plan = make_policy(name, cost).plan(docs, dataclasses.replace(budget(),
                                                                  max_be_step_s=0.25))
    assert plan.order == ["doc"] and plan.token_limits == {"doc": PAGE}


@pytest.mark.parametrize("name", GUARDED)
def test_arrival_guard_never_cuts_rt_work(name: str) -> None:
    """The guard is for BE work only: an RT prompt of 500 tokens (0.5 s) is prefilled whole
    with a 0.25 s guard, and the BE request waits for a step it fits in."""
    cost = token_cost(1e-3)
    views = [view("rt", prompt=500), view("doc", BE, prompt=1000)]
    policy = make_policy(name, cost)
    if isinstance(policy, HygenPolicy):
        policy.latency_budget_s = 1.0  # its TPOT-derived budget would cut the RT prefill too
    plan = policy.plan(views, dataclasses.replace(budget(), max_be_step_s=0.25))
    assert plan.order == ["rt"] and plan.token_limits == {"rt": 500}


def test_registry_lists_the_paper_policies() -> None:
    assert {"hygen", "echo", "larry"} <= set(POLICIES)
    with pytest.raises(ValueError, match="bros, bros_no_block_preemption, echo, fcfs, hygen, larry, priority"):
        policy_class("edf")


# --- prefix helpers -------------------------------------------------------------------------

def test_dfs_order_puts_prefix_sharing_requests_together() -> None:
    views = [view("a1", BE, prefix_page_hashes=chain("a", "x")),
             view("b1", BE, prefix_page_hashes=chain("b")),
             view("a2", BE, prefix_page_hashes=chain("a", "y")),
             view("none", BE),
             view("a3", BE, prefix_page_hashes=chain("a"))]
    ids = [v.request_id for v in dfs_order(views)]
    a_positions = sorted(ids.index(r) for r in ("a1", "a2", "a3"))
    assert a_positions == list(range(a_positions[0], a_positions[0] + 3))
    assert ids.index("a3") < ids.index("a1")  # a node before its children
    assert ids[0] == "none"


def test_resident_prefixes_count_whole_shared_pages_but_never_the_last_token() -> None:
    holder = view("run", BE, prompt=64, computed=64, output=1, running=True,
                  prefix_page_hashes=chain("a", "b", "c", "d"))
    resident = ResidentPrefixes([holder], PAGE)
    sharing = view("w", BE, prompt=80, prefix_page_hashes=chain("a", "b", "c", "z", "q"))
    assert resident.num_cached_tokens(sharing) == 3 * PAGE
    same = view("w2", BE, prompt=64, prefix_page_hashes=chain("a", "b", "c", "d"))
    assert resident.num_cached_tokens(same) == 3 * PAGE  # the last token is always computed
    assert resident.num_cached_tokens(view("w3", BE, prompt=64)) == 0
    # The scheduler's view counts the device's prefix hit as computed already: only what lies
    # beyond it is more.
    seen = view("w4", BE, prompt=80, computed=2 * PAGE,
                prefix_page_hashes=chain("a", "b", "c", "z", "q"))
    assert resident.num_cached_tokens(seen) == PAGE
    assert resident.num_cached_tokens(dataclasses.replace(seen, num_computed_tokens=64)) == 0


@pytest.mark.parametrize("name", ["hygen", "echo"])
def test_a_prefix_held_by_a_request_preempted_in_the_plan_is_not_resident(name: str) -> None:
    """The pages of a BE request preempted for an RT turn go back to the pool: a waiting
    request over the same document was credited them as still held too, and the plan needed
    more pages than the pool had."""
    doc = chain("d0", "d1", "d2", "d3", "d4")  # a 5-page document
    held = view("V", BE, prompt=80, computed=83, output=4, running=True,  # 6 of the 8 pages
                prefix_page_hashes=doc)
    over_doc = view("W", BE, prompt=96, arrival=1.0, prefix_page_hashes=(*doc, *chain("q")))
    turn = view("R", prompt=90, arrival=2.0)  # 6 pages
    views = {v.request_id: v for v in (held, over_doc, turn)}
    plan = make_policy(name, constant_cost(0.001)).plan(
        list(views.values()), StepBudget(now_s=2.0, max_num_seqs=8, max_num_tokens=2048,
                                         num_free_pages=2, page_tokens=PAGE,
                                         num_total_pages=8))
    assert plan.preempt == ["V"] and plan.order[0] == "R"
    # every page a planned request holds after the step comes from the pool (V's are back
    # in it: W finding them in the prefix cache takes them from it too)
    assert sum(new_pages(views[rid], plan.token_limits.get(rid, views[rid].num_new_tokens),
                         PAGE) for rid in plan.order) <= 2 + 6


@pytest.mark.parametrize("name", ["echo", "hygen"])
def test_a_be_request_over_a_document_a_running_one_holds_is_admitted(name: str) -> None:
    """Batch items asking questions over one document: the scheduler's view counts the
    document's pages (held by the running item) as computed, and the policies counted them
    again: the waiting item had fewer than no tokens to compute and was never admitted."""
    doc = chain("a", "b", "c", "d", "e", "f", "g", "h")
    running = view("q1", BE, prompt=140, computed=145, output=6, running=True,
                   prefix_page_hashes=doc)
    waiting = view("q2", BE, prompt=140, computed=8 * PAGE, prefix_page_hashes=doc)
    cost = CostModel("hygen", {"intercept_s": 0.01, "prefill_token_s": 1e-4,
                               "decode_request_s": 1e-3})
    plan = make_policy(name, cost).plan([running, waiting], budget())
    assert "q2" in plan.order


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["grow", "stop", "swap"]),
                          st.integers(0, 3)), min_size=1, max_size=40))
def test_resident_prefixes_kept_across_steps_match_a_fresh_index(
        steps: list[tuple[int, str, int]]) -> None:
    """Updated step by step (hash lists growing in place as vLLM's do, requests stopping,
    a request's list replaced), the index answers as one built from scratch."""
    lists: dict[str, list[bytes]] = {}
    computed: dict[str, int] = {}
    kept = ResidentPrefixes()
    for index, action, arg in steps:
        rid = f"r{index}"
        if action == "stop":
            lists.pop(rid, None)
        elif action == "swap" or rid not in lists:
            lists[rid] = list(chain(*"ab"[:1 + arg % 2], rid)[:2 + arg])
            computed[rid] = len(lists[rid]) * PAGE
        else:
            lists[rid].extend(chain(rid, *map(str, range(len(lists[rid]) + arg + 1)))[
                len(lists[rid]):len(lists[rid]) + arg + 1])
            computed[rid] = min(len(lists[rid]), computed[rid] // PAGE + arg) * PAGE
        views = [view(r, BE, prompt=len(h) * PAGE, computed=computed[r], running=True,
                      prefix_page_hashes=h) for r, h in lists.items()]
        kept.update(views, PAGE)
        fresh = ResidentPrefixes(views, PAGE)
        assert kept._num_holders == fresh._num_holders
        for h in lists.values():
            query = view("w", BE, prompt=len(h) * PAGE + 1, prefix_page_hashes=tuple(h))
            assert kept.num_cached_tokens(query) == fresh.num_cached_tokens(query)


# --- HyGen ----------------------------------------------------------------------------------

def test_hygen_runs_prefix_sharing_be_requests_back_to_back() -> None:
    labels = {"a1": "a", "b1": "b", "a2": "a", "b2": "b", "a3": "a"}
    views = [view(rid, BE, arrival=i, prompt=48, prefix_page_hashes=chain(p, p, rid))
             for i, (rid, p) in enumerate(labels.items())]
    plan = HygenPolicy(constant_cost(0.01), utility=1.0).plan(views, budget())
    groups = ["".join(labels[rid] for rid in plan.order)]
    assert groups[0] in ("aaabb", "bbaaa")
    assert plan.is_restrictive and plan.preempt == []


def test_hygen_mixes_in_the_oldest_be_request_by_the_utility_ratio() -> None:
    # The oldest request sorts last in the prefix tree; it must not wait for the whole tree.
    last = max("bcdefgh", key=lambda label: chain(label))
    assert chain(last) > chain("a")
    views = [view("old", BE, arrival=0.0, prefix_page_hashes=chain(last)),
             *(view(f"a{i}", BE, arrival=1.0 + i, prefix_page_hashes=chain("a", str(i)))
               for i in range(4))]
    head = dfs_order(views)[0].request_id
    assert head != "old"
    one_seat = budget(max_seqs=1)
    greedy = HygenPolicy(constant_cost(0.01), utility=1.0)
    assert [greedy.plan(views, one_seat).order for _ in range(2)] == [[head], [head]]
    mixed = HygenPolicy(constant_cost(0.01), utility=0.5)
    assert [mixed.plan(views, one_seat).order for _ in range(2)] == [[head], ["old"]]
    assert HygenPolicy(constant_cost(0.01), utility=0.5).plan(
        views, budget()).order[:2] == [head, "old"]


def test_hygen_fits_the_step_into_the_latency_budget() -> None:
    cost = token_cost(1e-4, step_s=0.01)
    rt_decodes = [decoding(f"rt{i}", arrival=i) for i in range(3)]  # TPOT SLO 0.1 s
    doc = view("doc", BE, prompt=5000)
    views = [*rt_decodes, doc]
    policy = HygenPolicy(cost)
    plan = policy.plan(views, budget())
    assert policy.step_budget_s(rt_decodes) == pytest.approx(0.1)
    assert plan.order == ["rt0", "rt1", "rt2", "doc"]
    # 0.01 + 1e-4 * (3 + chunk) <= 0.1: the document's prefill is cut to 897 tokens.
    assert plan.token_limits == {"doc": 897}
    assert predicted_s(cost, views, plan) <= 0.1 + 1e-12


def test_hygen_online_phase_admits_rt_within_the_budget() -> None:
    policy = HygenPolicy(per_request_cost(0.04))  # 0.1 s budget: two requests a step
    views = [decoding(f"rt{i}", arrival=i) for i in range(4)] + [decoding("be", BE)]
    assert policy.plan(views, budget()).order == ["rt0", "rt1"]
    tight = HygenPolicy(per_request_cost(0.04), latency_budget_s=0.01)
    assert tight.plan(views, budget()).order == ["rt0"]  # the first request always runs


def test_hygen_oldest_rt_prefill_advances_when_decodes_fill_the_budget() -> None:
    # A 62 ms fixed step cost and 6 ms a decode: five RT decodes fill the 0.1 s TPOT budget.
    cost = CostModel("hygen", {"prefill_token_s": 3.5e-3, "decode_request_s": 6e-3,
                               "intercept_s": 0.062})
    # Both prompts are past their TTFT already, so neither has a chunk it needs to make it.
    views = [*(decoding(f"rt{i}", arrival=i) for i in range(6)),
             view("new", RT, prompt=100, arrival=9), view("newer", RT, prompt=100, arrival=10)]
    plan = HygenPolicy(cost).plan(views, budget(now=12.0))
    assert "new" in plan.order and "newer" not in plan.order
    assert plan.token_limits["new"] == 16  # a small chunk, not the whole prompt
    assert plan.order.index("new") == len(plan.order) - 1  # after the decodes it joins


def test_hygen_rt_prefills_get_the_chunk_that_meets_their_ttft_past_the_budget() -> None:
    # Six decodes fill the 0.1 s budget (62 ms a step, 6 ms a decode); two 300-token prompts
    # that can still make their 1 s TTFT each get their prompt spread over the 7 steps left.
    cost = CostModel("hygen", {"prefill_token_s": 1e-3, "decode_request_s": 6e-3,
                               "intercept_s": 0.062})
    views = [*(decoding(f"rt{i}", arrival=0.0) for i in range(6)),
             view("new", RT, prompt=300, arrival=0.0), view("newer", RT, prompt=300, arrival=0.05)]
    plan = HygenPolicy(cost).plan(views, budget(now=0.2))
    assert plan.order[-2:] == ["new", "newer"]
    assert plan.token_limits == {"new": 43, "newer": 43}  # ceil(300 / 7)


def test_hygen_running_be_decodes_keep_their_step_when_prefills_fill_the_budget() -> None:
    # 10 ms a step and 0.1 ms a token: the 0.1 s TPOT budget holds 900 tokens after the step.
    cost = token_cost(1e-4, step_s=0.01)
    policy = HygenPolicy(cost)
    # A running BE prefill that arrived first would fill the budget; the decode behind it
    # would sit out the step holding its pages.
    doc = view("doc", BE, prompt=5000, computed=512, running=True, arrival=0.0)
    views = [decoding("rt"), doc, decoding("be_dec", BE, arrival=1.0)]
    plan = policy.plan(views, budget())
    assert plan.order == ["rt", "be_dec", "doc"]
    assert plan.token_limits == {"doc": 898}
    # An RT prompt longer than the budget leaves room for the BE decodes (its TTFT floor,
    # 2,000 tokens over 9 steps, is far below its chunk).
    views = [decoding("rt"), view("new", RT, prompt=2000), decoding("be1", BE),
             decoding("be2", BE)]
    plan = policy.plan(views, budget())
    assert plan.order == ["rt", "new", "be1", "be2"]
    assert plan.token_limits == {"new": 897}
    assert predicted_s(cost, views, plan) <= 0.1 + 1e-12


def test_hygen_running_be_decodes_do_not_shrink_an_rt_prompts_ttft_floor() -> None:
    # The floor counted the steps left to the TTFT deadline in units of L less the BE
    # decodes' cost, while the steps still last about L: five BE decodes halved a 2,000-token
    # prompt's chunk to 112 tokens, under the 223 its 9 steps need (first token at 1.95 s
    # against a 1 s target, simulated).
    cost = CostModel("hygen", {"prefill_token_s": 4e-4, "decode_request_s": 0.01})
    rtd, new = decoding("rtd"), view("new", RT, prompt=2000)
    bes = [decoding(f"be{i}", BE) for i in range(5)]
    assert HygenPolicy(cost).plan([rtd, new], budget()).token_limits == {"new": 225}
    mixed = HygenPolicy(cost).plan([rtd, new, *bes], budget())
    assert mixed.token_limits["new"] >= -(-2000 // 9)


def test_an_rt_prompt_of_several_steps_gets_the_floor_its_whole_prompt_needs() -> None:
    # The floor spread one step's tokens (2,048) over the 8 steps left, whatever the prompt's
    # length: a 6,000-token prompt got 256 tokens a step of the 750 it needed (found by a
    # review). One that cannot make its TTFT even alone gets none (its prefill, 8 steps of
    # 0.22 s, outlasts the 0.95 s left), as one of a single step did.
    cost = CostModel("hygen", {"prefill_token_s": 1e-4, "intercept_s": 0.02})
    batch = StepBatch(budget(now=0.05), cost)
    floors = {n: ttft_floor(view("t", prompt=n), batch, 0.1, 0.05) for n in (2000, 6000, 16000)}
    assert floors == {2000: 250, 6000: 750, 16000: 0}


def test_hygen_a_turn_too_late_for_its_ttft_takes_the_step_from_be_decodes() -> None:
    # A turn that could no longer make its TTFT (`ttft_floor` 0) got its prefill chunk cut to
    # L less the running BE decodes' time: with those filling L, 16 tokens a step while they
    # ran at full speed (first token at 33 s beside 12 of them, 1.9 s without; found by a
    # review). Simulated step by step, time moving by each step's predicted latency.
    cost = CostModel("hygen", {"intercept_s": 0.02, "prefill_token_s": 2e-4,
                               "decode_request_s": 0.006})

    def first_token_s(num_be: int) -> float:
        policy, now = HygenPolicy(cost), 0.0
        turn = view("turn", prompt=6000, ttft_slo_s=0.9, tpot_slo_s=0.09)
        bes = [decoding(f"be{i}", BE) for i in range(num_be)]
        while turn.num_computed_tokens < 6000:
            streams = [decoding(f"s{i}", tpot_slo_s=0.09, first_token_s=now - 0.36)
                       for i in range(2)]  # on time, due within the step
            plan = policy.plan([turn, *streams, *bes], budget(now=now))
            done = plan.token_limits.get("turn", turn.num_new_tokens) \
                if "turn" in plan.order else 0
            shape = StepShape().plus(done, turn.num_computed_tokens + done, is_prefill=True)
            for _ in range(len(plan.order) - ("turn" in plan.order)):
                shape = shape.plus(1, 40, is_prefill=False)
            turn = dataclasses.replace(turn, num_computed_tokens=turn.num_computed_tokens + done,
                                       is_running=True)
            now += cost.predict_s(shape)
        return now

    alone = first_token_s(0)
    assert first_token_s(12) <= 1.1 * alone


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_a_target_of_1e308_seconds_plans_without_overflow(name: str) -> None:
    # `ttft_floor` counted the steps to the first token's deadline with int(slack / L): a
    # request's ttft_slo_s of 1e308 made that inf, and the OverflowError stopped the engine
    # (found by a review; the server now refuses more than a day, and the planning holds).
    cost = CostModel("hygen", {"prefill_token_s": 1e-4, "intercept_s": 0.02})
    rt = view("huge", prompt=6000, ttft_slo_s=1e308, tpot_slo_s=1e308)
    plan = make_policy(name, cost).plan([decoding("rtd"), rt], budget())
    assert "huge" in plan.order
    batch = StepBatch(budget(), cost)
    assert ttft_floor(rt, batch, 0.1, 0.0) >= 1


@pytest.mark.parametrize("name", ["bros", "hygen"])
def test_a_prompt_late_by_the_decodes_seated_before_it_is_not_forced_in_whole(
        name: str) -> None:
    # Judged as if alone (0.42 s against 0.45 s of slack), it got the floor of a prompt that
    # still makes its TTFT, the whole prompt: the step took 0.5 s, and the 16 streams seated
    # before it, due in 0.15 s, were all late with it (found by a review of the fix above).
    cost = CostModel("hygen", {"prefill_token_s": 1e-4, "decode_request_s": 5e-3,
                               "intercept_s": 0.02})
    now = 100.0
    streams = [view(f"s{i}", prompt=100, computed=120, output=21, running=True, arrival=90.0,
                    tpot_slo_s=0.2, first_token_s=now - 21 * 0.2 + 0.15) for i in range(16)]
    prompt = view("P", prompt=4000, arrival=now - 0.55, tpot_slo_s=0.2)
    views = [*streams, prompt]
    plan = make_policy(name, cost).plan(views, dataclasses.replace(
        budget(now=now, free_pages=10_000), max_num_tokens=8192))
    assert len(plan.order) == 17 and plan.token_limits["P"] <= 1000
    assert predicted_s(cost, views, plan) <= 0.2 + 1e-9


def test_bros_sends_a_prompt_too_long_for_its_ttft_in_several_steps_to_the_back() -> None:
    # Judged by its first step's chunk, a 6,000-token prompt (1.26 s of prefill alone against
    # a 1 s TTFT) kept its earliest-deadline place and took every step's tokens from the short
    # turn behind it (found by a review).
    cost = CostModel("hygen", {"prefill_token_s": 2e-4, "intercept_s": 0.02})
    long, short = view("long", prompt=6000, arrival=10.0), view("short", prompt=200, arrival=10.01)
    plan = BrosPolicy(cost).plan([long, short], budget(now=10.05, free_pages=10_000))
    assert plan.order[0] == "short" and plan.token_limits.get("short", 200) == 200


def test_hygen_gives_an_rt_prefill_the_time_of_the_be_decodes_preempted_for_it() -> None:
    # Its chunk was cut by the time of all running BE decodes, also those then preempted for
    # its pages; the time kept went to a BE request not yet started (found by a review).
    cost = CostModel("hygen", {"prefill_token_s": 1e-4, "decode_request_s": 2e-3,
                               "intercept_s": 0.02})
    views = [view("stream", prompt=100, computed=104, output=5, running=True, arrival=99.0,
                  first_token_s=99.5),
             view("turn", prompt=4000, arrival=99.9),
             *(RequestView(f"be{i}", BE, 90.0 + i, 1599, 1600, 2, True) for i in range(10)),
             view("fresh_be", BE, prompt=300, arrival=95.0)]
    roomy = HygenPolicy(cost).plan(views, dataclasses.replace(budget(now=100.0), max_num_tokens=8192))
    assert roomy.preempt == [] and roomy.token_limits == {"turn": 580}
    short = HygenPolicy(cost).plan(views, dataclasses.replace(budget(now=100.0, free_pages=0),
                                                              max_num_tokens=8192))
    assert len(short.preempt) == 3 and "fresh_be" not in short.order
    assert short.token_limits["turn"] >= 580 + 3 * 20 - 1  # each decode's 2 ms: 20 tokens


def test_hygen_credits_a_preempted_decode_only_with_its_own_share_of_the_step() -> None:
    # A decode step's fixed cost is in every decode's share and once in their sum: preempting
    # one of three was credited it, the second turn's chunk took the time the decodes still
    # in the step needed, and none of them was seated (found by a review).
    cost = CostModel("bros", {"prefill_token_s": 1e-4, "decode_token_s": 1e-4,
                              "decode_step_s": 0.02})
    views = [view("first", prompt=320, arrival=99.8), view("turn", prompt=1500, arrival=99.9),
             *(RequestView(f"be{i}", BE, 90.0 + i, 1599, 1600, 2, True) for i in range(3))]
    plan = HygenPolicy(cost, latency_budget_s=0.12).plan(views, dataclasses.replace(
        budget(now=100.0, free_pages=20), max_num_tokens=8192))
    assert plan.preempt == ["be2"] and plan.order[:2] == ["first", "turn"]
    assert {"be0", "be1"} & set(plan.order)
    assert predicted_s(cost, views, plan) <= 0.12 + 1e-9


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_no_fresh_be_request_starts_on_pages_be_requests_preempted_for_rt_left_over(
        name: str) -> None:
    # BROS seated a document item not yet started on the pages left over by the one it
    # preempted for the turn, which then resumed short of them (found by a review).
    cost = CostModel("hygen", {"prefill_token_s": 1e-4, "decode_request_s": 2e-3,
                               "intercept_s": 0.02})
    views = [view("turn", prompt=1000, arrival=99.9),
             *(RequestView(f"be{i}", BE, 90.0 + i, 1599, 1600, 2, True) for i in range(4)),
             view("fresh_be", BE, prompt=300, arrival=95.5)]
    plan = make_policy(name, cost).plan(views, dataclasses.replace(
        budget(now=100.0, free_pages=0), max_num_tokens=8192, num_total_pages=400))
    assert len(plan.preempt) == 1 and "turn" in plan.order and "fresh_be" not in plan.order


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_a_running_be_prefill_short_of_pages_computes_the_chunk_they_allow(name: str) -> None:
    # bros and echo left it out whole: a step of only such requests was empty, and the
    # engine's own step then preempted one to recompute (found by a review).
    cost = CostModel("hygen", {"prefill_token_s": 1e-4, "intercept_s": 0.02})
    views = [view("docA", BE, prompt=4000, computed=1024, running=True, arrival=1.0),
             view("docB", BE, prompt=4000, computed=512, running=True, arrival=2.0)]
    plan = make_policy(name, cost).plan(views, budget(now=10.0, free_pages=3))
    assert plan.order == ["docA"] and plan.token_limits == {"docA": 3 * PAGE}


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_pages_a_victim_gives_back_only_next_step_seat_no_one_this_step(name: str) -> None:
    # An overlapped engine (a GPU's) with a KV connector returns a preempted request's pages
    # only once the step in flight has run: an RT request seated on them failed its
    # allocation, and vLLM then preempted an RT stream that sat a step out, or left every
    # request after it out of the step. It is seated at the next step instead.
    policy = make_policy(name, constant_cost(0.01))
    fresh = view("fresh", prompt=48)  # 3 pages
    streaming = view("streaming", prompt=32, computed=48, output=17, running=True)  # 1 page
    for late in (False, True):
        be = decoding("be", BE, frees_pages_late=late)  # 3 pages
        for rt, free in ((fresh, 1), (streaming, 0)):
            plan = policy.plan([be, rt], budget(free_pages=free))
            assert plan.preempt == ["be"], (rt.request_id, late)
            assert (rt.request_id in plan.order) is not late, (rt.request_id, late)


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_a_turn_waiting_for_pages_the_next_step_brings_keeps_waiting_work_off_them(
        name: str) -> None:
    # The free pages it counts on went to a waiting item, which the next step preempted in
    # turn (late again) for the turn, and the preempted request took them back: a cycle for
    # as long as BE work lasted (found by a review).
    policy = make_policy(name, constant_cost(0.01))
    be = decoding("be", BE, frees_pages_late=True)  # 3 pages
    waiting = [view("rt", prompt=64), view("later", prompt=16), view("item", BE, prompt=16)]
    plan = policy.plan([be, *waiting], budget(free_pages=2))  # the turn needs 4
    assert plan.preempt == ["be"] and plan.order == []


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_a_turn_waiting_for_pages_the_next_step_brings_keeps_running_work_off_them(
        name: str) -> None:
    # Running BE requests seated after the deferred turn took the pages free now (vLLM gives
    # pages to running requests first): at the next step the turn was short again, another
    # victim was taken late, and so on (hygen never seated it in 50 steps; found by a review).
    policy = make_policy(name, constant_cost(0.01))
    # three BE decodes at a page boundary: each needs a fourth page to go on
    be = [view(f"be{i}", BE, arrival=i, prompt=40, computed=48, output=9, running=True,
               frees_pages_late=True) for i in range(3)]
    turn = view("rt", arrival=5.0, prompt=64)  # needs 4 pages; 2 free
    plan = policy.plan([*be, turn], budget(now=5.0, free_pages=2))
    assert plan.preempt and "rt" not in plan.order  # the victim's pages come next step
    assert not [r for r in plan.order if r.startswith("be")]  # the 2 free pages wait for it


@pytest.mark.parametrize("name", ["bros", "echo"])
def test_a_turn_waiting_for_pages_the_next_step_brings_leaves_rt_streams_the_free_ones(
        name: str) -> None:
    # Kept for the turn from everything planned after it, the free pages were kept from a
    # running RT stream too, which vLLM would have given one first: its token came a step late
    # (found by a review).
    policy = make_policy(name, constant_cost(0.01))
    turn = view("w", prompt=64)  # 4 pages; 2 free
    stream = view("r", prompt=40, computed=48, output=9, running=True)  # needs 1 page
    be = view("be", BE, prompt=40, computed=40, output=1, running=True, frees_pages_late=True)
    plan = policy.plan([turn, stream, be], budget(now=0.5, free_pages=2))
    assert plan.preempt == ["be"] and "r" in plan.order and "w" not in plan.order


def test_hygen_keeps_a_later_turn_off_the_pages_a_deferred_turn_counts_on() -> None:
    # Pages a finished request frees at the next step cover the older turn: it waits a step.
    # The newer turn took the free pages meanwhile, the older was short again, and a BE
    # decode was preempted for nothing (found by a review of this stop's diff).
    policy = make_policy("hygen", constant_cost(0.01))
    older, newer = view("a", arrival=0.0, prompt=64), view("b", arrival=1.0, prompt=16)
    step = dataclasses.replace(budget(now=1.0, free_pages=2), num_pages_next_step=2)
    plan = policy.plan([older, newer, decoding("be", BE)], step)
    assert "a" not in plan.order and "b" not in plan.order and plan.preempt == []


def test_pages_victims_share_free_late_if_one_of_them_does() -> None:
    # A page two batch items of one document share frees with the last to go: counted free
    # at once where that one sat the step in flight out, though the first lets go of its
    # reference only at the next step (found by a review).
    from antiphon.engine_ext.policies.stepbatch import StepBatch, Victims, preempt

    doc = tuple(bytes([i]) * 32 for i in range(4))
    shared = {"prompt": 80, "computed": 64, "output": 1, "running": True,
              "num_shared_pages": 4, "shared_page_holders": (2,) * 4, "prefix_page_hashes": doc}
    late, on_time = view("a", BE, frees_pages_late=True, **shared), view("b", BE, **shared)
    batch, plan = StepBatch(budget(free_pages=0), constant_cost(0.01)), StepPlan()
    victims = Victims([late, on_time], PAGE)
    victims.take_one(batch, plan)
    victims.take_one(batch, plan)
    assert (batch.pages_left, victims.pages_next_step) == (0, 4)
    # and one preempted outside the victims (the ablation without block preemption)
    batch = StepBatch(budget(free_pages=0), constant_cost(0.01))
    assert preempt(decoding("c", BE, frees_pages_late=True), batch, StepPlan()) == 3
    assert batch.pages_left == 0


def test_hygen_rt_takes_pages_from_be_never_the_reverse() -> None:
    policy = HygenPolicy(constant_cost(0.01))
    be_old = decoding("be_old", BE, arrival=0.0)
    be_new = decoding("be_new", BE, arrival=5.0)
    be_low = decoding("be_low", BE, arrival=1.0, priority=1)  # least important
    rt = view("rt", prompt=48)  # 3 pages; 1 free
    plan = policy.plan([be_old, be_new, be_low, rt], budget(free_pages=1))
    assert plan.preempt == ["be_low"] and plan.order[0] == "rt"
    assert "be_low" not in plan.order
    # A waiting BE request only takes free pages, all its prompt's (vLLM admits a request
    # only where its whole sequence fits: a first chunk planned on 1 of its 4 was refused).
    views = [decoding("rt_run"), view("be_wait", BE, prompt=64)]
    plan = policy.plan(views, budget(free_pages=4))
    assert plan.preempt == [] and plan.order == ["rt_run", "be_wait"]
    for free in (3, 1, 0):
        plan = policy.plan(views, budget(free_pages=free))
        assert plan.preempt == [] and plan.order == ["rt_run"]


# --- Echo -----------------------------------------------------------------------------------

def test_echo_cuts_a_be_prefill_to_the_rt_slack_it_would_overrun() -> None:
    cost = token_cost(1e-4)
    rt = decoding("rt", arrival=0.0)  # next token due at 1.5 s
    doc = view("doc", BE, prompt=1000)  # 0.1 s of prefill: whole, it pushes the RT token late
    small = view("small", BE, prompt=100)  # 0.01 s: fits
    at = budget(now=1.45)
    plan = EchoPolicy(cost).plan([rt, doc, small], at)
    # The document computes the chunk that keeps the RT token on time (priced whole, it got
    # nothing, and the step's time went unused; found by a review).
    assert plan.order == ["rt", "small", "doc"]
    assert 300 <= plan.token_limits["doc"] <= 399  # (1 + 100 + 399) * 1e-4 s = 0.05 s


def test_echo_refuses_a_be_addition_whose_punishment_exceeds_its_benefit() -> None:
    rt = decoding("rt", arrival=0.0)  # due at 1.5 s
    bes = [decoding(f"be{i}", BE, arrival=i) for i in range(3)]  # a decode cannot be cut
    at = budget(now=1.475)  # 0.025 s: two requests of 0.01 s each fit, a third does not
    assert len(EchoPolicy(per_request_cost(0.01)).plan([rt, *bes], at).order) == 2
    # Priced below its benefit (a token), one late RT token is worth the BE decodes' tokens.
    cheap = EchoPolicy(per_request_cost(0.01), late_token_penalty=0.5).plan([rt, *bes], at)
    assert cheap.order == ["rt", "be0", "be1", "be2"]


def test_echo_evicts_the_cheapest_be_when_rt_needs_pages() -> None:
    big = view("be_big", BE, prompt=32, computed=160, output=129, running=True)  # 10 pages
    small = decoding("be_small", BE)  # 36 computed tokens, 3 pages
    rt = view("rt", prompt=48)  # 3 pages, 1 free
    plan = EchoPolicy(constant_cost(0.01)).plan([big, small, rt], budget(free_pages=1))
    assert plan.preempt == ["be_small"]
    assert plan.order == ["rt", "be_big"]


def test_echo_running_be_sits_out_rather_than_make_rt_late() -> None:
    rt = decoding("rt", arrival=0.0)  # due at 1.5 s
    bes = [decoding(f"be{i}", BE, arrival=i) for i in range(3)]
    plan = EchoPolicy(per_request_cost(0.01)).plan([rt, *bes], budget(now=1.475))
    assert plan.order[0] == "rt" and len(plan.order) == 2  # 0.02 s fits, 0.03 s does not
    assert plan.preempt == []  # sitting out keeps their pages


def test_echo_keeps_a_burst_headroom_for_rt() -> None:
    running = decoding("run", BE)
    fits = view("fits", BE, prompt=80 * PAGE)
    too_big = view("too_big", BE, prompt=88 * PAGE)
    at = StepBudget(now_s=0.0, max_num_seqs=8, max_num_tokens=4096, num_free_pages=100,
                    page_tokens=PAGE, num_total_pages=100)
    plan = EchoPolicy(constant_cost(0.01), headroom_fraction=0.1).plan(
        [running, too_big, fits], at)
    assert plan.order == ["run", "fits"]  # 88 pages would eat into the 10 kept for RT
    # An empty step ignores the headroom so BE work always progresses.
    plan = EchoPolicy(constant_cost(0.01), headroom_fraction=0.1).plan([too_big], at)
    assert plan.order == ["too_big"]


def test_echo_predicts_rt_bursts_from_recent_rt_pages() -> None:
    policy = EchoPolicy(constant_cost(0.01), headroom_fraction=0.0, burst_sigmas=2.0)
    at = StepBudget(now_s=0.0, max_num_seqs=8, max_num_tokens=2048, num_free_pages=500,
                    page_tokens=PAGE, num_total_pages=1000)
    rt_40_pages = [view("rt", prompt=40 * PAGE, computed=40 * PAGE, output=1, running=True)]
    for step in range(4):
        policy.headroom_pages(rt_40_pages if step % 2 else [], at)
    # RT pages seen: 0, 40, 0, 40, and 0 now: mean 16, std 19.6, so keep 56 pages free.
    assert policy.headroom_pages([], at) == 56


def test_echo_counts_the_pages_rt_turns_share_once() -> None:
    # Turns over one 60-page system prompt, 5 pages each of their own, 4 or 8 of them: RT
    # holds 80 or 100 pages (seen 80, 100, 80, 100, 80: mean 88, std 9.8, a 2-sigma burst of
    # 108, 28 pages more than now). Counted per turn, the prompt made the turns' pages 260 or
    # 520, and BE work was kept off 359 pages (found by a review).
    policy = EchoPolicy(constant_cost(0.01), headroom_fraction=0.0, burst_sigmas=2.0)
    at = StepBudget(now_s=0.0, max_num_seqs=8, max_num_tokens=2048, num_free_pages=2000,
                    page_tokens=PAGE, num_total_pages=3000)
    system = chain(*(f"p{i}" for i in range(65)))

    def turns(n: int) -> list[RequestView]:
        return [view(f"rt{i}", prompt=65 * PAGE, computed=65 * PAGE, output=1, running=True,
                     num_shared_pages=60, prefix_page_hashes=system[:60] + chain(
                         *(f"rt{i}-{j}" for j in range(5)))) for i in range(n)]

    for step in range(4):
        policy.headroom_pages(turns(8 if step % 2 else 4), at)
    assert policy.headroom_pages(turns(4), at) == 28


@pytest.mark.parametrize(("checkpoint_pages", "reserve"), [(None, 56), (1, 16)])
def test_echo_reserves_only_the_mean_rt_pages_where_evictions_are_checkpointed(
        checkpoint_pages: int | None, reserve: int) -> None:
    # Echo keeps two standard deviations because an evicted BE request recomputes; with
    # bidirectional blocks it is checkpointed (its view says what that would copy), and the
    # reserve is the mean.
    policy = EchoPolicy(constant_cost(0.01), headroom_fraction=0.0)
    at = StepBudget(now_s=0.0, max_num_seqs=8, max_num_tokens=2048, num_free_pages=500,
                    page_tokens=PAGE, num_total_pages=1000)
    be = decoding("be", BE, checkpoint_pages=checkpoint_pages)
    rt_40_pages = view("rt", prompt=40 * PAGE, computed=40 * PAGE, output=1, running=True)
    for step in range(4):
        policy.headroom_pages([be, rt_40_pages] if step % 2 else [be], at)
    assert policy.headroom_pages([be], at) == reserve


def test_echo_prefers_be_work_whose_prefix_is_resident() -> None:
    holder = view("holder", BE, prompt=64, computed=64, output=1, running=True,
                  prefix_page_hashes=chain("a", "b", "c", "d"))
    sharing = view("sharing", BE, arrival=5.0, prompt=80,
                   prefix_page_hashes=chain("a", "b", "c", "d", "e"))
    other = view("other", BE, arrival=0.0, prompt=80,
                 prefix_page_hashes=chain("v", "w", "x", "y", "z"))
    plan = EchoPolicy(token_cost(1e-4, 0.01)).plan([holder, other, sharing],
                                                   budget(max_seqs=2))
    assert plan.order == ["holder", "sharing"]


# --- LARRY ----------------------------------------------------------------------------------

def test_larry_puts_small_prompts_first_under_pressure() -> None:
    big = view("big", arrival=0.0, prompt=128)  # 8 pages, waited 30 s
    small = view("small", arrival=30.0, prompt=16)  # 1 page, just arrived
    policy = LarryPolicy(constant_cost(0.01))
    # Short queue: 2*8 - 30 < 2*1 - 0, first come first served.
    assert policy.plan([small, big], budget(now=30.0)).order == ["big", "small"]
    # Long queue (memory pressure): 20*8 - 30 > 20*1, the small prompt goes first.
    fillers = [view(f"f{i}", arrival=10.0, prompt=64) for i in range(18)]
    order = policy.plan([big, small, *fillers], budget(now=30.0)).order
    assert order.index("small") < order.index("big")
    assert not policy.plan([big, small], budget()).is_restrictive


def test_larry_promotes_a_starving_request() -> None:
    big = view("big", arrival=0.0, prompt=1008)  # 63 pages

    def order_at(now: float) -> list[str]:
        smalls = [view(f"s{i}", arrival=now - 1.0, prompt=16) for i in range(2)]  # fresh
        return LarryPolicy(constant_cost(0.01)).plan([*smalls, big], budget(now=now)).order

    assert order_at(100.0)[-1] == "big"  # 3*63 - 100 > 3*1 - 1
    assert order_at(300.0)[0] == "big"  # 3*63 - 300 < 3*1 - 1


def test_larry_keeps_rt_ahead_of_be_and_orders_running_rt_first() -> None:
    views = [decoding("be_run", BE, arrival=0.0), view("be_tiny", BE, prompt=1),
             view("rt_big", prompt=2000), decoding("rt_run", arrival=3.0)]
    plan = LarryPolicy(constant_cost(0.01)).plan(views, budget())
    assert plan.order == ["rt_run", "rt_big", "be_run", "be_tiny"]
    assert plan.preempt == []


# --- invariants of every registered policy --------------------------------------------------

COSTS: list[tuple[str, dict[str, float] | tuple[float, ...]]] = [
    ("hygen", {}), ("bros", BrosForm.prior), ("echo", EchoForm.prior),
    ("hygen", {"prefill_request_s": 0.05, "decode_request_s": 0.05}),
    ("hygen", {"prefill_token_s": 1e-3, "decode_request_s": 1e-3, "intercept_s": 0.01})]


@st.composite
def request_views(draw: st.DrawFn, index: int) -> RequestView:
    is_rt = draw(st.booleans())
    is_running = draw(st.booleans())
    prompt = draw(st.integers(2, 200))
    if is_running:
        output = draw(st.integers(0, 20))
        computed = prompt + output - 1 if output else draw(st.integers(1, prompt - 1))
    else:
        output, computed = draw(st.sampled_from([0, 0, 5])), 0
    num_pages = (prompt + output) // PAGE
    labels = draw(st.lists(st.sampled_from("ab"), min_size=num_pages, max_size=num_pages))
    slo = {"ttft_slo_s": draw(st.sampled_from([0.05, 1.0])),
           "tpot_slo_s": draw(st.sampled_from([0.01, 0.1]))} if is_rt else {}
    return RequestView(
        f"r{index}", RT if is_rt else BE, draw(st.floats(0.0, 10.0)), prompt, computed, output,
        is_running, priority=draw(st.integers(0, 2)), prefix_page_hashes=chain(*labels),
        num_restore_tokens=draw(st.sampled_from([0, 0, 40])), **slo)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[RequestView], StepBudget, CostModel]:
    views = with_shared_pages([draw(request_views(i)) for i in range(draw(st.integers(0, 12)))])
    step = StepBudget(now_s=draw(st.floats(0.0, 12.0)), max_num_seqs=draw(st.integers(1, 8)),
                      max_num_tokens=draw(st.integers(1, 300)),
                      num_free_pages=draw(st.integers(0, 40)), page_tokens=PAGE,
                      max_be_step_s=draw(st.sampled_from([math.inf, 0.5, 0.02])))
    return views, step, CostModel(*draw(st.sampled_from(COSTS)))


def with_shared_pages(views: list[RequestView]) -> list[RequestView]:
    """`views` with each running one's `num_shared_pages` as the scheduler counts them: its
    leading pages another running request holds too (equal hashes: the same page)."""
    def held(v: RequestView) -> tuple[bytes, ...]:
        return tuple(v.prefix_page_hashes[:v.num_computed_tokens // PAGE])
    holders = collections.Counter(h for v in views if v.is_running for h in held(v))
    out = []
    for v in views:
        if v.is_running:
            shared = next((i for i, h in enumerate(held(v)) if holders[h] < 2), len(held(v)))
            v = dataclasses.replace(v, num_shared_pages=shared, shared_page_holders=tuple(
                holders[h] for h in held(v)[:shared]))
        out.append(v)
    return out


def could_run(v: RequestView, step: StepBudget) -> bool:
    """`v` could compute its next chunk in free pages, preempting nothing, as vLLM admits it
    (a waiting request's whole sequence must fit)."""
    chunk = min(v.num_new_tokens, step.max_num_tokens)
    pages = new_pages(v, chunk, step.page_tokens)
    return admission_pages(v, pages, step.page_tokens) <= step.num_free_pages


@pytest.mark.parametrize("cost", COSTS)
def test_hygen_seats_the_next_turn_where_the_oldest_cannot_have_its_pages(
        cost: tuple[str, dict[str, float] | tuple[float, ...]]) -> None:
    """Only the first RT prefill in line was sure of `min_prefill_tokens`: where it could
    not have its pages even with every BE request preempted, the next one, alone in the
    step, got no token, and the BE decode was preempted for it all the same: an empty step
    (found by the property test below)."""
    views = [RequestView("r0", BE, 0.0, 2, 2, 1, True),
             RequestView("r1", RT, 0.0, 17, 0, 0, False, ttft_slo_s=0.05, tpot_slo_s=0.01),
             RequestView("r2", RT, 0.0, 2, 0, 0, False, ttft_slo_s=0.05, tpot_slo_s=0.01)]
    step = StepBudget(now_s=1.0, max_num_seqs=1, max_num_tokens=1, num_free_pages=0,
                      page_tokens=PAGE)
    plan = make_policy("hygen", CostModel(*cost)).plan(views, step)
    assert (plan.order, plan.preempt) == (["r2"], ["r0"])


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(scenario=scenarios())
def test_every_policy_keeps_the_plan_invariants(
        name: str, scenario: tuple[list[RequestView], StepBudget, CostModel]) -> None:
    views, step, cost = scenario
    by_id = {v.request_id: v for v in views}
    policy = make_policy(name, CostModel(cost.form, cost.coefficients))
    plan = policy.plan(views, step)

    assert len(set(plan.order)) == len(plan.order) and set(plan.order) <= by_id.keys()
    assert len(set(plan.preempt)) == len(plan.preempt) and set(plan.preempt) <= by_id.keys()
    assert not set(plan.order) & set(plan.preempt)
    if not getattr(policy, "block_preemption", True):
        for rid in plan.preempt:  # a running request that needed a page preempts itself
            v = by_id[rid]
            assert v.is_running and new_pages(v, v.num_new_tokens, step.page_tokens) > 0
    else:
        for rid in plan.preempt:  # only running BE work is ever preempted
            assert by_id[rid].is_running and not by_id[rid].is_rt
        if not any(v.is_rt for v in views):
            assert plan.preempt == []
    assert set(plan.token_limits) <= set(plan.order)
    assert all(1 <= n < by_id[rid].num_new_tokens
               or (n == by_id[rid].num_new_tokens and not by_id[rid].is_running)
               for rid, n in plan.token_limits.items())
    if plan.is_restrictive:  # a waiting request seated is capped at its chunk, whole or not
        assert all(rid in plan.token_limits for rid in plan.order if not by_id[rid].is_running)
    if plan.is_restrictive:
        assert len(plan.order) <= step.max_num_seqs
        if any(could_run(v, step) for v in views):
            assert plan.order, "a restrictive plan chose nothing although a request could run"

    # A waiting BE request never causes a preemption.
    without = [v for v in views if v.is_rt or v.is_running]
    fresh = make_policy(name, CostModel(cost.form, cost.coefficients))
    assert fresh.plan(without, step).preempt == plan.preempt


def test_plan_speed_over_500_views(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints each policy's planning time; asserts nothing about it (machines differ)."""
    rng = random.Random(0)
    views = []
    for i in range(500):
        is_running = i < 64
        prompt = rng.randint(64, 2000)
        output = rng.randint(1, 200) if is_running else 0
        labels = [rng.choice("abcd") for _ in range((prompt + output) // PAGE)]
        views.append(RequestView(
            f"r{i}", RT if i % 3 == 0 else BE, rng.uniform(0, 100), prompt,
            prompt + output - 1 if is_running else 0, output, is_running,
            ttft_slo_s=1.0 if i % 3 == 0 else None, tpot_slo_s=0.1 if i % 3 == 0 else None,
            prefix_page_hashes=chain(*labels)))
    step = StepBudget(now_s=100.0, max_num_seqs=256, max_num_tokens=8192,
                      num_free_pages=2000, page_tokens=PAGE)
    lines = []
    for name in sorted(POLICIES):
        policy = make_policy(name)
        samples = []
        for _ in range(20):
            started = time.perf_counter()
            policy.plan(views, step)
            samples.append(time.perf_counter() - started)
        per_100_ms = statistics.median(samples) * 1e3 / 5
        lines.append(f"{name}: {per_100_ms:.3f} ms per 100 views")
    with capsys.disabled():
        print("\nplan() over 500 views (median of 20): " + "; ".join(lines))


@pytest.mark.parametrize("name", ["hygen", "echo"])
def test_no_be_item_starts_on_the_pages_a_waiting_turn_waits_for(name: str) -> None:
    # A turn too long for the free pages held the turns behind it (FCFS), and a fresh BE
    # item took the pages a short turn behind it could have had (a review's simulation: 52
    # steps in two seeds; BROS holds BE admissions back so).
    views = [RequestView("decoding", RT, 0.0, 32, 36, 5, True, ttft_slo_s=1.0, tpot_slo_s=0.1),
             RequestView("long_turn", RT, 1.0, 2000, 0, 0, False, ttft_slo_s=1.0,
                         tpot_slo_s=0.1),  # 125 pages, 60 free
             RequestView("short_turn", RT, 2.0, 16, 0, 0, False, ttft_slo_s=1.0,
                         tpot_slo_s=0.1),
             RequestView("be_item", BE, 0.5, 16, 0, 0, False)]
    budget = StepBudget(now_s=2.0, max_num_seqs=64, max_num_tokens=4096, num_free_pages=60,
                        page_tokens=16)
    plan = make_policy(name, CostModel()).plan(views, budget)
    assert "decoding" in plan.order and "be_item" not in plan.order


def test_echo_cuts_an_rt_prefill_to_the_batch_slo_of_the_streams_seated_before_it() -> None:
    """Eq. 3's SLO is the least time any RT request in the batch is due in: a turn seated
    whole beside five streams due in 0.08 s made the step 0.51 s, and every stream late
    (found by a review). Its chunk keeps them on time; it still gets its TTFT floor."""
    cost = token_cost(0.00025, 0.01)
    now = 10.0
    streams = [view(f"d{i}", prompt=32, computed=36, output=5, running=True,
                    first_token_s=now - 0.42) for i in range(5)]  # next tokens due in 0.08 s
    turn = view("turn", arrival=now, prompt=2000)  # 1 s to its first token
    views = [turn, *streams]
    plan = EchoPolicy(cost).plan(views, budget(now=now))
    assert plan.order == [*(s.request_id for s in streams), "turn"]  # the streams first
    assert 0 < plan.token_limits["turn"] < 2000 and predicted_s(cost, views, plan) <= 0.08
    # a prompt the streams' room would leave too slow for its TTFT gets the chunk that
    # keeps it on time, past their room: RT streams and an RT turn weigh alike
    late = view("turn", arrival=now - 0.3, prompt=2000)  # 0.7 s: 6 steps of 0.1 s left
    plan = EchoPolicy(cost).plan([late, *streams], budget(now=now))
    assert plan.token_limits["turn"] >= 334  # 2000 over the steps left, not the streams' 275


def test_bros_chunks_the_first_rt_prefill_of_a_step_where_streams_wait_on_it() -> None:
    """Algorithm 1 compares every candidate with T_res, the first too: a turn come to the
    front of the slack order was seated whole (0.51 s) beside five streams due in 0.08 s,
    and each of them skipped that step (found by a review). Alone, it takes what it will."""
    cost = token_cost(0.00025, 0.01)
    now = 10.0
    turn = view("turn", arrival=now - 0.95, prompt=2000)  # 0.05 s to its first token
    streams = [view(f"d{i}", prompt=32, computed=36, output=5, running=True,
                    first_token_s=now - 0.42) for i in range(5)]
    plan = BrosPolicy(cost).plan([turn, *streams], budget(now=now))
    assert plan.order[0] == "turn" and predicted_s(cost, [turn, *streams], plan) <= 0.1 + 1e-9
    assert BrosPolicy(cost).plan([turn], budget(now=now)).token_limits == {"turn": 2000}  # alone


def test_bros_judges_a_prompt_that_misses_its_ttft_once_not_on_its_remainder() -> None:
    """A prompt too long to make its TTFT goes after the streams; judged on its remainder at
    each step, it came back to the front once that was short, by its long-missed deadline,
    and took whole steps from them (found by a review)."""
    cost = token_cost(0.00025, 0.01)
    now = 10.0
    streams = [view(f"d{i}", prompt=32, computed=36, output=5, running=True,
                    first_token_s=now - 0.42) for i in range(5)]
    policy = BrosPolicy(cost)
    for computed in (0, 4096, 6144):
        long = view("long", arrival=now - 3.0, prompt=8000, computed=computed,
                    running=computed > 0)
        plan = policy.plan([long, *streams], budget(now=now))
        assert plan.order == [*(s.request_id for s in streams), "long"], computed


def test_hygen_be_work_leaves_streams_behind_their_deadline_time_to_catch_up() -> None:
    """Streams due in less than L (a step ran over): BE chunks filled every step back to L
    and the streams stayed late for good (found by a review). BE work gets what their
    due time leaves."""
    cost = token_cost(0.00025, 0.01)
    now = 10.0
    streams = [view(f"d{i}", prompt=32, computed=36, output=5, running=True,
                    first_token_s=now - 0.42) for i in range(5)]  # due in 0.08 s, L 0.1 s
    doc = view("doc", BE, arrival=0.0, prompt=2000)
    plan = HygenPolicy(cost).plan([*streams, doc], budget(now=now))
    assert "doc" in plan.order and predicted_s(cost, [*streams, doc], plan) <= 0.08 + 1e-9


def test_hygen_cuts_a_lone_rt_prefill_to_the_budget_where_be_decodes_would_sit_out() -> None:
    """The first request of an empty step took all it wanted: a 4,000-token turn beside 40
    running BE decodes made a 0.52 s step they all sat out (found by a review). Alone, with
    no BE decode to keep waiting, it still takes the whole of it."""
    cost = token_cost(0.00025, 0.01)
    now = 10.0
    turn = view("turn", arrival=now, prompt=4000)
    decodes = [view(f"be{i}", BE, prompt=512, computed=520, output=9, running=True)
               for i in range(40)]
    plan = HygenPolicy(cost).plan([turn, *decodes], budget(now=now))
    assert predicted_s(cost, [turn, *decodes], plan) <= 0.1 + 1e-9
    assert HygenPolicy(cost).plan([turn], budget(now=now)).token_limits == {"turn": 2048}


def test_echo_be_prefills_go_on_while_rt_streams_are_behind_their_pace() -> None:
    """Streams behind their pace are due in one TPOT, which their own decodes overrun: a BE
    prefill cut to that got no token, and batch work stopped while RT was overloaded (found
    by a review). Tokens late already are not punished: it gets its chunk."""
    now = 100.0
    cost = CostModel("hygen", {"prefill_token_s": 1e-4, "decode_request_s": 0.015})
    streams = [view(f"s{i}", prompt=32, computed=36, output=5, running=True,
                    first_token_s=now - 5) for i in range(8)]  # 0.12 s of decodes, TPOT 0.1
    half = view("half", BE, prompt=1000, computed=496, running=True)
    plan = EchoPolicy(cost).plan([*streams, half], budget(now=now))
    assert "half" in plan.order
