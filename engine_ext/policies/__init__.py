"""Scheduling policies, picked by name."""

from __future__ import annotations

from antiphon.engine_ext.costmodel import CostModel
from antiphon.engine_ext.policies.base import Policy
from antiphon.engine_ext.policies.bros import BrosNoBlockPreemptionPolicy, BrosPolicy
from antiphon.engine_ext.policies.echo import EchoPolicy
from antiphon.engine_ext.policies.hygen import HygenPolicy
from antiphon.engine_ext.policies.larry import LarryPolicy
from antiphon.engine_ext.policies.stock import FcfsPolicy, PriorityPolicy

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (FcfsPolicy, PriorityPolicy, BrosPolicy, HygenPolicy, EchoPolicy,
                        LarryPolicy, BrosNoBlockPreemptionPolicy)}


def policy_class(name: str) -> type[Policy]:
    """The policy class called `name`; raises ValueError listing the valid names."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid policies: "
                         f"{', '.join(sorted(POLICIES))}") from None


def make_policy(name: str, cost_model: CostModel | None = None) -> Policy:
    return policy_class(name)(cost_model or CostModel())


__all__ = ["POLICIES", "Policy", "make_policy", "policy_class"]
