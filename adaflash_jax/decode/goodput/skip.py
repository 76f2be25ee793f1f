"""Goodput's "don't speculate" arm: two loop programs the engine switches between.

Dimensions: B slots, K block size, U deferred context positions, nD concatenated target
features, S output buffer length.

`drafted_loop` runs drafted steps while the policy says drafting pays (after bringing the
drafter context up to date and grading the latest probe). `undrafted_loop` runs plain steps
(requested width 0) with a probe (one drafter forward, no verify) every `probe_interval`
steps to refresh the rows' estimates; it asks the policy only between runs of steps (after
a probe, a flush or a finished row): nothing the decision reads changes within a run, and
asking in every step's loop check costs the undrafted step. Each program exits when the
policy wants the other and the host switches, so no step pays for a conditional around the
drafter (nor for the cache copies XLA makes around conditionally updated buffers).

Undrafted steps defer the drafter context: each parks its token's target features in a
buffer of U positions per row (`context_cache.lengths + pending_B == target_cache.lengths`),
projected into the context in one batched pass (`flush`) when the drafted program starts,
before a probe, and when it fills (one pass per U steps amortises its fixed costs). A probe
is graded after the fact: its greedy drafts against the tokens the next undrafted steps
commit (in greedy decoding, exactly what verifying it would have accepted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decode.drafting import draft
from adaflash_jax.decode.goodput.calibration import probe_outcome
from adaflash_jax.decode.policy import Outcome
from adaflash_jax.decode.step import admit, counting, drafted_step, may_continue, plain_step

UNDRAFTED, DRAFTED = 0, 1  # program indices: GoodputPolicy.programs


def wants_draft(s, spec, switching: bool):
    """Whether the policy drafts next; `switching`: asked from the undrafted program."""
    return spec.policy.speculate(
        s.policy_state,
        ~s.done_B,
        buckets=spec.buckets,
        switching=switching,
        token_buckets=spec.token_buckets,
    )


def undrafted_step(target, s, spec):
    """A plain step whose token's features wait in the pending buffer (the caller keeps it
    from overflowing)."""
    active_B = ~s.done_B
    s, features_Bx1xnD = plain_step(target, s, spec, requested=0)
    p = s.policy_state
    b, u, _ = p.pending_BxUxnD.shape
    at_B = jnp.where(active_B, p.pending_B, u)  # inactive rows write nothing
    pending = p.pending_BxUxnD.at[jnp.arange(b), at_B].set(
        features_Bx1xnD[:, 0].astype(p.pending_BxUxnD.dtype), mode="drop"
    )
    p = p.replace(
        pending_BxUxnD=pending,
        pending_B=p.pending_B + active_B.astype(jnp.int32),
        undrafted=p.undrafted + 1,
    )
    return s.replace(policy_state=p)


def pending_full(s) -> jax.Array:
    p = s.policy_state
    return jnp.max(p.pending_B) >= p.pending_BxUxnD.shape[1]


def flush(drafter, s, when=True):
    """Projects every row's pending features into the drafter context (one batched pass over
    U positions; entries past a row's count are written but stay masked) when any wait and
    `when` holds. Only what the flush changes passes the conditional."""
    p = s.policy_state

    def project():
        entries = drafter.context_entries(s.context_cache, p.pending_BxUxnD)
        return s.context_cache.commit(entries, p.pending_B), jnp.zeros_like(p.pending_B)

    ctx, pending_B = jax.lax.cond(
        jnp.any(p.pending_B > 0) & when, project, lambda: (s.context_cache, p.pending_B)
    )
    return s.replace(context_cache=ctx, policy_state=p.replace(pending_B=pending_B))


def grade_probe(s, spec):
    """Feeds the latest probe's outcome to the policy, before anything replaces the
    estimates it was made with."""
    p = s.policy_state
    realised_B, width_B, graded_B = probe_outcome(
        p.probe_drafts_BxKm1, p.probe_at_B, p.probe_live_B, s.out_BxS, s.num_out_B
    )
    outcome = Outcome(verified_B=graded_B, width_B=width_B, accepted_B=realised_B)
    p = spec.policy.observe(outcome, p)
    return s.replace(policy_state=p.replace(probe_live_B=p.probe_live_B & ~graded_B))


def probe(target, drafter, s, spec):
    """Refreshes the rows' estimates from one drafter forward without verifying, after
    grading the previous probe; the context must be current (flushed)."""
    s = grade_probe(s, spec)
    d = draft(target, drafter, s, spec)
    _, p = spec.policy.widths(d, s.policy_state)
    p = p.replace(
        probe_drafts_BxKm1=jnp.argmax(d.logits_BxKm1xV, axis=-1).astype(jnp.int32),
        probe_at_B=s.num_out_B,
        probe_live_B=d.active_B,
    )
    return s.replace(policy_state=p, probes=s.probes + 1)


def _probe_due(s):
    return s.policy_state.undrafted >= s.policy_state.probe_due_at


def _between_runs(target, drafter, s, spec):
    """Flushes the context for a due probe or a full buffer, probes if due, and sets the
    next probe's interval (decided here, between runs of steps, not in every step)."""
    s = flush(drafter, s, _probe_due(s) | pending_full(s))

    def small(s):  # what a probe changes: no cache or feature buffer flows through the cond
        return s.probes, s.policy_state.replace(pending_BxUxnD=None)

    probes, p = jax.lax.cond(
        _probe_due(s), lambda: small(probe(target, drafter, s, spec)), lambda: small(s)
    )
    p = p.replace(pending_BxUxnD=s.policy_state.pending_BxUxnD)
    interval = spec.policy.probe_interval(
        p, ~s.done_B, buckets=spec.buckets, token_buckets=spec.token_buckets
    )
    return s.replace(probes=probes, policy_state=p.replace(probe_due_at=interval))


def undrafted_loop(target, drafter, s, spec, stop_on_finish, max_steps):
    """Runs of undrafted steps, each until the buffer fills, a probe is due, a row finishes
    or the loop would stop, while the policy does not want to draft. A due probe (e.g.
    before any drafter forward) comes before the first decision."""
    step = counting(lambda s: undrafted_step(target, s, spec))

    def run(carry):
        finished0 = carry[2]

        def more(c):
            ok = may_continue(c, stop_on_finish, max_steps) & (c[2] == finished0)
            return ok & ~pending_full(c[0]) & ~_probe_due(c[0])

        s, it, finished = jax.lax.while_loop(more, step, carry)
        return _between_runs(target, drafter, s, spec), it, finished

    def undrafted(c):
        return may_continue(c, stop_on_finish, max_steps) & ~wants_draft(c[0], spec, True)

    carry = (_between_runs(target, drafter, admit(s, spec), spec), jnp.int32(0), jnp.int32(0))
    s, steps, finished = jax.lax.while_loop(undrafted, run, carry)
    return s, steps, finished, _next(s, spec, True)


def drafted_loop(target, drafter, s, spec, stop_on_finish, max_steps):
    """Drafted steps while the policy wants them (the context flushed, the latest probe
    graded on entry)."""
    s = grade_probe(flush(drafter, admit(s, spec)), spec)

    def drafting(c):
        return may_continue(c, stop_on_finish, max_steps) & wants_draft(c[0], spec, False)

    step = counting(lambda s: drafted_step(target, drafter, s, spec))
    s, steps, finished = jax.lax.while_loop(drafting, step, (s, jnp.int32(0), jnp.int32(0)))
    return s, steps, finished, _next(s, spec, False)


def _next(s, spec, switching: bool):
    return jnp.where(wants_draft(s, spec, switching), DRAFTED, UNDRAFTED)
