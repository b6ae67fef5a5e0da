"""AntiphonScheduler inside a real vLLM engine: RT turns take memory from BE work."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import pytest

from antiphon.engine_ext.types import ChatTurn, GenerationParams, RequestClass
from antiphon.engine_ext.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine

DOC = ("The history of navigation spans thousands of years, from coastal piloting by "
       "landmarks to celestial navigation and satellite systems. ") * 12


async def run(engine: VllmEngine, rid: str, content: str, max_tokens: int,
              cls: RequestClass, ignore_eos: bool = False,
              first_token: asyncio.Event | None = None) -> tuple[str, float]:
    """(text, TTFT in seconds); sets `first_token` when the first token arrives."""
    started, first, text = time.perf_counter(), None, ""
    params = GenerationParams(max_tokens=max_tokens, request_class=cls, ignore_eos=ignore_eos)
    async for delta in engine.generate(rid, engine.render_chat([ChatTurn("user", content)]),
                                       params):
        if delta.num_new_tokens and first is None:
            first = time.perf_counter()
            if first_token is not None:
                first_token.set()
        text += delta.text
    return text, (first or time.perf_counter()) - started


async def test_rt_turn_preempts_be_work_under_memory_pressure(engine: VllmEngine) -> None:
    before = await engine.scheduler_stats()
    assert before["policy"] == "bros"
    # Two BE jobs of about 1,120 prompt tokens take 18 of the 20 pages (10 once they have
    # written 60 tokens each, so together they fit); the RT turn (about 300 tokens, 3 pages)
    # then finds too few free pages and must take them from BE work.
    started = [asyncio.Event(), asyncio.Event()]
    be = [asyncio.create_task(run(engine, f"be-{i}", f"Document {i}. {DOC * 4} Summarise it.",
                                  60, RequestClass.BE, ignore_eos=True, first_token=started[i]))
          for i in range(2)]
    be_done: list[float] = []
    for task in be:
        task.add_done_callback(lambda _: be_done.append(time.perf_counter()))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    queues = (await engine.scheduler_stats())["queues"]  # (metrics: antiphon_engine_requests)
    assert queues["running"]["be"] + queues["waiting"]["be"] == 2 and queues["running"]["rt"] == 0
    rt_started = time.perf_counter()
    rt_text, rt_ttft = await run(engine, "rt-0", f"Answer briefly: {DOC} What is this about?",
                                 32, RequestClass.RT)
    be_texts = await asyncio.gather(*be)
    after = await engine.scheduler_stats()

    assert rt_text and all(text for text, _ in be_texts)
    assert after["queues"] == {state: {"rt": 0, "be": 0} for state in ("waiting", "running")}
    assert after["num_preemptions"]["be"] > before["num_preemptions"]["be"]
    assert after["num_preemptions"]["rt"] == before["num_preemptions"]["rt"]
    # This engine has no KV tiering to checkpoint into: a preempted BE request recomputes,
    # and every recomputed token is counted (tests/engine/test_biblocks.py checkpoints).
    assert after["recomputed_tokens"]["be"] > before["recomputed_tokens"]["be"]
    assert after["recomputed_tokens"]["rt"] == 0
    # The RT turn did not wait for BE work to finish: its first token came while both BE
    # jobs still had most of their 60 tokens to write (a timing-free check of the same thing
    # `antiphon bench mixed` measures as TTFT).
    assert len(be_done) == 2 and rt_started + rt_ttft < min(be_done)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "hygen", "echo", "larry", "bros"])
async def test_every_policy_serves_rt_and_be(engine: VllmEngine, policy: str) -> None:
    await engine.set_policy(policy)
    assert (await engine.scheduler_stats())["policy"] == policy
    jobs = [run(engine, f"{policy}-be-{i}", f"Document {i}. {DOC} Summarise it.", 24,
                RequestClass.BE, ignore_eos=True) for i in range(3)]
    jobs.append(run(engine, f"{policy}-rt", "What is the capital of France?", 16,
                    RequestClass.RT))
    results = await asyncio.gather(*jobs)
    assert all(text for text, _ in results)


async def test_scheduler_reports_steps_and_cost_model_error(engine: VllmEngine) -> None:
    await run(engine, "stats-0", "Count from one to twenty.", 40, RequestClass.RT)
    stats = await engine.scheduler_stats()
    assert stats["num_steps"] > 40
    assert 0 < stats["schedule_s"] / stats["num_steps"] < 0.01  # well under 10 ms a step
    assert stats["cost_model_mape"] is not None
    assert 1.0 <= stats["cost_model_calibration"] <= 2.0


async def test_the_step_trace_records_each_step(engine: VllmEngine) -> None:
    assert engine.config.step_trace is not None
    trace = Path(engine.config.step_trace)
    before = len(trace.read_text().splitlines()) if trace.exists() else 0
    await run(engine, "trace-0", "Name three rivers.", 8, RequestClass.BE, ignore_eos=True)
    steps = [json.loads(line) for line in trace.read_text().splitlines()[before:]]
    assert len(steps) >= 8  # a prefill and the decodes (the last step is written with its output)
    assert steps[0]["be"][0] == 1 and steps[0]["be"][1] > 8  # the prompt, one prefill
    assert sum(s["be"][2] for s in steps) >= 6  # then decodes
    assert all(s["lat_s"] > 0 and s["pred_s"] >= 0 and s["rt"] == [0, 0, 0] for s in steps)
    assert all(s["copies"] >= 0 for s in steps)


async def collect(engine: VllmEngine, rid: str, content: str, params: GenerationParams) -> str:
    text = ""
    async for delta in engine.generate(rid, engine.render_chat([ChatTurn("user", content)]),
                                       params):
        text += delta.text
    return text


async def test_a_seeded_prompt_computed_in_chunks_samples_as_in_one(engine: VllmEngine) -> None:
    """A prompt beside RT streams is computed in chunks, each with a sample vLLM throws
    away and rewinds the seeded generator for, by an offset a CPU generator lacks: the
    worker, the engine and the server died (engine_ext.seeded_cpu)."""
    assert engine.config.step_trace is not None
    trace = Path(engine.config.step_trace)
    # a TTFT target it meets in chunks, beside streams whose TPOT leaves steps short
    params = GenerationParams(max_tokens=8, temperature=1.0, seed=11, ttft_slo_s=60.0)
    prompt = f"{DOC * 3} Write a title for it."
    alone = await collect(engine, "seeded-alone", prompt, params)  # (salted: computed anew)
    params = dataclasses.replace(params, cache_salt="seeded-beside")
    started = [asyncio.Event() for _ in range(3)]
    streams = [asyncio.create_task(run(engine, f"seeded-rt-{i}", f"Tell story {i}.", 60,
                                       RequestClass.RT, ignore_eos=True,
                                       first_token=started[i])) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    before = len(trace.read_text().splitlines())
    beside = await collect(engine, "seeded-beside", prompt, params)
    await asyncio.gather(*streams)
    steps = [json.loads(line) for line in trace.read_text().splitlines()[before:]]
    assert sum(1 for s in steps if s["rt"][1] > 0) >= 2  # its prompt went in chunks
    assert beside == alone and alone
