"""A plan's per-request chunks, as vLLM's own scheduler applies them, without a model run."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from antiphon.engine_ext.policies.base import Policy
from antiphon.engine_ext.scheduler import AntiphonScheduler
from antiphon.engine_ext.views import RequestView, StepBudget, StepPlan
from antiphon.model import resolve_model

pytestmark = pytest.mark.engine

PAGE = 16


class ScriptedPlans(Policy):
    """Returns the plans it is given, one a step."""

    name = "scripted"

    def __init__(self, plans: list[StepPlan]) -> None:
        self.plans = plans

    def plan(self, views: Sequence[RequestView], budget: StepBudget) -> StepPlan:
        return self.plans.pop(0)


def scheduler(plans: list[StepPlan]) -> AntiphonScheduler:
    """vLLM's scheduler as the engine builds it (100 pages of 16 tokens, 2,048 tokens a step),
    with `plans` for its policy; no engine, no model weights loaded."""
    model = ModelConfig(model=str(resolve_model(None)), dtype="float32", max_model_len=2048)
    config = VllmConfig(
        model_config=model, device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=PAGE, enable_prefix_caching=False),
        additional_config={})
    config.cache_config.num_gpu_blocks = 100
    pages = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=PAGE, num_kv_heads=1,
                                                      head_size=8, dtype=torch.float32))])
    sched = AntiphonScheduler(vllm_config=config, kv_cache_config=pages,
                              structured_output_manager=StructuredOutputManager(config),
                              block_size=PAGE)
    sched.step_policy = ScriptedPlans(plans)
    return sched


def request(rid: str, num_prompt_tokens: int) -> Request:
    return Request(rid, list(range(1, num_prompt_tokens + 1)),
                   SamplingParams(max_tokens=8), None)


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
