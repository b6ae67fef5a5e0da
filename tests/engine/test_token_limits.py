"""A policy's plans as vLLM's own scheduler applies them, without a model run: per-request
chunks, seats kept by requests that sit a step out, and the cost model fed each step's own
shape when vLLM schedules a step ahead (async scheduling)."""

from __future__ import annotations

import time
import types
from collections.abc import Sequence

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from antiphon.engine_ext.config import SchedulerSettings
from antiphon.engine_ext.policies.base import Policy, freed_pages, new_pages
from antiphon.engine_ext.policies.stepbatch import Victims
from antiphon.engine_ext.policies.stock import FcfsPolicy, PriorityPolicy
from antiphon.engine_ext.scheduler import AntiphonAsyncScheduler, AntiphonScheduler
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan
from antiphon.model import resolve_model

pytestmark = pytest.mark.engine

PAGE = 16
init_none_hash(sha256)
_block_hasher = get_request_block_hasher(PAGE, sha256)


class ScriptedPlans(Policy):
    """Returns the plans it is given, one a step."""

    name = "scripted"

    def __init__(self, plans: list[StepPlan]) -> None:
        self.plans = plans

    def plan(self, views: Sequence[RequestView], budget: StepBudget) -> StepPlan:
        return self.plans.pop(0)


def scheduler(plans: list[StepPlan], max_num_seqs: int = 16,
              cls: type[AntiphonScheduler] = AntiphonScheduler,
              settings: SchedulerSettings | None = None,
              prefix_caching: bool = False) -> AntiphonScheduler:
    """vLLM's scheduler as the engine builds it (100 pages of 16 tokens, 2,048 tokens a step),
    with `plans` for its policy; no engine, no model weights loaded."""
    model = ModelConfig(model=str(resolve_model(None)), dtype="float32", max_model_len=2048)
    config = VllmConfig(
        model_config=model, device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=PAGE, enable_prefix_caching=prefix_caching),
        additional_config={} if settings is None else settings.to_additional_config())
    config.cache_config.num_gpu_blocks = 100
    pages = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=PAGE, num_kv_heads=1,
                                                      head_size=8, dtype=torch.float32))])
    sched = cls(vllm_config=config, kv_cache_config=pages,
                              structured_output_manager=StructuredOutputManager(config),
                              block_size=PAGE)
    sched.step_policy = ScriptedPlans(plans)
    return sched


def request(rid: str, num_prompt_tokens: int | list[int], request_class: str = "rt",
            max_tokens: int = 8) -> Request:
    """A request of `num_prompt_tokens` tokens (1, 2, ...), or of the tokens given; with the
    page hashes prefix caching needs."""
    tokens = (num_prompt_tokens if isinstance(num_prompt_tokens, list)
              else list(range(1, num_prompt_tokens + 1)))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens,
                                               extra_args={"antiphon_class": request_class}),
                   None, block_hasher=_block_hasher)


def finish_step(sched: AntiphonScheduler, output: SchedulerOutput) -> None:
    """The model's output for `output`: one token for each request at the end of its
    prompt (none for a request finished meanwhile)."""
    ids = list(output.num_scheduled_tokens)
    requests = [sched.requests.get(rid) for rid in ids]
    sampled = [[7] if r is not None and r.num_computed_tokens >= r.num_tokens else []
               for r in requests]
    sched.update_from_output(output, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=sampled))


def scheduled(output: SchedulerOutput) -> dict[str, int]:
    return dict(output.num_scheduled_tokens)


def test_each_request_gets_its_planned_chunk_wherever_it_stands_in_the_order() -> None:
    # A limited request ahead of unlimited ones must not take their tokens: vLLM fills
    # requests in order, so a cap on the step's total alone gave the first all of it.
    sched = scheduler([
        StepPlan(order=["a", "b"], is_restrictive=True, token_limits={"a": 10}),
        StepPlan(order=["a", "c"], is_restrictive=True, token_limits={"a": 5}),
    ])
    sched.add_request(request("a", 100))
    sched.add_request(request("b", 50))
    assert scheduled(sched.schedule()) == {"a": 10, "b": 50}  # waiting requests
    sched.add_request(request("c", 30))
    # running "a" is capped; "b" sits the step out; waiting "c" gets all it wants
    assert scheduled(sched.schedule()) == {"a": 5, "c": 30}


def test_requests_sitting_out_keep_their_seats_and_rt_takes_one_from_be() -> None:
    # Two seats, both BE requests decoding. The plan seats one of them and an RT arrival:
    # the other sits the step out, still holding its seat and pages. vLLM counted only the
    # requests in its queue, so it seated the RT turn beside both (3 running of 2), and its
    # next step of its own asserted and took the engine core down.
    sched = scheduler([StepPlan(order=["b1", "b2"], is_restrictive=True)] * 2 + [
        StepPlan(order=["r", "b1"], is_restrictive=True),
        StepPlan(order=["b1", "b2"], is_restrictive=True),
    ], max_num_seqs=2)
    sched.add_request(request("b1", 20, "be"))
    sched.add_request(request("b2", 20, "be"))
    for _ in range(2):
        finish_step(sched, sched.schedule())
    sched.add_request(request("r", 20))
    output = sched.schedule()
    assert scheduled(output) == {"r": 20, "b1": 1}
    assert len(sched.running) == 2  # b2 gave its seat to the RT turn (preempted)
    assert sched.stats.seat_preemptions == 1
    assert sched.requests["b2"].num_preemptions == 1
    finish_step(sched, output)
    # a BE request the plan admits gets no seat held by another
    sched.step_policy = ScriptedPlans([StepPlan(order=["b2", "b1"], is_restrictive=True)])
    assert "b2" not in scheduled(sched.schedule())
    assert len(sched.running) == 2


def test_an_rt_turn_takes_the_seat_of_be_work_the_plan_runs_when_none_sits_out() -> None:
    # Two seats: an RT stream on time sits the step out (keeping its seat) and a BE request
    # decodes in the other. An urgent RT arrival the plan runs got no seat: only BE requests
    # sitting out gave theirs, and the BE work ran while the RT turn waited.
    sched = scheduler([StepPlan(order=["r1", "b"], is_restrictive=True)] * 2 + [
        StepPlan(order=["r2", "b"], is_restrictive=True)], max_num_seqs=2)
    sched.add_request(request("r1", 20))
    sched.add_request(request("b", 20, "be"))
    for _ in range(2):
        finish_step(sched, sched.schedule())
    sched.add_request(request("r2", 20))
    assert scheduled(sched.schedule()) == {"r2": 20}
    assert {r.request_id for r in sched.running} == {"r1", "r2"}
    assert sched.stats.seat_preemptions == 1 and sched.requests["b"].num_preemptions == 1


def test_an_rt_turn_vllm_skips_takes_no_seat_and_is_in_no_view() -> None:
    # An RT turn whose response_format grammar still compiles is skipped by vLLM: a BE
    # request was preempted for its seat, and the turn did not run.
    sched = scheduler([StepPlan(order=["b1", "b2"], is_restrictive=True)] * 2 + [
        StepPlan(order=["r", "b1"], is_restrictive=True)], max_num_seqs=2)
    sched.add_request(request("b1", 20, "be"))
    sched.add_request(request("b2", 20, "be"))
    for _ in range(2):
        finish_step(sched, sched.schedule())
    turn = request("r", 20)
    sched.add_request(turn)
    turn.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    turn.structured_output_request = types.SimpleNamespace(grammar=None)  # compiling
    assert [v.request_id for v in sched._views()] == ["b1", "b2"]
    assert scheduled(sched.schedule()) == {"b1": 1}
    assert sched.stats.seat_preemptions == 0 and sched.requests["b2"].num_preemptions == 0
    assert [r.request_id for r in sched.waiting] == ["r"]
    turn.structured_output_request.grammar = object()  # compiled: vLLM admits it now
    assert "r" in [v.request_id for v in sched._views()]


def test_reset_counters_zeroes_the_bidirectional_blocks_counters_too() -> None:
    # The server resets the counters after the start-up profile; the shared blocks' (pages
    # placed, collisions) kept the profile's in /metrics.
    sched = scheduler([StepPlan(order=["a"])] * 3,
                      settings=SchedulerSettings(policy="fcfs", biblocks=True))
    sched.add_request(request("a", 40))
    for _ in range(3):
        finish_step(sched, sched.schedule())
    assert sched.antiphon_stats()["biblocks"]["pages_placed"] > 0
    sched.reset_counters()
    assert sched.antiphon_stats()["biblocks"]["pages_placed"] == 0


def test_views_count_the_pages_running_requests_share() -> None:
    # A turn over the system prompt a running one holds allocates only its own pages, and a
    # preemption of one of two requests over one document gives back only its own: counted
    # as new and as freed, BE work was preempted for pages a turn did not need, and a plan
    # seated work on pages still held.
    system = list(range(1, 65))  # 4 pages
    sched = scheduler([StepPlan(order=["r0", "b1", "b2"])] * 2, prefix_caching=True)
    sched.add_request(request("r0", [*system, *range(900, 910)]))
    sched.add_request(request("b1", [*range(2000, 2064), 5, 6], "be"))
    sched.add_request(request("b2", [*range(2000, 2064), 7, 8], "be"))
    for _ in range(2):
        finish_step(sched, sched.schedule())
    sched.add_request(request("r1", [*system, *range(800, 806)]))
    views = {v.request_id: v for v in sched._views()}
    assert views["r1"].num_shared_pages == 4 and views["r1"].num_computed_tokens == 64
    assert new_pages(views["r1"], 6, PAGE) == 1
    assert (views["b1"].num_shared_pages, views["b2"].num_shared_pages) == (4, 4)
    assert views["r0"].num_shared_pages == 0  # nothing else runs over the system prompt
    assert freed_pages(views["b1"], PAGE) == 1
    # only the two items hold the document's pages: preempting both frees them
    assert views["b1"].shared_page_holders == (2, 2, 2, 2) == views["b2"].shared_page_holders
    assert views["r0"].shared_page_holders == ()  # (RT: never preempted for pages)
    victims = Victims([views["b1"], views["b2"]], PAGE)
    assert victims.num_pages == 2 + 4


def test_each_step_trains_the_cost_model_with_its_own_shape_when_scheduled_ahead() -> None:
    # Async scheduling: vLLM schedules step 2 before it takes step 1's output. Each step's
    # measured time must go with its own shape (a 40-token prefill, then decodes).
    sched = scheduler([StepPlan(order=["p"])] * 3, cls=AntiphonAsyncScheduler)
    sched.take_recorded_steps(record=True)
    sched.add_request(request("p", 40))
    first = sched.schedule()
    second = sched.schedule()
    finish_step(sched, first)
    third = sched.schedule()
    finish_step(sched, second)
    finish_step(sched, third)
    steps = sched.take_recorded_steps(record=False)
    assert [row[0] for row in steps] == [1, 0, 0]  # prefilling requests: step 1 only
    assert [row[1] for row in steps] == [40, 0, 0]  # prefill tokens


def test_with_async_scheduling_a_streams_deadline_counts_the_token_in_flight() -> None:
    # vLLM plans step N+1 while step N's token is in flight (a placeholder, not an output
    # token yet): the view gave the deadline of that token, one TPOT too early, so every
    # policy planned RT streams with a TPOT less slack than they had (the GPU default).
    settings = SchedulerSettings(policy="bros", rt_tpot_slo_s=0.1, slo_headroom=0.0)
    sched = scheduler([StepPlan()] * 4, cls=AntiphonAsyncScheduler, settings=settings)
    sched.add_request(request("r", 20, max_tokens=50))
    first = sched.schedule()  # the prefill: token 1 in flight
    second = sched.schedule()  # token 2 in flight
    finish_step(sched, first)
    sched.schedule()  # token 3 in flight
    finish_step(sched, second)
    (view,) = sched._views()
    assert (view.num_output_tokens, view.is_prefill, view.num_new_tokens) == (3, False, 1)
    # planning token 4: due 3 TPOTs after the first
    assert view.deadline_s() == pytest.approx(sched._first_token_s["r"] + 3 * 0.1)


def test_a_finished_request_whose_pages_the_connector_holds_leaves_no_first_token_time() -> None:
    # The KV connector holds a finished request's pages while it saves its last chunk, so
    # the request stays known to the scheduler; its first token's time was set again after
    # it was dropped, and never dropped after that (one entry per such request, for ever).
    sched = scheduler([StepPlan(order=["a", "b"])] * 12)
    sched._connector_finished = lambda request: (True, None)  # type: ignore[method-assign]
    sched.add_request(request("a", 20))
    sched.add_request(request("b", 20, "be"))
    for _ in range(12):  # a prefill and 7 decodes each
        output = sched.schedule()
        if output.total_num_scheduled_tokens:
            finish_step(sched, output)
    assert all(r.is_finished() for r in sched.requests.values())
    assert sched._first_token_s == {}


def test_an_rt_turn_sitting_a_step_out_rejoins_ahead_of_be_work() -> None:
    # It rejoined at the tail, where vLLM's own preemption (in a step the plan leaves to it)
    # takes from: an RT turn preempted for BE work.
    sched = scheduler([StepPlan(order=["b", "r"]), StepPlan(order=["b"], is_restrictive=True)])
    sched.add_request(request("b", 20, "be"))
    sched.add_request(request("r", 20))
    finish_step(sched, sched.schedule())
    assert scheduled(sched.schedule()) == {"b": 1}
    assert [r.request_id for r in sched.running] == ["r", "b"]


def test_an_rt_turn_admitted_behind_running_be_work_goes_ahead_of_it() -> None:
    # vLLM appends the requests it admits: with none sitting out, the turn stayed behind the
    # BE work, at the tail vLLM's own preemption takes from.
    sched = scheduler([StepPlan(order=["b"], is_restrictive=True),
                       StepPlan(order=["b", "r"], is_restrictive=True)])
    sched.add_request(request("b", 20, "be"))
    finish_step(sched, sched.schedule())
    sched.add_request(request("r", 20))
    assert scheduled(sched.schedule()) == {"b": 1, "r": 20}
    assert [r.request_id for r in sched.running] == ["r", "b"]


@pytest.mark.parametrize("policy", [FcfsPolicy, PriorityPolicy])
def test_the_stock_baselines_keep_vllms_running_order(policy: type[Policy]) -> None:
    # Sorted RT first after every step, the baselines were not stock: vLLM's preemption
    # (the newest running request) spared RT turns, and RT decodes got the tokens first.
    sched = scheduler([])
    sched.step_policy = policy(sched.cost_model)
    sched.add_request(request("b", 20, "be"))
    finish_step(sched, sched.schedule())
    sched.add_request(request("r", 20))
    finish_step(sched, sched.schedule())
    assert [r.request_id for r in sched.running] == ["b", "r"]  # in admission order


def test_waiting_requests_that_sit_a_step_out_keep_their_place_in_the_queue() -> None:
    # They were appended after the step, behind requests that arrived after them; a step
    # the plan leaves to vLLM (a stalled one) seats in queue order. 100 pages of 16 tokens:
    # "b3" takes 63 of them, so "b2", admitted after it, stays queued for want of pages.
    sched = scheduler([StepPlan(order=["b3", "b2"], is_restrictive=True)])
    for rid in ("b1", "b2", "b3"):
        sched.add_request(request(rid, 1000, "be"))
    sched.add_request(request("r", 1000))  # an RT turn the plan leaves out
    assert scheduled(sched.schedule()) == {"b3": 1000}
    assert [r.request_id for r in sched.waiting] == ["r", "b1", "b2"]


def test_a_plans_chunk_never_cuts_a_decode_below_the_rows_vllm_gave_it() -> None:
    # With speculative decoding vLLM pads a decode it seats from the waiting queue to
    # 1 + num_spec rows and asserts they are kept; a chunk limit cut them (a policy's limits
    # are prefill chunks: a decode's rows past the one are drafts or that padding).
    sched = scheduler([])
    prompt = request("a", 40)
    sched._token_limits = {"a": 1}
    assert sched._reserve_prefill_lookahead(prompt, 39, 3) == 3  # one left: a decode
    assert sched._reserve_prefill_lookahead(prompt, 20, 20) == 1  # a prefill chunk is cut


def test_a_step_empty_while_every_last_token_is_in_flight_is_no_stall() -> None:
    """With async scheduling, the step scheduled ahead while a turn's last token is in flight
    is empty: taken for a stall, the next step ran without the plan (a BE prefill of 1,000
    tokens the plan limited to 64 ran whole)."""
    plans = [StepPlan(order=["a", "b"], is_restrictive=True, token_limits={"b": 64})
             for _ in range(3)]
    sched = scheduler(plans, cls=AntiphonAsyncScheduler)
    sched.add_request(request("a", 20, max_tokens=1))
    first = sched.schedule()  # a's prefill: its only token is now in flight
    ahead = sched.schedule()  # nothing to do until that comes
    assert scheduled(first) == {"a": 20} and scheduled(ahead) == {}
    sched.add_request(request("b", 1000, "be"))
    finish_step(sched, first)
    finish_step(sched, ahead)
    assert scheduled(sched.schedule()) == {"b": 64}
    assert sched.stats.plan_fallbacks == 0


def test_a_chunk_limit_keeps_clear_of_a_drafters_prefill_lookahead() -> None:
    """vLLM never ends a prefill chunk within a multi-module drafter's lookahead of the
    prompt's end; the policy's limit, applied after that cut, ended one 2 tokens short."""
    sched = scheduler([])
    sched.num_prefill_lookahead = 4
    sched._token_limits = {"a": 38}
    assert sched._reserve_prefill_lookahead(request("a", 40), 0, 40) == 36
    sched._token_limits = {"a": 20}
    assert sched._reserve_prefill_lookahead(request("a", 40), 0, 40) == 20


def test_with_async_scheduling_a_step_is_planned_from_when_the_step_in_flight_ends() -> None:
    # vLLM plans step N + 1 while N runs; planned as if it started now, it saw a whole step
    # more of slack, filled it with BE work, and an RT token came up to a step late (0.44 s
    # apart at a 0.1 s TPOT in a simulation; found by a review).
    class HalfSecond:
        calibration, mape, mean_copy_s = 1.0, None, 0.0

        def predict_s(self, shape: object) -> float:
            return 0.5

        def observe(self, shape: object, latency: float) -> float:
            return 0.0

    for cls in (AntiphonAsyncScheduler, AntiphonScheduler):
        sched = scheduler([StepPlan(order=["p"])] * 2, cls=cls)
        sched.cost_model = HalfSecond()  # type: ignore[assignment]
        sched.add_request(request("p", 40))
        first = sched.schedule()  # a step predicted to take 0.5 s
        if cls is AntiphonAsyncScheduler:  # the next is planned while it runs
            assert 0.4 < sched._budget().now_s - time.time() <= 0.5
        finish_step(sched, first)
        assert abs(sched._budget().now_s - time.time()) < 0.05  # none in flight


def test_a_step_left_empty_for_a_victims_late_pages_is_no_stall() -> None:
    # A GPU with the KV connector gives a preempted request's pages back only once the step
    # in flight is processed (vLLM's defer_block_free): bros preempts the victim and seats
    # nothing (the RT turn waits a step for the pages; a BE decode needing a page sits out).
    # That empty step was taken for a stall, the next ran without the plan, vLLM gave the BE
    # decode a page first, and the turn no longer fit (found by a review).
    from antiphon.engine_ext.policies.bros import BrosPolicy

    sched = scheduler([StepPlan(order=["v", "b"], is_restrictive=True),
                       StepPlan(order=["v"], is_restrictive=True)],
                      cls=AntiphonAsyncScheduler, settings=SchedulerSettings(policy="bros"))
    sched.defer_block_free = True
    sched.add_request(request("v", 300, "be", max_tokens=50))  # 19 pages: the cheap victim
    sched.add_request(request("b", 1280, "be", max_tokens=50))  # 80 pages: the pool is full
    first = sched.schedule()
    assert scheduled(first) == {"v": 300, "b": 1280}
    second = sched.schedule()  # v decodes (its page has room); b sits out
    finish_step(sched, first)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    sched.add_request(request("r", 300, "rt", max_tokens=50))  # needs 19 pages
    sched.step_policy = BrosPolicy(sched.cost_model)
    third = sched.schedule()
    assert scheduled(third) == {} and sched.requests["v"].status == RequestStatus.PREEMPTED
    finish_step(sched, second)  # v's pages come back
    finish_step(sched, third)
    assert "r" in scheduled(sched.schedule())
    assert sched.stats.plan_fallbacks == 0 and sched.stats.num_preemptions["be"] == 1


def test_no_be_victim_for_pages_a_finished_request_gives_back_at_the_next_step() -> None:
    # A turn that stops at the output of step N was already scheduled in N + 1 (its token in
    # flight): a GPU with the KV connector frees its pages only once N + 1 is processed. The
    # plan saw no free page for a new RT turn and preempted BE work, whose pages come back no
    # sooner: the turn starts a step later either way (found by a review).
    from antiphon.engine_ext.policies.bros import BrosPolicy

    sched = scheduler([StepPlan(order=["f", "v"], is_restrictive=True)] * 2,
                      cls=AntiphonAsyncScheduler, settings=SchedulerSettings(policy="bros"))
    sched.defer_block_free = True
    sched.add_request(Request("f", list(range(1, 301)), SamplingParams(
        max_tokens=50, stop_token_ids=[7], extra_args={"antiphon_class": "rt"}), None,
        block_hasher=_block_hasher))  # 19 pages; stops at its first token
    sched.add_request(request("v", 1270, "be", max_tokens=50))  # 80 pages: the pool is full
    first = sched.schedule()
    second = sched.schedule()
    assert scheduled(second) == {"f": 1, "v": 1}
    finish_step(sched, first)  # f stops; its pages wait for the second step
    assert sched._budget().num_pages_next_step == 19
    sched.add_request(request("r", 290, "rt", max_tokens=50))  # 19 pages
    sched.step_policy = BrosPolicy(sched.cost_model)
    third = sched.schedule()
    assert "r" not in scheduled(third)
    finish_step(sched, second)
    finish_step(sched, third)
    assert "r" in scheduled(sched.schedule())
    assert sched.stats.num_preemptions["be"] == 0
