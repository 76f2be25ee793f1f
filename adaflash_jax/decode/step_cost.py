"""Goodput's cost table measured on the engine's OWN jitted step, not on bare forwards.

Dimensions: B slots, K block size, W verify width (a bucket).

Why: the engine's step is more than a target forward plus a drafter forward — it samples,
accepts, commits, appends the committed features to the drafter context and keeps its
statistics, always over all B slots (finished and free slots ride along masked). Measured on
the CPU, bare forwards put the width-1 verify at 2.1 ms while the engine's plain step took
1.3 ms, and one draft + 8-wide verify at 5.8 ms while the engine's step took 6.7–8.4 ms
(BENCHMARKS.md): ratios off by 2×, enough to make goodput draft where a plain step is faster.

So the calibration runs the engine's `run_loop` over a few steps with calibration-only
policies that force each case — the undrafted (plain) loop program, and the drafted one at
each width W, computing the same estimator as goodput — then writes a table with one row
count (B: the step's cost does not depend on how many slots are active):

    draft_ms   = step(drafted, W = 1) − step(undrafted)      (clamped at 0)
    verify_ms[W] = step(drafted, W) − draft_ms               (so verify_ms[1] = step(undrafted))
    switch_ms  = call(undrafted, 1 step) − step(undrafted)   (a device call's own overhead)
    probe_ms   = step(undrafted, a probe after each) − step(undrafted)

where step(case) = (call(case, n steps) − call(case, 1 step)) / (n − 1): a device call's own
overhead (dispatch, the loop's entry, the host fetch) cancels. Dividing one call by its n
steps instead charged that overhead to every step: at one slot on the CPU, where a call of
the 144-token cache fits 8 drafted steps, it put the plain step at 1.3 ms against 0.55–0.8 ms
in a running loop, which made drafting look cheaper relative to plain steps than it is.

and goodput's draft + verify is exactly the measured drafted step, its plain arm exactly the
measured undrafted step; its probe interval follows the probe's real cost (on the CPU at one
slot a probe cost ~2–4 ms in the loop against a 1.3 ms draft forward in the table). Each case
compiles one loop program (|buckets| + 2 in all; its one-step call reuses it); the result is
cached like the forward table.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decode import speculative as sp
from adaflash_jax.decode.policies import PolicyInput, ReadsEstimator, accept_probs
from adaflash_jax.decode.verify_cost import (
    VerifyCostTable,
    cached_table,
    device_kind,
    keyed_path,
    model_key,
)

KIND = "engine-step/15"  # bump when the step program changes: cached tables go stale


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForcedStep(ReadsEstimator):
    """Calibration-only policy: always drafts at `width` (or never drafts), computing the
    same acceptance estimate goodput would."""

    width: int
    draft: bool
    estimator: str = "confidence"
    probe_every: int | None = None  # None: no probes (the measured steps run unbroken)
    name = "forced"
    skip_draft = True

    def validate(self, **_):
        pass

    def speculate(
        self, accept_BxKm1, active_B, undrafted, *, buckets, log_gamma=0.0, switching=False
    ):
        return jnp.asarray(self.draft)

    def probe_interval(self, num_running, buckets, **_):
        every = jnp.iinfo(jnp.int32).max if self.probe_every is None else self.probe_every
        return jnp.asarray(every, jnp.int32)

    def decide(self, inp: PolicyInput, *, block_size: int, buckets: tuple[int, ...]):
        a_BxKm1 = accept_probs(inp, self.estimator, block_size)
        return jnp.full(inp.active_B.shape, self.width, jnp.int32), a_BxKm1

    def widths(self, inp: PolicyInput, *, block_size: int, buckets: tuple[int, ...]):
        return self.decide(inp, block_size=block_size, buckets=buckets)[0]


def _call_ms(engine, spec, *, steps: int, seed: int) -> float:
    """ms of one device call running `steps` loop iterations over all slots, from a fresh
    prefill of random prompts (untimed) so every row stays active and inside the cache."""
    b, cap, k = engine.slots, engine.capacity, engine.block_size
    prompt_len = max(1, min(cap // 4, cap - k * (steps + 1)))
    models = engine._models()
    rng = np.random.default_rng(seed)
    state = sp.init_state(
        engine.target,
        engine.drafter,
        slots=b,
        capacity=cap,
        eos_ids=(),  # no row may finish early: the loop must run all `steps`
        temperature=engine.temperature,
        top_p=engine.top_p,
        seed=seed,
        pending=engine.pending_steps if spec.skip_draft else 0,
    )
    prompts = rng.integers(0, engine.target.config.vocab_size, size=(b, prompt_len))
    state = sp.prefill_slots(
        *models,
        state,
        jnp.arange(b, dtype=jnp.int32),
        jnp.asarray(prompts, jnp.int32),
        jnp.full((b,), prompt_len, jnp.int32),
        jnp.full((b,), cap - prompt_len - k, jnp.int32),
        spec=spec,
    )
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state, ran, _, _ = sp.run_loop(
        *models, state, jnp.asarray(False), jnp.asarray(steps, jnp.int32), spec=spec
    )
    ran = int(jax.device_get(ran))
    elapsed = time.perf_counter() - t0
    if ran != steps:
        raise RuntimeError(f"calibration loop ran {ran} of {steps} steps")
    return 1e3 * elapsed


def _case_ms(engine, policy: ForcedStep, **kw) -> float:
    spec = dataclasses.replace(
        engine.spec,
        policy=policy,
        use_length_head=policy.needs_length_head,
        use_accept_head=policy.needs_accept_head,
        undrafted_mode=not policy.draft,
    )
    return _call_ms(engine, spec, **kw)


def calibrate_engine(
    engine, *, estimator: str = "confidence", steps: int = 16, rounds: int = 6, seed: int = 0
) -> VerifyCostTable:
    """The table for `engine` (its slots, capacity, buckets, sampling mode and models).

    Every case is timed once per round, rounds interleaved (a machine whose speed drifts
    slows all cases alike), after one compiling round; a case's cost is its fastest round
    (interference only ever adds time)."""
    k = engine.block_size
    steps = max(2, min(steps, (engine.capacity - 2) // (2 * k)))
    undrafted = ForcedStep(width=1, draft=False, estimator=estimator)
    kinds = [undrafted]
    kinds += [ForcedStep(width=w, draft=True, estimator=estimator) for w in engine.buckets]
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
        model=f"{KIND} slots {engine.slots} capacity {engine.capacity} estimator {estimator} "
        f"{'greedy' if engine.spec.greedy else 'sampled'}",
    )


def cache_path(engine, *, estimator: str, cache_dir: str | None = None) -> str:
    key = [
        KIND,
        model_key(engine.target, engine.drafter),
        engine.slots,
        engine.buckets,
        engine.capacity,
        estimator,
        engine.spec.greedy,
        engine.spec.nucleus,
        engine.pending_steps,
    ]
    return keyed_path("step-", engine.slots, key, cache_dir)


def load_or_calibrate_engine(
    engine, *, estimator: str = "confidence", cache_dir: str | None = None
) -> VerifyCostTable:
    """The cached engine-step table for this device, models and engine settings, else a
    fresh calibration (then cached)."""
    path = cache_path(engine, estimator=estimator, cache_dir=cache_dir)
    return cached_table(path, lambda: calibrate_engine(engine, estimator=estimator))
