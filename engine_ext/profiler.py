"""Step latencies of the real engine over a grid of batch compositions, and the cost-model fit
`serve` starts from.

Each grid point runs on the engine while its scheduler records every step's shape and latency
(`AntiphonScheduler.take_recorded_steps`):

    decoders   requests decoding at one context length, `decode_steps` tokens each
    prompts    a number of prompts of one length arriving together, `rounds` times
               (while the decoders decode: mixed steps)

Decoders share one prompt prefix, computed once first, so they reach long contexts through
vLLM's prefix cache in one short step instead of a long prefill each (their attention still
reads the whole context); arriving prompts are unique token ids. Warm-up points run first and
are not recorded. vLLM's own FCFS order schedules while profiling, so the steps have the
grid's compositions rather than a policy's choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from antiphon import env
from antiphon.engine_ext.costfit import (
    MIN_STORED_FIT_STEPS,
    CostFit,
    ProfiledStep,
    choose_fit,
    fit_path,
    is_storable,
    load_fit,
    save_fit,
)
from antiphon.engine_ext.stepshape import StepShape
from antiphon.engine_ext.types import GenerationParams, RequestClass

if TYPE_CHECKING:
    from antiphon.engine_ext.vllm_engine import VllmEngine

logger = logging.getLogger(__name__)

_TAIL = 4  # unique tokens after a decoders' shared prefix


@dataclasses.dataclass(frozen=True)
class GridPoint:
    num_decodes: int  # requests decoding through the point
    decode_context: int  # their prompt length (tokens)
    num_prefills: int  # prompts arriving together, each round
    prefill_tokens: int  # their length (tokens)
    rounds: int = 1


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """The grid: prefill-only, decode-only and mixed points (products of the tuples)."""

    prefill_counts: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    decode_counts: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed_decode_counts: tuple[int, ...]
    mixed_decode_contexts: tuple[int, ...]
    mixed_prefill_counts: tuple[int, ...]
    mixed_prefill_lengths: tuple[int, ...]
    decode_steps: int = 8  # tokens each decoder of a decode-only point generates
    rounds: int = 2  # prompt arrivals per point with prompts


QUICK = GridSpec(prefill_counts=(1, 4), prefill_lengths=(32, 256, 1024),
                 decode_counts=(1, 8, 32), decode_contexts=(64, 1024),
                 mixed_decode_counts=(4, 16), mixed_decode_contexts=(512,),
                 mixed_prefill_counts=(1, 2), mixed_prefill_lengths=(64, 512),
                 decode_steps=6, rounds=2)
FULL = GridSpec(prefill_counts=(1, 2, 4, 8), prefill_lengths=(16, 64, 256, 1024, 2048),
                decode_counts=(1, 4, 16, 32, 64), decode_contexts=(32, 256, 1024, 2048),
                mixed_decode_counts=(2, 8, 32), mixed_decode_contexts=(128, 1024),
                mixed_prefill_counts=(1, 4), mixed_prefill_lengths=(32, 256, 1024),
                decode_steps=10, rounds=3)
# Tiny, for tests against a small KV pool.
TINY = GridSpec(prefill_counts=(1, 2), prefill_lengths=(16, 128), decode_counts=(1, 4),
                decode_contexts=(32, 300), mixed_decode_counts=(2,), mixed_decode_contexts=(200,),
                mixed_prefill_counts=(1,), mixed_prefill_lengths=(64,), decode_steps=4, rounds=2)


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int
    max_num_tokens: int  # token budget of one step
    max_model_len: int
    kv_tokens: int  # the KV pool, in tokens
    page_tokens: int


def grid_points(spec: GridSpec, limits: EngineLimits) -> list[GridPoint]:
    """The points of `spec` the engine can run: sequence, length and KV limits respected
    (prompts longer than a step's budget are kept: they are chunked)."""
    points = [GridPoint(0, 0, n, length, spec.rounds)
              for n, length in itertools.product(spec.prefill_counts, spec.prefill_lengths)]
    points += [GridPoint(n, ctx, 0, 0, 0)
               for n, ctx in itertools.product(spec.decode_counts, spec.decode_contexts)]
    points += [GridPoint(*p, spec.rounds) for p in itertools.product(
        spec.mixed_decode_counts, spec.mixed_decode_contexts, spec.mixed_prefill_counts,
        spec.mixed_prefill_lengths)]
    return [p for p in points if _fits(p, spec, limits)]


def _decoder_tokens(point: GridPoint, spec: GridSpec) -> int:
    """Tokens each decoder generates: through the prompt rounds, or `decode_steps`."""
    return spec.decode_steps + (8 * point.rounds if point.num_prefills else 0)


def _fits(point: GridPoint, spec: GridSpec, limits: EngineLimits) -> bool:
    page = limits.page_tokens
    decoder_kv = page + _TAIL + _decoder_tokens(point, spec)  # beyond the shared prefix
    kv = (point.decode_context + point.num_decodes * (decoder_kv + page)
          + point.num_prefills * (point.prefill_tokens + page))
    return (point.num_decodes + point.num_prefills <= limits.max_num_seqs
            and point.decode_context + _decoder_tokens(point, spec) < limits.max_model_len
            and point.prefill_tokens < limits.max_model_len
            and kv <= 0.9 * limits.kv_tokens)


async def profile_steps(engine: VllmEngine, points: list[GridPoint],
                        warmup: list[GridPoint], spec: GridSpec, seed: int = 0,
                        progress: Callable[[int, int], None] | None = None,
                        ran: list[list[int]] | None = None) -> list[ProfiledStep]:
    """Run `warmup`, then each of `points` recording its steps (grouped by point); the
    scheduler's policy is FCFS meanwhile and restored after. Each request's tokens (prompt
    and output) are appended to `ran`."""
    policy = (await engine.scheduler_stats()).get("policy")
    await engine.set_policy("fcfs")
    rng = random.Random(seed)
    tag = f"profile-{uuid.uuid4().hex[:8]}"
    steps: list[ProfiledStep] = []
    try:
        for i, point in enumerate(warmup):
            await _run_point(engine, point, spec, rng, f"{tag}-warmup{i}", ran)
        await engine.recorded_steps(record=True)
        for i, point in enumerate(points):
            await _run_point(engine, point, spec, rng, f"{tag}-{i}", ran)
            steps += [ProfiledStep(StepShape.from_list(row[:-1]), float(row[-1]), group=i)
                      for row in await engine.recorded_steps(record=True)]
            if progress is not None:
                progress(i + 1, len(points))
    finally:
        await engine.recorded_steps(record=False)
        if policy:
            await engine.set_policy(str(policy))
    return steps


async def _run_point(engine: VllmEngine, point: GridPoint, spec: GridSpec, rng: random.Random,
                     tag: str, ran: list[list[int]] | None = None) -> None:
    decoders: list[asyncio.Task[None]] = []
    try:
        if point.num_decodes:
            prefix = random_token_ids(rng, point.decode_context - _TAIL)
            await generate_tokens(engine, f"{tag}-primer",
                                  prefix + random_token_ids(rng, _TAIL), 1, ran=ran)
            started = [asyncio.Event() for _ in range(point.num_decodes)]
            decoders = [asyncio.create_task(generate_tokens(
                engine, f"{tag}-d{i}", prefix + random_token_ids(rng, _TAIL),
                _decoder_tokens(point, spec), started[i], ran))
                for i in range(point.num_decodes)]
            await asyncio.gather(*(e.wait() for e in started))
        for r in range(point.rounds if point.num_prefills else 0):
            await asyncio.gather(*(
                generate_tokens(engine, f"{tag}-r{r}p{i}",
                                random_token_ids(rng, point.prefill_tokens), 1, ran=ran)
                for i in range(point.num_prefills)))
    except BaseException:
        # A failed round, or a cancelled start: the decoders end here too (they ran on,
        # and what they left was not in `ran` when the profiling's leftovers were cleared).
        for task in decoders:
            task.cancel()
        await asyncio.gather(*decoders, return_exceptions=True)
        raise
    if point.num_prefills:
        for task in decoders:
            task.cancel()  # aborts the request
    for result in await asyncio.gather(*decoders, return_exceptions=True):
        if isinstance(result, Exception):
            raise result


async def generate_tokens(engine: VllmEngine, request_id: str, token_ids: list[int],
                          max_tokens: int, started: asyncio.Event | None = None,
                          ran: list[list[int]] | None = None) -> None:
    """Run one request to its end; sets `started` at its first token (or when it fails), and
    appends its tokens (prompt and output) to `ran`."""
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True,
                              request_class=RequestClass.BE)
    output: list[int] = []
    try:
        async for delta in engine.generate(request_id, token_ids, params):
            output += delta.token_ids
            if started is not None and delta.num_new_tokens:
                started.set()
    finally:
        if started is not None:
            started.set()
        if ran is not None:
            ran.append(token_ids + output)


def random_token_ids(rng: random.Random, n: int) -> list[int]:
    # Ordinary vocabulary ids (no special tokens) of any model with a vocabulary over 30,000.
    return [rng.randrange(1000, 30000) for _ in range(n)]


async def profile(engine: VllmEngine, spec: GridSpec,
                  progress: Callable[[int, int], None] | None = None,
                  ran: list[list[int]] | None = None,
                  ) -> tuple[CostFit, list[ProfiledStep]]:
    """Profile `engine` over `spec` and choose the form (see costfit); stores nothing. The
    tokens of every request it ran are appended to `ran`."""
    limits = engine.limits()
    points = grid_points(spec, limits)
    if not points:
        raise ValueError(f"no grid point fits the engine ({limits})")
    # The heaviest prefill and a mixed step warm up kernels and allocators for the rest.
    warmup = [max((p for p in points if not p.num_decodes), default=points[0],
                  key=lambda p: p.num_prefills * p.prefill_tokens),
              next((p for p in points if p.num_decodes and p.num_prefills), points[-1])]
    steps = await profile_steps(engine, points, warmup, spec, progress=progress, ran=ran)
    model, machine = engine.cost_model_key()
    fit = choose_fit(steps, model, machine)
    return dataclasses.replace(fit, limits=fit_limits(limits)), steps


def fit_limits(limits: EngineLimits) -> dict[str, int]:
    """`limits` as a stored fit records them."""
    return dataclasses.asdict(limits)


def fit_covers(fit: CostFit, limits: EngineLimits) -> bool:
    """Whether `fit`'s grid reached every point of the full grid an engine of `limits` could
    run (limits past the grid's reach, a larger KV pool or batch, change nothing); a fit that
    did not record its limits is taken to."""
    if fit.limits is None:
        return True
    try:
        profiled = EngineLimits(**fit.limits)
    except TypeError:  # (limits of another version's fields)
        return False
    return (set(grid_points(FULL, limits)) <= set(grid_points(FULL, profiled))
            and largest_step(limits) <= largest_step(profiled))


def largest_step(limits: EngineLimits) -> int:
    """Tokens of the largest step the full grid forms on an engine of `limits`: its prompts
    are chunked to the step's token budget, so a larger budget makes larger steps of the same
    points (a fit profiled at 4,096 tokens a step predicted a 16,384-token step at 2.5 times
    its time)."""
    reach = max((p.num_prefills * p.prefill_tokens + p.num_decodes
                 for p in grid_points(FULL, limits)), default=0)
    return min(reach, limits.max_num_tokens)


async def prepare_cost_model(engine: VllmEngine) -> CostFit | None:
    """At engine start, per `EngineConfig.cost_model`: install the stored fit for the engine's
    (model, machine); under `auto` with none stored, profile (quick grid), store and install
    one. None when the scheduler keeps its online prior."""
    mode = engine.config.cost_model
    if mode == "online":
        return None
    model, machine = engine.cost_model_key()
    path = fit_path(env.cache_dir(), model, machine)
    fit = load_fit(path, model, machine)
    if fit is not None and not is_storable(fit):
        logger.warning("Ignoring the cost-model fit stored in %s: %d profiled steps, fewer than "
                       "%d; run `antiphon profile` with the default engine limits", path,
                       fit.num_steps, MIN_STORED_FIT_STEPS)
        fit = None
    if fit is not None and not fit_covers(fit, engine.limits()):
        logger.warning("Ignoring the cost-model fit stored in %s: profiled within smaller "
                       "engine limits (%s) than this engine's (%s); run `antiphon profile` "
                       "with this engine's options", path, fit.limits,
                       fit_limits(engine.limits()))
        fit = None
    if fit is None and mode == "auto":
        logger.info("No cost-model fit stored for this model and machine: profiling the "
                    "engine (quick grid, under 2 minutes on 2 cores, once); `antiphon profile` "
                    "fits a finer one")
        ran: list[list[int]] = []
        try:
            fit, _ = await profile(engine, QUICK, ran=ran)
        except Exception:
            logger.exception("Profiling failed; the cost model starts from its prior")
            return None
        finally:  # served traffic starts from clean tiers and counters
            await engine.forget_profiling(ran)
        if is_storable(fit):
            try:
                save_fit(fit, path)
                logger.info("Cost-model fit stored in %s", path)
            except OSError as exc:  # (a read-only or full cache: serve with it all the same)
                logger.warning("Cost-model fit not stored in %s (%s): used for this run, and "
                               "the next start profiles again", path, exc)
        else:  # this engine's own measurements, for this run only
            logger.warning("Cost-model fit from %d steps, fewer than %d: used, not stored",
                           fit.num_steps, MIN_STORED_FIT_STEPS)
    if fit is None:
        logger.info("No cost-model fit stored for this model and machine; the cost model "
                    "starts from its prior and learns online")
        return None
    await engine.use_cost_model(fit.form, fit.coefficients, fit.heldout_mape)
    logger.info("Cost model: %s form, held-out MAPE %.1f%% (%s)", fit.form,
                100 * fit.heldout_mape, path)
    return fit
