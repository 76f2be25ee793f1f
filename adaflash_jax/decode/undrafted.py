"""The engine's undrafted steps, deferred drafter context and probes (docs/design.md §5.4).

Dimensions: B slots, K block size, U deferred context positions, nD concatenated target
features, S output buffer length.

An undrafted step is a plain step (requested width 0) whose token's target features wait in
`SpecState.undrafted` (U positions per row) instead of entering the drafter context: one
batched pass (`flush`) commits them when the drafted loop starts, before a probe, and when
the buffer fills, so its fixed costs are paid once per U steps. A probe is one drafter
forward without a verify: the policy's `widths` sees it (refreshing its estimates) and its
greedy drafts are graded after the fact against the tokens the next steps commit (in greedy
decoding exactly what verifying them would have accepted), an `Outcome` the policy observes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decode.drafting import draft
from adaflash_jax.decode.policy import Outcome
from adaflash_jax.decode.step import plain_step


def undrafted_step(target, s, spec):
    """A plain step whose token's features wait in the pending buffer (the caller keeps it
    from overflowing)."""
    active_B = ~s.done_B
    s, features_Bx1xnD = plain_step(target, s, spec, requested=0)
    u = s.undrafted
    b, cap, _ = u.pending_BxUxnD.shape
    at_B = jnp.where(active_B, u.pending_B, cap)  # inactive rows write nothing
    pending = u.pending_BxUxnD.at[jnp.arange(b), at_B].set(
        features_Bx1xnD[:, 0].astype(u.pending_BxUxnD.dtype), mode="drop"
    )
    u = u.replace(
        pending_BxUxnD=pending,
        pending_B=u.pending_B + active_B.astype(jnp.int32),
        steps=u.steps + 1,
    )
    return s.replace(undrafted=u)


def pending_full(s) -> jax.Array:
    u = s.undrafted
    return jnp.max(u.pending_B) >= u.pending_BxUxnD.shape[1]


def flush(drafter, s, when=True):
    """Commits every row's pending features into the drafter context (one batched pass over
    U positions) when any wait and `when` holds. Only what the flush changes passes the
    conditional."""
    u = s.undrafted

    def project():
        entries = drafter.context_entries(s.context_cache, u.pending_BxUxnD)
        return s.context_cache.commit(entries, u.pending_B), jnp.zeros_like(u.pending_B)

    ctx, pending_B = jax.lax.cond(
        jnp.any(u.pending_B > 0) & when, project, lambda: (s.context_cache, u.pending_B)
    )
    return s.replace(context_cache=ctx, undrafted=u.replace(pending_B=pending_B))


def probe_outcome(drafts_BxKm1, at_B, live_B, out_BxS, num_out_B):
    """How a probe's drafts (for output positions at_B[b] .. at_B[b] + K − 2) fared against
    the tokens committed since. Returns (realised_B: leading matches, width_B: 1 + positions
    committed so far, graded_B: live rows with at least one such position)."""
    b, km1 = drafts_BxKm1.shape
    s = out_BxS.shape[1]
    avail_B = jnp.clip(num_out_B - at_B, 0, km1)
    j_Km1 = jnp.arange(km1, dtype=jnp.int32)
    pos_BxKm1 = jnp.clip(at_B[:, None] + j_Km1[None, :], 0, s - 1)
    committed_BxKm1 = jnp.take_along_axis(out_BxS, pos_BxKm1, axis=1)
    match_BxKm1 = (committed_BxKm1 == drafts_BxKm1) & (j_Km1[None, :] < avail_B[:, None])
    realised_B = jnp.sum(jnp.cumprod(match_BxKm1.astype(jnp.int32), axis=1), axis=1)
    return realised_B, avail_B + 1, live_B & (avail_B > 0)


def grade_probe(s, spec):
    """Feeds the latest probe's outcome to the policy, before anything replaces the
    estimates it was made with."""
    u = s.undrafted
    realised_B, width_B, graded_B = probe_outcome(
        u.probe_drafts_BxKm1, u.probe_at_B, u.probe_live_B, s.out_BxS, s.num_out_B
    )
    outcome = Outcome(verified_B=graded_B, width_B=width_B, accepted_B=realised_B)
    return s.replace(
        policy_state=spec.policy.observe(outcome, s.policy_state),
        undrafted=u.replace(probe_live_B=u.probe_live_B & ~graded_B),
    )


def probe(target, drafter, s, spec):
    """One drafter forward that verifies nothing, after grading the previous probe: the
    policy sees it through `widths`; the context must be current (flushed)."""
    s = grade_probe(s, spec)
    d = draft(target, drafter, s, spec)
    _, policy_state = spec.policy.widths(d, s.policy_state)
    u = s.undrafted.replace(
        probe_drafts_BxKm1=jnp.argmax(d.logits_BxKm1xV, axis=-1).astype(jnp.int32),
        probe_at_B=s.num_out_B,
        probe_live_B=d.active_B,
        steps=jnp.zeros_like(s.undrafted.steps),
    )
    return s.replace(policy_state=policy_state, undrafted=u, probes=s.probes + 1)
