"""Utility methods Antiphon adds to vLLM's EngineCore, which the API server's `VllmEngine`
calls by name (`call_utility_async`): the scheduler's counters, policy and cost model, the KV
tiers' advisories, erasures and counters. Installed when the scheduler module is imported in
the EngineCore process; vLLM itself is not changed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.engine.core import EngineCore

from antiphon.tiering.keys import salt_bytes

if TYPE_CHECKING:
    from antiphon.engine_ext.scheduler import AntiphonScheduler

# Under vLLM's logger tree, so the message shows in the EngineCore process's log.
logger = init_logger("vllm.antiphon.scheduler")


def _engine_core_stats(self: EngineCore) -> dict[str, Any]:
    """EngineCore utility method: the Antiphon scheduler's counters (see VllmEngine)."""
    from antiphon.engine_ext.scheduler import AntiphonScheduler

    scheduler = self.scheduler
    return scheduler.antiphon_stats() if isinstance(scheduler, AntiphonScheduler) else {}


def _engine_core_set_policy(self: EngineCore, name: str) -> str:
    """EngineCore utility method: switch the Antiphon scheduler's policy; returns its name."""
    _antiphon_scheduler(self).set_policy(name)
    return name


def _engine_core_check_integrity(self: EngineCore) -> list[str]:
    """EngineCore utility method: the bidirectional-block invariants' problems (see
    `AntiphonScheduler.check_integrity`)."""
    return _antiphon_scheduler(self).check_integrity()


def _antiphon_scheduler(core: EngineCore) -> AntiphonScheduler:
    from antiphon.engine_ext.scheduler import AntiphonScheduler

    scheduler = core.scheduler
    if not isinstance(scheduler, AntiphonScheduler):
        raise RuntimeError("the engine does not run AntiphonScheduler")
    return scheduler


def _engine_core_use_cost_model(self: EngineCore, form: str, coefficients: list[float],
                                profiled_mape: float | None) -> str:
    """EngineCore utility method: the scheduler predicts with a profiled fit; returns the
    form's name."""
    _antiphon_scheduler(self).use_cost_model(form, coefficients, profiled_mape)
    return form


def _engine_core_recorded_steps(self: EngineCore, record: bool) -> list[list[float]]:
    """EngineCore utility method: measured steps since the last call (see
    `AntiphonScheduler.take_recorded_steps`)."""
    return _antiphon_scheduler(self).take_recorded_steps(record)


def _tier_planner(core: EngineCore) -> Any:
    """The KV connector's scheduler side, or None when KV tiering is off."""
    from antiphon.tiering.connector import AntiphonKVConnector

    connector = getattr(core.scheduler, "connector", None)
    return connector.planner if isinstance(connector, AntiphonKVConnector) else None


def _engine_core_advise(self: EngineCore, session_id: str, token_ids: list[int],
                        expected_arrival_s: float | None, cache_salt: str | None = None,
                        priority: int = 0) -> int:
    """EngineCore utility method: an advisory; returns the context tokens the tiers hold
    (-1 when KV tiering is off)."""
    planner = _tier_planner(self)
    if planner is None:
        return -1
    return int(planner.advise(session_id, token_ids, expected_arrival_s,
                              salt=salt_bytes(cache_salt), priority=priority))


def _engine_core_forget(self: EngineCore, session_id: str, chains: list[list[int]],
                        cache_salt: str | None, keep: list[list[int]] | None = None) -> bool:
    """EngineCore utility method: start erasing a deleted session's KV from the tiers, every
    chunk of the token sequences it ran (`chains`, hashed with the connector's own KV
    identity; with `keep`, a live session's old chains less what it still runs), in a thread:
    steps go on; `antiphon_forgotten` says when it is done. False when KV tiering is off."""
    planner = _tier_planner(self)
    if planner is None:
        return False
    planner.erasure.forget(session_id, chains, salt=salt_bytes(cache_salt), keep=keep)
    return True


def _engine_core_forgotten(self: EngineCore, session_id: str) -> int | None:
    """EngineCore utility method: the chunk-layers `antiphon_forget` erased, once every
    erasure is on disk (None until then)."""
    planner = _tier_planner(self)
    done = None if planner is None else planner.erasure.forgotten(session_id)
    if done is None:
        return None
    erased, kept = done
    if kept:
        logger.info("session %s deleted: %d chunk-layers of its KV erased, %d kept (running "
                    "turns share them)", session_id, erased, kept)
    return erased


def _engine_core_reset_counters(self: EngineCore) -> None:
    """EngineCore utility method: the scheduler's and the KV tiers' counters start again from
    zero (after profiling at start); the cost model's state is kept."""
    _antiphon_scheduler(self).reset_counters()
    planner = _tier_planner(self)
    if planner is not None:
        planner.reset_counters()


def _engine_core_tiering_stats(self: EngineCore) -> dict[str, Any]:
    """EngineCore utility method: the KV connector's counters ({} when tiering is off)."""
    planner = _tier_planner(self)
    return {} if planner is None else planner.stats()


# vLLM calls utility methods on EngineCore by name; these add some, without changing vLLM.
EngineCore.antiphon_scheduler_stats = _engine_core_stats  # type: ignore[attr-defined]
EngineCore.antiphon_set_policy = _engine_core_set_policy  # type: ignore[attr-defined]
EngineCore.antiphon_advise = _engine_core_advise  # type: ignore[attr-defined]
EngineCore.antiphon_tiering_stats = _engine_core_tiering_stats  # type: ignore[attr-defined]
EngineCore.antiphon_forget = _engine_core_forget  # type: ignore[attr-defined]
EngineCore.antiphon_forgotten = _engine_core_forgotten  # type: ignore[attr-defined]
EngineCore.antiphon_reset_counters = _engine_core_reset_counters  # type: ignore[attr-defined]
EngineCore.antiphon_use_cost_model = _engine_core_use_cost_model  # type: ignore[attr-defined]
EngineCore.antiphon_recorded_steps = _engine_core_recorded_steps  # type: ignore[attr-defined]
EngineCore.antiphon_check_integrity = _engine_core_check_integrity  # type: ignore[attr-defined]

