"""Engines and policies by name: the one place that knows every policy.

    engine = build_engine(target, drafter, slots=4, capacity=512, policy="goodput")

Goodput needs a cost table. Without one, this measures it on the engine's own jitted loop
programs (`step_cost`, cached per device and settings), then builds the serving engine around
the measured table.
"""

from __future__ import annotations

import os

from adaflash_jax.decode.cost_table import VerifyCostTable
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.policy import AdaFlashPolicy, FixedPolicy, LengthPolicy, PolicyError
from adaflash_jax.decode.slots import DEFAULT_BUCKETS, SpeculativeEngine
from adaflash_jax.decode.state import bucket_set
from adaflash_jax.decode.step_cost import load_or_measure, unit_table

POLICY_NAMES = ("fixed", "adaflash", "goodput")


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
    cost_table: VerifyCostTable | str | os.PathLike | None = None,
    cache_dir: str | None = None,
    **engine_kwargs,
) -> SpeculativeEngine:
    """A `SpeculativeEngine` whose policy is an object or a name (with `policy_kwargs`);
    goodput reads `cost_table` (a table or a JSON path), else its measured one."""
    if drafter is None:  # plain decoding: no policy
        return SpeculativeEngine(target, None, **engine_kwargs)
    if not isinstance(policy, str):
        return SpeculativeEngine(target, drafter, **engine_kwargs, policy=policy)
    kwargs = dict(policy_kwargs or {})
    if isinstance(cost_table, str | os.PathLike):
        cost_table = VerifyCostTable.load(cost_table)
    if policy != "goodput" or cost_table is not None:
        policy = make_policy(policy, cost=cost_table, **kwargs)
        return SpeculativeEngine(target, drafter, **engine_kwargs, policy=policy)
    k = engine_kwargs.get("block_size") or drafter.config.block_size
    widths = bucket_set(engine_kwargs.get("buckets", DEFAULT_BUCKETS), k)
    placeholder = GoodputPolicy(cost=unit_table(engine_kwargs["slots"], widths), **kwargs)
    # validates the options, buckets and head outputs before the measurement's compute
    e = SpeculativeEngine(target, drafter, **engine_kwargs, policy=placeholder)
    table = load_or_measure(
        e.target, e.drafter, rows=(e.slots,), capacity=e.capacity, buckets=e.buckets,
        temperature=e.temperature, top_p=e.top_p, cache_dir=cache_dir,
    )  # fmt: skip
    policy = GoodputPolicy(cost=table, **kwargs)
    return SpeculativeEngine(target, drafter, **engine_kwargs, policy=policy)
