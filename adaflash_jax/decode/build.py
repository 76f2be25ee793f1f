"""Engines and policies by name: the one place that knows every policy.

    engine = build_engine(target, drafter, slots=4, capacity=512, policy="goodput",
                          cost_table="cost.json")

Goodput reads a cost table, given as a `VerifyCostTable` or a JSON path
(`bench.step_cost.engine_table` measures one on the engine's own loop programs).
"""

from __future__ import annotations

import os

from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.policy import (
    AdaFlashPolicy,
    FixedPolicy,
    LengthPolicy,
    PolicyError,
    TreeBatchPolicy,
)
from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.io.cost_table import VerifyCostTable

POLICY_NAMES = ("fixed", "adaflash", "goodput", "tree-batch")


def make_policy(name: str, *, cost: VerifyCostTable | None = None, **kwargs) -> LengthPolicy:
    """A policy by name; `goodput` needs a verify-cost table."""
    if name == "fixed":
        return FixedPolicy(**kwargs)
    if name == "adaflash":
        return AdaFlashPolicy(**kwargs)
    if name == "tree-batch":
        return TreeBatchPolicy(**kwargs)
    if name == "goodput":
        if cost is None:
            raise PolicyError("the goodput policy needs a verify-cost table (cost=...)")
        return GoodputPolicy(cost=cost, **kwargs)
    raise PolicyError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")


def build_engine(
    target,
    drafter,
    *,
    policy: str | LengthPolicy = "fixed",
    policy_kwargs: dict | None = None,
    cost_table: VerifyCostTable | str | os.PathLike | None = None,
    **engine_kwargs,
) -> SpeculativeEngine:
    """A `SpeculativeEngine` whose policy is an object or a name (with `policy_kwargs` and,
    for goodput, `cost_table`); `drafter=None` decodes plainly."""
    if drafter is None:
        return SpeculativeEngine(target, None, **engine_kwargs)
    if isinstance(policy, str):
        if isinstance(cost_table, str | os.PathLike):
            cost_table = VerifyCostTable.load(cost_table)
        policy = make_policy(policy, cost=cost_table, **(policy_kwargs or {}))
    return SpeculativeEngine(target, drafter, **engine_kwargs, policy=policy)
