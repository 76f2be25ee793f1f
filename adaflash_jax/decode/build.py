"""Engines and policies by name: the one place that knows every policy.

    engine = build_engine(target, drafter, slots=4, capacity=512, policy="goodput",
                          cost_table=step_cost.engine_table)

Goodput reads a cost table: a `VerifyCostTable`, a JSON path, or a function that makes the
table of the engine once its settings are checked (`bench.step_cost.engine_table` measures
the engine's own loop programs, cached per device and settings).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from adaflash_jax.decode.cost_table import VerifyCostTable
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.policy import AdaFlashPolicy, FixedPolicy, LengthPolicy, PolicyError
from adaflash_jax.decode.slots import SpeculativeEngine

POLICY_NAMES = ("fixed", "adaflash", "goodput")
CostSource = VerifyCostTable | str | os.PathLike | Callable[[SpeculativeEngine], VerifyCostTable]


def make_policy(name: str, *, cost: VerifyCostTable | None = None, **kwargs) -> LengthPolicy:
    """A policy by name; `goodput` needs a verify-cost table."""
    if name == "fixed":
        return FixedPolicy(**kwargs)
    if name == "adaflash":
        return AdaFlashPolicy(**kwargs)
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
    cost_table: CostSource | None = None,
    **engine_kwargs,
) -> SpeculativeEngine:
    """A `SpeculativeEngine` whose policy is an object or a name (with `policy_kwargs`)."""
    if drafter is None:  # plain decoding: no policy
        return SpeculativeEngine(target, None, **engine_kwargs)
    if not isinstance(policy, str):
        return SpeculativeEngine(target, drafter, **engine_kwargs, policy=policy)
    kwargs = dict(policy_kwargs or {})
    if isinstance(cost_table, str | os.PathLike):
        cost_table = VerifyCostTable.load(cost_table)
    elif policy == "goodput" and callable(cost_table):
        # an engine on a flat table first: its options, buckets and head outputs are checked
        # before the table's compute
        k = max(engine_kwargs.get("block_size") or drafter.config.block_size, 1)
        flat = VerifyCostTable(
            rows=(1,), widths=range(1, k + 1), verify_ms=((1.0,) * k,), draft_ms=(0.0,)
        )
        checked = GoodputPolicy(cost=flat, **kwargs)
        cost_table = cost_table(SpeculativeEngine(target, drafter, **engine_kwargs, policy=checked))
    policy = make_policy(policy, cost=cost_table, **kwargs)
    return SpeculativeEngine(target, drafter, **engine_kwargs, policy=policy)
