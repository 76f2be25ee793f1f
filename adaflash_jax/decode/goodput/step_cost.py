"""Goodput's cost table measured on the engine's OWN jitted step, not on bare forwards.

Dimensions: B slots, K block size, W verify width (a bucket).

Why: the engine's step is more than a target forward plus a drafter forward: it samples,
accepts, commits, appends the committed features to the drafter context and keeps its
statistics, always over all B slots (finished and free slots ride along masked). On the CPU
the bare-forward costs were off by up to 2x against the engine's steps (BENCHMARKS.md), enough
to make goodput draft where a plain step is faster.

So the calibration runs the engine's loop programs over a few steps with a calibration-only
policy that forces each case (the undrafted program, and the drafted one at each width W,
computing the same estimator as goodput) and writes a table with one row count (B: the
step's cost does not depend on how many slots are active):

    draft_ms   = step(drafted, W = 1) − step(undrafted)      (clamped at 0)
    verify_ms[W] = step(drafted, W) − draft_ms               (so verify_ms[1] = step(undrafted))
    switch_ms  = call(undrafted, 1 step) − step(undrafted)   (a device call's own overhead)
    probe_ms   = step(undrafted, a probe after each) − step(undrafted)

where step(case) = (call(case, n steps) − call(case, 1 step)) / (n − 1): a device call's own
overhead (dispatch, the loop's entry, the host fetch) cancels; dividing one call by its n
steps would charge it to every step. Goodput's draft + verify is then exactly the measured
drafted step, its plain arm the measured undrafted step, and its probe interval follows the
probe's real cost. Each case compiles one loop program (|buckets| + 2 in all; its one-step
call reuses it); the result is cached like the bare-forward table.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decode import programs
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.goodput.skip import DRAFTED, UNDRAFTED
from adaflash_jax.decode.state import init_state, policy_slots
from adaflash_jax.decode.verify_cost import (
    VerifyCostTable,
    cached_table,
    device_kind,
    keyed_path,
    model_key,
)

KIND = "engine-step/16"  # bump when the step program changes: cached tables go stale


def unit_table(slots: int, widths: tuple[int, ...]) -> VerifyCostTable:
    """Every width costs the same: goodput's table before anything is measured."""
    n = len(widths)
    return VerifyCostTable(rows=(slots,), widths=widths, verify_ms=((1.0,) * n,), draft_ms=(0.0,))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForcedStep(GoodputPolicy):
    """Calibration-only goodput: always drafts at `width` (or never drafts), keeping the
    estimates goodput would; probes only every `probe_every` steps (None: never)."""

    width: int
    draft: bool
    name = "forced"

    def speculate(self, state, active_B, *, buckets, switching):
        return jnp.asarray(self.draft)

    def probe_interval(self, state, active_B, *, buckets):
        every = jnp.iinfo(jnp.int32).max if self.probe_every is None else self.probe_every
        return jnp.asarray(every, jnp.int32)

    def widths(self, draft, state):
        _, state = super().widths(draft, state)
        return jnp.full(draft.active_B.shape, self.width, jnp.int32), state

    @classmethod
    def like(cls, goodput: GoodputPolicy, *, width: int, draft: bool) -> ForcedStep:
        """Forces `goodput`'s steps, keeping its estimator and deferred-context buffer; no
        probes."""
        fields = {f.name: getattr(goodput, f.name) for f in dataclasses.fields(GoodputPolicy)}
        fields.update(skip_draft=True, probe_every=None)
        return cls(**fields, width=width, draft=draft)


def _case_ms(engine, policy: ForcedStep, *, steps: int, seed: int) -> float:
    """ms of one device call running `steps` loop iterations over all slots, from a fresh
    prefill of random prompts (untimed) so every row stays active and inside the cache."""
    b, cap, k = engine.slots, engine.capacity, engine.block_size
    spec = dataclasses.replace(engine.spec, policy=policy)
    prompt_len = max(1, min(cap // 4, cap - k * (steps + 1)))
    target, drafter = engine.models
    state = init_state(
        engine.target,
        engine.drafter,
        policy.init(policy_slots(engine.target, engine.drafter, b)),
        slots=b,
        capacity=cap,
        eos_ids=(),  # no row may finish early: the loop must run all `steps`
        temperature=engine.temperature,
        top_p=engine.top_p,
        seed=seed,
    )
    prompts = np.random.default_rng(seed).integers(
        0, engine.target.config.vocab_size, (b, prompt_len)
    )
    state = programs.prefill_slots(
        target,
        drafter,
        state,
        jnp.arange(b, dtype=jnp.int32),
        jnp.asarray(prompts, jnp.int32),
        jnp.full((b,), prompt_len, jnp.int32),
        jnp.full((b,), cap - prompt_len - k, jnp.int32),
        spec=spec.prefill_spec,
    )
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state, ran, _, _ = programs.run_loop(
        target,
        drafter,
        state,
        jnp.asarray(False),
        jnp.asarray(steps, jnp.int32),
        spec=spec,
        program=DRAFTED if policy.draft else UNDRAFTED,
    )
    ran = int(jax.device_get(ran))
    elapsed = time.perf_counter() - t0
    if ran != steps:
        raise RuntimeError(f"calibration loop ran {ran} of {steps} steps")
    return 1e3 * elapsed


def calibrate_engine(engine, *, steps: int = 16, rounds: int = 6, seed: int = 0) -> VerifyCostTable:
    """The table for `engine` (its slots, capacity, buckets, sampling mode, models and its
    goodput policy's estimator and deferred-context buffer).

    Every case is timed once per round, rounds interleaved (a machine whose speed drifts
    slows all cases alike), after one compiling round; a case's cost is its fastest round
    (interference only ever adds time)."""
    k = engine.block_size
    steps = max(2, min(steps, (engine.capacity - 2) // (2 * k)))
    undrafted = ForcedStep.like(engine.policy, width=1, draft=False)
    kinds = [undrafted]
    kinds += [dataclasses.replace(undrafted, width=w, draft=True) for w in engine.buckets]
    # a probe after every undrafted step (its own program: the interval is static)
    kinds += [dataclasses.replace(undrafted, probe_every=1)]
    cases = [(kind, n) for kind in kinds for n in (steps, 1)]
    times = [[] for _ in cases]
    for r in range(rounds + 1):
        for i, (case, n) in enumerate(cases):
            ms = _case_ms(engine, case, steps=n, seed=seed + r)
            if r:  # round 0 compiles
                times[i].append(ms)
    fastest = [min(t) for t in times]
    calls = list(zip(fastest[::2], fastest[1::2]))  # (n steps, 1 step) per kind
    per_step = [max((many - one) / (steps - 1), 1e-3) for many, one in calls]
    plain, *drafted, probing = per_step
    at_1 = drafted[0] if engine.buckets[0] == 1 else plain
    draft = max(at_1 - plain, 0.0)
    verify = tuple(max(d - draft, 1e-3) for d in drafted)
    return VerifyCostTable(
        rows=(engine.slots,),
        widths=engine.buckets,
        verify_ms=(verify,),
        draft_ms=(draft,),
        switch_ms=max(calls[0][1] - plain, 0.0),
        probe_ms=max(probing - plain, 0.0),
        device=device_kind(),
        model=f"{KIND} slots {engine.slots} capacity {engine.capacity} "
        f"estimator {engine.policy.estimator} "
        f"{'greedy' if engine.spec.greedy else 'sampled'}",
    )


def cache_path(engine, *, cache_dir: str | None = None) -> str:
    key = [
        KIND,
        model_key(engine.target, engine.drafter),
        engine.slots,
        engine.buckets,
        engine.capacity,
        engine.policy.estimator,
        engine.spec.greedy,
        engine.spec.nucleus,
        engine.policy.pending_steps,
    ]
    return keyed_path("step-", engine.slots, key, cache_dir)


def load_or_calibrate_engine(engine, *, cache_dir: str | None = None) -> VerifyCostTable:
    """The cached engine-step table for this device, models and engine settings (`engine`
    runs a goodput policy; its table is not read), else a fresh calibration (then cached)."""
    return cached_table(cache_path(engine, cache_dir=cache_dir), lambda: calibrate_engine(engine))
