"""Engines as the harnesses and CLIs build them: `decode.build.build_engine`, with goodput's
verify-cost table measured on that very engine (cached per device) when none is given, and
speculative generation of a prompt list at the slot capacity the prompts need."""

from __future__ import annotations

from collections.abc import Sequence

from adaflash_jax.bench.step_cost import engine_table
from adaflash_jax.decode.build import build_engine
from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.distill.shapes import slot_capacity


def measured_engine(
    target, drafter, *, policy="fixed", policy_kwargs: dict | None = None, cost_table=None, **kw
) -> SpeculativeEngine:
    """`build_engine` with its options; goodput without a cost table gets its engine's own
    (`step_cost.engine_table`: measured once, then read from the cache)."""
    if policy == "goodput" and cost_table is None:
        cost_table = engine_table(target, drafter, policy_kwargs=policy_kwargs, **kw)
    return build_engine(
        target, drafter, policy=policy, policy_kwargs=policy_kwargs, cost_table=cost_table, **kw
    )


def speculative_generate(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    slots: int | None = None,
    block_size: int | None = None,
    **kw,
) -> list:
    """Every prompt through one engine (continuous batching over `slots`, default one per
    prompt) whose cache holds the longest prompt, the new tokens and a block (at most the
    target's positions); `kw` as `measured_engine`'s and the engine's (policy, temperature,
    seed, eos_ids, ...). Greedy output equals plain generation."""
    k = block_size or drafter.config.block_size
    need = slot_capacity(max(len(p) for p in prompts), max_new_tokens, k)
    engine = measured_engine(
        target,
        drafter,
        slots=slots or len(prompts),
        capacity=min(need, target.config.max_position_embeddings),
        block_size=block_size,
        **kw,
    )
    return engine.generate([(list(p), max_new_tokens) for p in prompts])
