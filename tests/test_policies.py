"""Scheduling policies driven by hand-built request views: no engine, no torch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from antiphon.engine_ext.costforms import HygenForm
from antiphon.engine_ext.costmodel import CostModel, StepShape
from antiphon.engine_ext.policies import make_policy, policy_class
from antiphon.engine_ext.policies.bros import BrosPolicy
from antiphon.engine_ext.policies.stepbatch import Victims
from antiphon.engine_ext.types import RequestClass
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan

RT, BE = RequestClass.RT, RequestClass.BE
PAGE = 16


def view(rid: str, cls: RequestClass = RT, *, arrival: float = 0.0, prompt: int = 32,
         computed: int = 0, output: int = 0, running: bool = False, **kw: object) -> RequestView:
    slo = {"ttft_slo_s": 1.0, "tpot_slo_s": 0.1} if cls is RT else {}
    return RequestView(rid, cls, arrival, prompt, computed, output, running,
                       **{**slo, **kw})  # type: ignore[arg-type]


def decoding(rid: str, cls: RequestClass = RT, **kw: object) -> RequestView:
    """A running request in its decode phase."""
    return view(rid, cls, prompt=32, computed=32 + 4, output=5, running=True, **kw)


def budget(now: float = 0.0, free_pages: int = 1000, max_seqs: int = 64) -> StepBudget:
    return StepBudget(now_s=now, max_num_seqs=max_seqs, max_num_tokens=2048,
                      num_free_pages=free_pages, page_tokens=PAGE)


def constant_cost(seconds: float) -> CostModel:
    return CostModel("hygen", {"intercept_s": seconds})


def per_request_cost(seconds: float) -> CostModel:
    return CostModel("hygen", {"prefill_request_s": seconds, "decode_request_s": seconds})


def test_unknown_policy_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="bros, bros_no_block_preemption, echo, fcfs, hygen, larry, priority"):
        policy_class("edf")
    assert make_policy("fcfs").plan([view("a")], budget()).order == []


def test_deadline_follows_ttft_then_tpot() -> None:
    v = view("a", arrival=10.0, output=3)
    assert v.deadline_s() == pytest.approx(10.0 + 1.0 + 3 * 0.1)
    assert v.slack_s(11.0) == pytest.approx(0.3)


def test_bros_orders_rt_by_slack_then_be() -> None:
    policy = BrosPolicy(constant_cost(0.01), base_batch_size=64)
    views = [view("be1", BE), view("late", arrival=0.5), view("urgent", arrival=0.0),
             decoding("be0", BE)]
    plan = policy.plan(views, budget(now=0.2))
    assert plan.order == ["urgent", "late", "be0", "be1"]  # running BE before waiting BE
    assert plan.is_restrictive and plan.preempt == []


def test_bros_keeps_step_within_the_most_urgent_slack() -> None:
    # 0.05 s per request; the urgent RT has 0.12 s of slack: it and one more fit.
    policy = BrosPolicy(per_request_cost(0.05), base_batch_size=64)
    views = [view("rt", arrival=0.0), view("be1", BE), view("be2", BE), view("be3", BE)]
    plan = policy.plan(views, budget(now=0.88))
    assert plan.order == ["rt", "be1"]
    assert policy.batch_size == policy.base_batch_size  # at risk: back off


def test_bros_without_rt_fills_the_batch_and_grows_it() -> None:
    policy = BrosPolicy(per_request_cost(1.0), base_batch_size=2)
    views = [view(f"be{i}", BE, arrival=i) for i in range(5)]
    assert policy.plan(views, budget()).order == ["be0", "be1"]
    assert policy.batch_size == 4
    assert policy.plan(views, budget()).order == ["be0", "be1", "be2", "be3"]


def test_rt_takes_pages_from_be_never_the_reverse() -> None:
    policy = BrosPolicy(constant_cost(0.01), base_batch_size=64)
    small_be = decoding("be_small", BE)  # holds 3 pages
    big_be = view("be_big", BE, prompt=32, computed=160, output=129, running=True)
    rt = view("rt", prompt=80)  # needs 5 pages: 1 free + 3 from be_small is not enough
    plan = policy.plan([big_be, small_be, rt], budget(free_pages=1))
    assert plan.preempt == ["be_small", "be_big"]  # fewest computed tokens first
    assert plan.order[0] == "rt"
    # A waiting BE request never preempts anything.
    plan = policy.plan([decoding("rt_run"), view("be_new", BE, prompt=64)],
                       budget(free_pages=1))
    assert plan.preempt == [] and "be_new" not in plan.order


def test_without_block_preemption_a_request_short_of_pages_recomputes_itself() -> None:
    # BROS's "No Bi-cache" ablation: "rt" needs a 4th page, none is free, and the running BE
    # request keeps its pages; "rt" is preempted instead of taking them.
    rt = view("rt", prompt=32, computed=48, output=17, running=True)
    be = decoding("be", BE)  # holds 3 pages, needs none
    plan = make_policy("bros_no_block_preemption", constant_cost(0.01)).plan(
        [rt, be], budget(free_pages=0))
    assert plan.preempt == ["rt"] and plan.order == ["be"]
    plan = BrosPolicy(constant_cost(0.01)).plan([rt, be], budget(free_pages=0))
    assert plan.preempt == ["be"] and plan.order == ["rt"]  # with it, BE gives way
    # A BE request short of pages is preempted too, and its pages serve the next request.
    be_at_edge = view("be_edge", BE, prompt=32, computed=48, output=17, running=True)
    waiting_be = view("be_new", BE, prompt=8)
    plan = make_policy("bros_no_block_preemption", constant_cost(0.01)).plan(
        [be_at_edge, waiting_be], budget(free_pages=0))
    assert plan.preempt == ["be_edge"] and plan.order == ["be_new"]
    # A waiting RT turn short of pages waits; nothing is preempted for it.
    plan = make_policy("bros_no_block_preemption", constant_cost(0.01)).plan(
        [view("rt_new", prompt=80), be], budget(free_pages=0))
    assert plan.preempt == [] and plan.order == ["be"]


def test_be_order_running_then_preempted_then_least_to_restore_then_arrival() -> None:
    """Preempted BE requests resume before fresh ones (by the paper's M_cpu alone, a
    checkpointed request waited behind every fresh one, for as long as a batch had items)."""
    policy = BrosPolicy(constant_cost(0.01), base_batch_size=64)
    views = [view("new", BE, arrival=3.0),
             view("restore_much", BE, num_restore_tokens=500, num_preemptions=1),
             view("recompute", BE, arrival=1.0, num_preemptions=1),
             view("restore_little", BE, num_restore_tokens=10, num_preemptions=2),
             view("stored_prefix", BE, num_restore_tokens=10, arrival=0.5),
             view("older", BE, arrival=2.0), decoding("running_be", BE)]
    assert policy.plan(views, budget()).order == [
        "running_be", "recompute", "restore_little", "restore_much", "older", "new",
        "stored_prefix"]


@pytest.mark.parametrize("name", ["bros", "echo"])
def test_fresh_be_work_stays_off_the_pages_a_resuming_request_waits_for(name: str) -> None:
    """Under memory pressure a fresh batch item took the free pages each step, and a
    preempted request resuming with its whole context (17 pages) never got in."""
    policy = make_policy(name, constant_cost(0.01))
    resumed = view("resumed", BE, prompt=256, computed=256, output=3, num_restore_tokens=256,
                   num_preemptions=1)
    running = view("running", BE, prompt=100, computed=110, output=11, running=True)
    plan = policy.plan([resumed, running, view("fresh", BE, prompt=32, arrival=1.0)],
                       budget(free_pages=10))
    assert plan.order == ["running"]  # its 7 pages free when it ends
    # with nothing running to free pages, the fresh item does start
    plan = policy.plan([resumed, view("fresh", BE, prompt=32, arrival=1.0)],
                       budget(free_pages=10))
    assert plan.order == ["fresh"]


def test_echo_resumes_a_preempted_be_request_before_fresh_ones() -> None:
    """Ranked with fresh requests by tokens per second, a resumed request with one token
    left to compute came last, and a batch's fresh items kept it waiting."""
    cost = CostModel("hygen", {"prefill_token_s": 1e-4, "prefill_request_s": 5e-3,
                               "decode_request_s": 1e-3, "intercept_s": 0.01})
    views = [view("fresh", BE, prompt=64), view("later", BE, prompt=64, arrival=1.0),
             view("resumed", BE, prompt=256, computed=258, output=3, num_restore_tokens=258,
                  num_preemptions=1)]
    plan = make_policy("echo", cost).plan(views, budget(max_seqs=2))
    assert plan.order == ["resumed", "fresh"]


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_a_turn_over_pages_running_requests_hold_preempts_only_for_its_own(name: str) -> None:
    """A turn whose 4-page system prompt a running turn holds needs one page: counted as 5,
    BE work was preempted for pages it did not need (5 requests for 1 page)."""
    turn = view("r1", prompt=70, computed=64, num_shared_pages=4)
    bes = [view(f"b{i}", BE, prompt=8, computed=10, output=3, running=True)
           for i in range(7)]
    r0 = view("r0", prompt=64, computed=74, output=11, running=True)
    plan = make_policy(name, constant_cost(0.01)).plan([r0, turn, *bes], budget(free_pages=0))
    assert "r1" in plan.order and len(plan.preempt) == 1, plan


def test_a_victim_gives_back_only_the_pages_no_other_request_holds() -> None:
    """Two BE requests over one document: preempting one frees its own page, not the four
    the other still holds (counted as freed, the plan seated a turn on them)."""
    shared = [view(f"b{i}", BE, prompt=66, computed=67, output=2, running=True,
                   num_shared_pages=4) for i in (1, 2)]
    plan = make_policy("bros", constant_cost(0.01)).plan(
        [*shared, view("r", prompt=40)], budget(free_pages=1))  # the turn needs 3 pages
    assert sorted(plan.preempt) == ["b1", "b2"] and "r" in plan.order, plan


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_a_victims_pages_a_waiting_turn_reuses_are_not_counted_freed(name: str) -> None:
    """A BE item holds a document's 4 pages alone, and a waiting turn over the document
    counts them as held. Preempted, the item's pages go to the prefix cache, where the turn's
    admission takes them from the free pages: counted freed too (1 + 5 = 6 free against the
    4 new the turn counted), the item was preempted and vLLM refused the turn (it needs 8)."""
    doc = [bytes([i]) for i in range(4)]
    item = view("b", BE, prompt=66, computed=67, output=2, running=True,
                prefix_page_hashes=doc)
    turn = view("w", prompt=120, num_shared_pages=4, prefix_page_hashes=doc)
    plan = make_policy(name, constant_cost(0.01)).plan([item, turn], budget(free_pages=1))
    assert not ("w" in plan.order and plan.preempt == ["b"]), plan
    plan = make_policy(name, constant_cost(0.01)).plan([item, turn], budget(free_pages=3))
    assert "w" in plan.order and plan.preempt == ["b"], plan  # 3 + 1 + 4 taken back: 8


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_a_victim_is_charged_only_for_reused_pages_it_computed(name: str) -> None:
    """A BE item has computed 1 page of a 10-page document an RT stream holds, and a turn
    over the document waits: the item's hashes cover its whole prompt, and it was charged
    for all 10 pages the turn reuses (freeing -9), so the turn waited though preempting
    the other item freed its 10 pages."""
    doc = [bytes([i]) for i in range(10)]
    stream = view("x", prompt=160, computed=161, output=2, running=True, first_token_s=0.0,
                  prefix_page_hashes=doc)
    item = view("b1", BE, arrival=2.0, prompt=170, computed=PAGE, running=True,
                prefix_page_hashes=doc)
    other = view("b2", BE, arrival=1.0, prompt=150, computed=160, output=10, running=True,
                 prefix_page_hashes=[bytes([100 + i]) for i in range(10)])
    turn = view("w", prompt=190, num_shared_pages=10, prefix_page_hashes=doc)  # 2 new pages
    plan = make_policy(name, constant_cost(0.01)).plan([stream, item, other, turn],
                                                       budget(free_pages=0))
    assert "w" in plan.order, plan
    victims = Victims([item], PAGE, kept=[turn])
    assert victims.num_pages == 0  # its one page, which the turn takes back


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_running_work_seated_after_a_chunked_admission_leaves_it_its_pages(name: str) -> None:
    """vLLM runs the running requests before it admits a waiting one, and admits it only
    where its whole sequence fits: BE decodes seated after a turn whose first chunk the step
    time cut took the pages its admission needed, and vLLM refused it."""
    cost = CostModel("hygen", {"intercept_s": 0.02, "prefill_token_s": 1e-3,
                               "decode_request_s": 1e-3})
    items = [view(f"b{i}", BE, prompt=31, computed=32, output=2, running=True)
             for i in range(3)]  # each decode needs a new page
    turn = view("r", prompt=400)  # 25 pages
    stream = view("s", prompt=32, computed=40, output=9, running=True, first_token_s=0.0)
    plan = make_policy(name, cost).plan([stream, *items, turn], budget(now=0.0, free_pages=26))
    assert "r" in plan.order, plan
    decodes = sum(1 for v in items if v.request_id in plan.order)
    assert decodes + 25 <= 26, plan


def test_cost_model_learns_a_linear_step_time() -> None:
    rng = np.random.default_rng(0)
    form = HygenForm()
    truth = (1e-4, 2e-8, 1e-9, 0.0, 3e-4, 1e-4, 0.01)
    model = CostModel("hygen", refit_every=16)
    for _ in range(200):
        reqs = [(int(rng.integers(1, 300)), int(rng.integers(1, 2000)))
                for _ in range(int(rng.integers(1, 16)))]
        shape = StepShape.of(reqs)
        model.observe(shape, form.predict_s(truth, shape))
    assert model.num_refits > 0
    probe = StepShape.of([(100, 1000), (1, 500)])
    assert model.predict_s(probe) == pytest.approx(form.predict_s(truth, probe), rel=1e-3)
    assert model.mape is not None and model.mape < 0.5


def test_views_are_plain_data() -> None:
    v = view("a")
    assert dataclasses.asdict(v)["request_class"] is RT
    assert v.is_prefill and v.num_new_tokens == 32
    d = decoding("b")
    assert not d.is_prefill and d.num_new_tokens == 1


def test_a_late_rt_request_does_not_limit_the_step_to_itself() -> None:
    # "late" missed its deadline 5 s ago; the others must still be served in the same step.
    policy = BrosPolicy(per_request_cost(0.01), base_batch_size=64)
    views = [view("late", arrival=0.0), decoding("rt_on_time", arrival=9.5), view("be", BE)]
    plan = policy.plan(views, budget(now=6.0 + 0.5))
    assert plan.order == ["late", "rt_on_time", "be"]  # by deadline, all in the step


def test_bros_keeps_every_late_decode_in_the_step() -> None:
    # 16 streams whose tokens are all late (0.02 s a request: 0.32 s a step against a 0.1 s
    # TPOT). Cutting the step to the limit would serve 5 and make the rest skip it.
    policy = BrosPolicy(per_request_cost(0.02), base_batch_size=64)
    late = [dataclasses.replace(decoding(f"rt{i}"), first_token_s=0.0) for i in range(16)]
    assert len(policy.plan(late, budget(now=10.0)).order) == 16
    # Streams still on time (next token due in 0.1 s) get the limit: 5 fit, 11 wait.
    on_time = [dataclasses.replace(decoding(f"ok{i}"), first_token_s=9.6) for i in range(16)]
    assert len(policy.plan(on_time, budget(now=10.0)).order) == 5  # slack 0.1 s: 5 fit


def test_tokens_after_the_first_are_due_at_its_time_plus_tpot_each() -> None:
    late = dataclasses.replace(view("a", arrival=10.0, output=1), first_token_s=13.0)
    assert late.deadline_s() == pytest.approx(13.0 + 0.1)  # not 2 s ago
    early = dataclasses.replace(view("b", arrival=10.0, output=2), first_token_s=10.5)
    assert early.deadline_s() == pytest.approx(10.5 + 2 * 0.1)  # no credit from the TTFT


def test_bros_chunks_an_rt_prefill_that_does_not_fit_instead_of_waiting() -> None:
    # 10 ms a step plus 1 ms a prefill token; four decodes with 0.05 s of slack limit the step
    # to 0.1 s (the TPOT floor), so the 300-token prompt does not fit. It must not wait: it
    # gets at least its prompt spread over the steps left before its TTFT (0.9 s: 8 steps).
    cost = CostModel("hygen", {"intercept_s": 0.01, "prefill_token_s": 0.001})
    policy = BrosPolicy(cost, base_batch_size=64)
    now = 10.0
    decodes = [decoding(f"d{i}", arrival=now - 1.45)
               for i in range(4)]
    new = view("new", arrival=now - 0.1, prompt=300)
    plan = policy.plan([*decodes, new], budget(now=now))
    assert plan.order[:4] == [d.request_id for d in decodes]
    assert plan.order[4] == "new"
    assert -(-300 // 8) <= plan.token_limits["new"] < 300


def test_bros_does_not_let_a_prompt_too_long_for_its_ttft_stall_the_others() -> None:
    # 2,000 tokens at 1 ms each cannot make a 1 s TTFT: it takes what fits the step, not all.
    cost = CostModel("hygen", {"intercept_s": 0.01, "prefill_token_s": 0.001})
    policy = BrosPolicy(cost, base_batch_size=64)
    now = 10.0
    decodes = [decoding(f"d{i}", arrival=now - 1.45) for i in range(4)]
    plan = policy.plan([*decodes, view("long", arrival=now - 0.1, prompt=2000)],
                       budget(now=now))
    assert plan.order[4] == "long"
    assert plan.token_limits["long"] <= 100  # within the 0.1 s step


def test_policies_plan_with_steps_calibrated_to_what_was_measured() -> None:
    model = CostModel("hygen", {"intercept_s": 0.1}, refit_every=10**9)  # the fit stays
    shape = StepShape.of([(1, 10)])
    assert model.planning_s(shape) == pytest.approx(0.1)
    for i in range(64):  # steps ran 10-40% over the prediction
        model.observe(shape, 0.1 * (1.1 + 0.1 * (i % 4)))
    assert model.predict_s(shape) == pytest.approx(0.1)
    assert model.calibration == pytest.approx(1.4)  # 4 in 5 steps fit the planned time
    assert model.planning_s(shape) == pytest.approx(0.14)
    for _ in range(64):  # faster than predicted: no discount
        model.observe(shape, 0.05)
    assert model.calibration == 1.0


def test_bros_serves_turns_that_can_make_their_ttft_before_one_that_cannot() -> None:
    cost = CostModel("hygen", {"intercept_s": 0.01, "prefill_token_s": 0.001})
    policy = BrosPolicy(cost, base_batch_size=64)
    now = 10.0
    hopeless = view("long", arrival=now - 0.5, prompt=1500)  # 1.5 s of prefill, 0.5 s left
    feasible = view("short", arrival=now - 0.1, prompt=100)
    plan = policy.plan([hopeless, feasible], budget(now=now))
    assert plan.order == ["short", "long"]


def test_bros_ranks_a_stream_preempted_by_recompute_by_its_next_tokens_deadline() -> None:
    # Preempted after 40 tokens, it prefills its 3,000-token context again: that took it
    # for a prompt that cannot make its TTFT, behind a fresh turn, 16 tokens a step.
    cost = CostModel("hygen", {"prefill_token_s": 1e-3, "decode_request_s": 0.01,
                               "intercept_s": 0.01})
    now = 100.0
    resumed = view("resumed", arrival=90.0, prompt=3000, output=40, first_token_s=91.0,
                   num_preemptions=1)  # its next token was due at 95 s
    streams = [decoding(f"d{i}", arrival=99.0, first_token_s=99.5) for i in range(6)]
    fresh = view("fresh", arrival=99.9, prompt=200)
    plan = BrosPolicy(cost).plan([resumed, *streams, fresh], budget(now=now))
    assert plan.order[0] == "resumed"


def test_bros_keeps_a_late_turn_ahead_of_newer_ones() -> None:
    # Both prompts fit their TTFT alone; "old" is late only because it waited.
    policy = BrosPolicy(per_request_cost(0.01), base_batch_size=64)
    plan = policy.plan([view("new", arrival=9.9), view("old", arrival=5.0)], budget(now=10.0))
    assert plan.order == ["old", "new"]


@pytest.mark.parametrize("name", ["bros", "hygen"])
def test_a_chunked_admission_preempts_for_the_whole_prompt(name: str) -> None:
    """vLLM admits a waiting request only where its whole sequence fits the free pages
    (`scheduler_reserve_full_isl`, on by default): planned with its first chunk's pages
    alone, a 30-page turn with 20 pages free was refused by vLLM step after step while the BE
    work holding 18 ran on."""
    cost = CostModel("hygen", {"prefill_token_s": 1e-3, "decode_request_s": 0.01,
                               "intercept_s": 0.02})
    streams = [decoding(f"d{i}", first_token_s=99.95, arrival=98.0) for i in range(4)]
    bes = [view(f"be{i}", BE, prompt=80, computed=84, output=5, running=True) for i in range(3)]
    turn = view("turn", prompt=16 * 30, arrival=99.9, ttft_slo_s=3.0)
    plan = make_policy(name, cost).plan([*streams, *bes, turn], budget(now=100.0,
                                                                        free_pages=20))
    assert "turn" in plan.order
    assert 20 + 6 * len(plan.preempt) >= 30, plan  # each BE request frees its 6 pages


def test_a_turn_waiting_for_pages_is_not_overtaken_by_smaller_ones() -> None:
    # 2 free pages: "follow_up" (earliest deadline) needs 5, "fresh" 1. Fresh would take the
    # page the follow-up waits for; the running decode still runs.
    policy = BrosPolicy(constant_cost(0.01), base_batch_size=64)
    views = [view("follow_up", arrival=0.0, prompt=80), view("fresh", arrival=0.5, prompt=8),
             decoding("running", arrival=0.9), view("be", BE, prompt=8)]
    plan = policy.plan(views, budget(now=1.0, free_pages=2))
    assert plan.order == ["running"]  # nor does the BE request start
    # With the pages free, both get in, the follow-up first.
    assert policy.plan(views, budget(now=1.0, free_pages=8)).order == [
        "follow_up", "fresh", "running", "be"]


def test_with_nothing_running_a_turn_short_of_pages_holds_nobody_back() -> None:
    # No running request will free a page for "follow_up": holding "fresh" and the BE request
    # back would stall the engine (found by the plan-invariant property test).
    policy = BrosPolicy(constant_cost(0.01), base_batch_size=64)
    views = [view("follow_up", arrival=0.0, prompt=80), view("fresh", arrival=0.5, prompt=8),
             view("be", BE, prompt=8)]
    assert policy.plan(views, budget(now=1.0, free_pages=2)).order == ["fresh", "be"]


# -- review: RT tokens that BE work delayed -----------------------------------------------------

SLO = {"ttft_slo_s": 1.0, "tpot_slo_s": 0.1}
LINEAR = {"intercept_s": 0.01, "prefill_token_s": 5e-4, "decode_request_s": 1e-3}


def _stream(rid: str, now: float, slack: float, prompt: int = 32) -> RequestView:
    """A decoding RT stream whose next token is due `slack` seconds from `now`."""
    return RequestView(rid, RT, now - 2.0, prompt, prompt + 4, 5, True,
                       first_token_s=now + slack - 0.5, **SLO)  # type: ignore[arg-type]


def _planned_s(cost: CostModel, plan_views: list[RequestView], limits: dict[str, int]) -> float:
    shape = StepShape()
    for v in plan_views:
        new = limits.get(v.request_id, v.num_new_tokens)
        shape = shape.plus(new, v.num_computed_tokens + new, v.is_prefill)
    return cost.planning_s(shape)


@pytest.mark.parametrize("name", ["bros", "echo"])
def test_be_work_does_not_stretch_the_step_of_a_late_rt_token(name: str) -> None:
    """bros sized BE work to the one positive slack left (a new turn's TTFT, 0.7 s) once an
    RT token was late; echo counted no punishment for a token already late. Either way the
    late stream waited the whole BE chunk. A late token now counts as due one TPOT away."""
    now, cost = 10.0, CostModel("hygen", LINEAR)
    late = _stream("late", now, slack=-0.05)
    fresh = view("fresh", arrival=now - 0.3, prompt=40)
    doc = view("doc", BE, prompt=5000)
    for views in ([late, doc], [late, fresh, doc]):
        plan = make_policy(name, cost).plan(views, budget(now=now))
        chosen = [v for v in views if v.request_id in plan.order]
        assert _planned_s(cost, chosen, plan.token_limits) <= 0.1 + 1e-9


def test_bros_keeps_be_work_within_an_on_time_token_due_before_the_tpot_floor() -> None:
    now, cost = 10.0, CostModel("hygen", LINEAR)
    soon = _stream("soon", now, slack=0.03)
    doc = view("doc", BE, prompt=500)
    plan = make_policy("bros", cost).plan([soon, doc], budget(now=now))
    chosen = [v for v in (soon, doc) if v.request_id in plan.order]
    assert _planned_s(cost, chosen, plan.token_limits) <= 0.03 + 1e-9


def test_bros_tries_the_rt_requests_behind_an_on_time_decode_that_does_not_fit() -> None:
    """The paper stops packing RT at the first that does not fit the step; BE work then took
    the time a waiting turn behind it could have used."""
    now = 10.0
    cost = CostModel("hygen", {**LINEAR, "decode_context_s": 1e-5})
    urgent = _stream("urgent", now, slack=0.1)
    long_context = _stream("long", now, slack=0.3, prompt=10000)
    turn = view("turn", arrival=now - 0.05, prompt=64)
    plan = make_policy("bros", cost).plan([urgent, long_context, turn, view("doc", BE, prompt=500)],
                                          budget(now=now))
    assert plan.order[:2] == ["urgent", "turn"] and "long" not in plan.order


@pytest.mark.parametrize("name", ["bros", "hygen", "echo"])
def test_rt_takes_pages_only_be_requests_share(name: str) -> None:
    # Two batch items over one 4-page document hold 5 pages each, 4 of them shared: preempting
    # both frees 6 pages, though each alone frees 1. A turn needing 4 pages, 1 free, gets in.
    doc = [bytes([i]) for i in range(4)]

    def items(holders: int) -> list[RequestView]:
        return [view(f"b{i}", BE, prompt=66, computed=67, output=2, running=True,
                     num_shared_pages=4, shared_page_holders=(holders,) * 4,
                     prefix_page_hashes=doc) for i in (1, 2)]

    def plan(*views: RequestView) -> StepPlan:
        return make_policy(name, constant_cost(0.01)).plan(views, budget(free_pages=1))

    turn = view("r", prompt=56)
    got = plan(*items(2), turn)
    assert "r" in got.order and sorted(got.preempt) == ["b1", "b2"], got
    # A third holder keeps those pages: a running turn over the document, or a finished
    # request whose pages are being saved (no view): preempting both items frees 2.
    running = view("t", prompt=66, computed=66, output=1, running=True, num_shared_pages=4,
                   shared_page_holders=(3,) * 4, prefix_page_hashes=doc)
    for views in ((*items(3), running, turn), (*items(3), turn), (items(2)[0], turn)):
        got = plan(*views)
        assert "r" not in got.order and got.preempt == [], got
    # A waiting turn over the document counts its pages as held: freed, its admission would
    # take them back (1 free page and the items' 2 own ones for its 4 new pages).
    over_doc = view("w", prompt=120, num_shared_pages=4, prefix_page_hashes=doc)
    got = plan(*items(2), over_doc)
    assert "w" not in got.order and got.preempt == [], got


@pytest.mark.parametrize("name", ["bros", "echo", "hygen"])
def test_running_rt_prefill_takes_the_chunk_the_pages_allow(name: str) -> None:
    # Two turns mid-prefill need 5 more pages each; 1 page is free and a decoding batch item
    # holds 3. Left out for want of all 5, they waited while the item, needing no new page,
    # ran every step (the engine never stalled, so vLLM's own preemption never came).
    turns = [view(t, prompt=200, computed=128, running=True, arrival=i * 0.1)
             for i, t in enumerate("AB")]
    item = view("C", BE, prompt=32, computed=36, output=5, running=True)
    plan = make_policy(name, constant_cost(0.01)).plan([*turns, item], budget(free_pages=1))
    assert plan.order[:1] == ["A"] and plan.preempt == ["C"], plan
    assert plan.token_limits["A"] == 4 * PAGE, plan


def test_echo_admits_a_turn_only_where_its_whole_prompt_fits() -> None:
    # A 3,000-token prompt (188 pages) under a 2,048-token step budget: its first chunk needs
    # 128 pages, but vLLM admits it only with all 188 free (`scheduler_reserve_full_isl`).
    items = [view(f"b{i}", BE, prompt=16 * 30, computed=16 * 30 + 1, output=2, running=True)
             for i in range(2)]
    tight = StepBudget(now_s=0.0, max_num_seqs=64, max_num_tokens=2048, num_free_pages=130,
                       page_tokens=PAGE)
    turn = view("r", prompt=3000)
    plan = make_policy("echo", constant_cost(0.01)).plan([*items, turn], tight)
    assert "r" in plan.order and len(plan.preempt) == 2, plan  # 130 + 2 * 31 >= 188
    plan = make_policy("echo", constant_cost(0.01)).plan([items[0], turn], tight)
    assert "r" not in plan.order and plan.preempt == [], plan  # 161 < 188: no item preempted


def test_hygen_seats_a_late_long_context_decode_past_the_budget() -> None:
    # 20 ms a step, 15 ms a decode, 1 us a context token; L = TPOT = 0.1 s. Four streams fill
    # 80 ms; a 9,000-token stream's decode (24 ms) does not fit beside them, a short BE
    # decode (15 ms) does. Left out every step, the long stream waited for the four to end.
    cost = CostModel("hygen", {"intercept_s": 0.02, "decode_request_s": 0.015,
                               "decode_context_s": 1e-6})
    streams = [view(f"rt{i}", prompt=32, computed=40, output=9, running=True,
                    arrival=90.0 + i, first_token_s=99.95) for i in range(4)]
    long_one = view("long", prompt=9000, computed=9010, output=11, running=True,
                    arrival=95.0, first_token_s=99.0)  # its next token was due at 100.1
    item = view("be", BE, prompt=32, computed=36, output=5, running=True)
    plan = make_policy("hygen", cost).plan([*streams, long_one, item], budget(now=99.5))
    assert "long" not in plan.order and "be" in plan.order, plan  # 0.6 s to go: it waits
    plan = make_policy("hygen", cost).plan([*streams, long_one, item], budget(now=100.2))
    assert "long" in plan.order and "be" not in plan.order, plan  # late: it goes in
