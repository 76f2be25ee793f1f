"""The engine's jitted entry points: prefill into slots, and a loop program of steps.

Dimensions: B slots, I rows admitted by one prefill, Q padded prompt length, S capacity.

Each takes the target and the drafter as one (graphdef, state) pair each (the graphdef is
static pytree data: part of the compiled program's key) and donates the engine state, so
callers continue from the returned one (without donation each device call copies the whole
state before its loop runs: most of a call's overhead on the CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.decode.loops import PROGRAMS
from adaflash_jax.decode.state import SpecState
from adaflash_jax.decode.step import commit_tokens
from adaflash_jax.decode.tokens import pick_tokens
from adaflash_jax.sharding.rows import constrain_rows


def _merge(model):
    return None if model is None else nnx.merge(*model)


@functools.partial(jax.jit, static_argnames=("spec", "program"), donate_argnames=("s",))
def run_loop(target, drafter, s: SpecState, stop_on_finish, max_steps, *, spec, program=0):
    """Runs loop program `program` (`loops.DRAFTED` or `loops.UNDRAFTED`) until it stops
    (`loops.may_continue`) or the policy wants the other. Returns (state, steps run, slots
    finished, the program to run next)."""
    run = PROGRAMS[program]
    b = s.done_B.shape[0]
    s = constrain_rows(spec.rows, s, b)
    s, *rest = run(_merge(target), _merge(drafter), s, spec, stop_on_finish, max_steps)
    return constrain_rows(spec.rows, s, b), *rest


def _scatter_rows(dst, src, slots_I):
    """Writes src rows into dst at `slots_I`; out-of-range slots (padding rows) drop."""
    return jax.tree.map(lambda d, x: d.at[slots_I].set(x.astype(d.dtype), mode="drop"), dst, src)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("s",))
def prefill_slots(target, drafter, s, slots_I, prompt_IxQ, prompt_len_I, max_new_I, *, spec):
    """Starts I requests in slots `slots_I` (padding rows carry slot index B: dropped): the
    prompt fills fresh target-cache rows and its features the drafter context; the first
    token, from the prefill logits, becomes the bonus. The rows are marked started for the
    policy. Pass `spec.prefill_spec`: engines that differ only in policy share this program."""
    target, drafter = _merge(target), _merge(drafter)
    n, capacity = prompt_IxQ.shape[0], s.target_cache.capacity
    s = constrain_rows(spec.rows, s, s.done_B.shape[0])
    prompt_IxQ = constrain_rows(spec.rows, prompt_IxQ, n)
    fresh = target.init_cache(n, capacity, dtype=s.target_cache.dtype)
    out = target(
        prompt_IxQ,
        cache=constrain_rows(spec.rows, fresh, n),
        num_new_B=prompt_len_I,
        feature_layers=spec.feature_layers if drafter is not None else (),
        compute_logits=False,
        rows=spec.rows,
    )
    last_IxD = out.hidden_BxTxD[jnp.arange(n), prompt_len_I - 1]
    logits_IxV = target.logits(last_IxD[:, None])[:, 0].astype(jnp.float32)
    rng, key = jax.random.split(s.rng)
    first_I = pick_tokens(key, logits_IxV, s.temperature, spec.top_p(s), greedy=spec.greedy)
    ctx = s.context_cache
    if drafter is not None:
        fresh = drafter.init_context_cache(n, capacity, dtype=ctx.dtype)
        fresh = constrain_rows(spec.rows, fresh, n)
        entries = drafter.context_entries(fresh, out.features_BxTxnD)
        ctx = _scatter_rows(ctx, fresh.commit(entries, prompt_len_I), slots_I)
    blank_IxS = jnp.full((n, s.out_BxS.shape[1]), -1, jnp.int32)
    zero_I, true_I = jnp.zeros((n,), jnp.int32), jnp.ones((n,), bool)

    def rows(dst, src):
        return _scatter_rows(dst, src, slots_I)

    s = s.replace(
        target_cache=rows(s.target_cache, out.cache),
        context_cache=ctx,
        bonus_B=rows(s.bonus_B, first_I),
        out_BxS=rows(s.out_BxS, blank_IxS),
        num_out_B=rows(s.num_out_B, zero_I),
        max_new_B=rows(s.max_new_B, max_new_I),
        done_B=rows(s.done_B, ~true_I),
        started_B=rows(s.started_B, true_I),
        steps_B=rows(s.steps_B, zero_I),
        accepted_BxS=rows(s.accepted_BxS, blank_IxS),
        width_BxS=rows(s.width_BxS, blank_IxS),
        request_BxS=rows(s.request_BxS, blank_IxS),
        rng=rng,
    )
    started_B = _scatter_rows(jnp.zeros_like(s.done_B), true_I, slots_I)
    s = commit_tokens(s, s.bonus_B[:, None], jnp.ones_like(s.num_out_B), started_B)
    return constrain_rows(spec.rows, s, s.done_B.shape[0])


def compiled_programs() -> dict[str, int]:
    """Compiled-program counts of the jitted entry points (for no-recompile checks)."""
    return {"run_loop": run_loop._cache_size(), "prefill_slots": prefill_slots._cache_size()}
