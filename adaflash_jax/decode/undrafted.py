"""The engine's undrafted steps, deferred drafter context and probes (docs/design.md §5.4).

Dimensions: B slots, K block size, Y a row's draft nodes (a tree's, or a chain's K − 1
positions), U deferred context positions, nD concatenated target features, S output buffer
length.

An undrafted step is a plain step (requested width 0) whose token's target features wait in
`SpecState.undrafted` (U positions per row) instead of entering the drafter context: one
batched pass (`flush`) commits them when the drafted loop starts, before a probe, and when
the buffer fills, so its fixed costs are paid once per U steps. A probe is one drafter
forward without a verify: the policy's `widths` sees it (refreshing its estimates) and its
drafts (a chain's greedy drafts, or the row's tree) are graded after the fact by walking them
along the tokens the next steps commit (in greedy decoding exactly what verifying them would
have accepted), an `Outcome` the policy observes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decode import tree
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


def chain_nodes(drafts_BxKm1):
    """A chain as a tree: (tokens, parents: the previous verify token, depths) [B, K − 1]."""
    b, km1 = drafts_BxKm1.shape
    j_BxKm1 = jnp.broadcast_to(jnp.arange(km1, dtype=jnp.int32), (b, km1))
    return drafts_BxKm1.astype(jnp.int32), j_BxKm1, j_BxKm1 + 1


def tree_nodes(t: tree.Tree, block_size: int):
    """A draft tree's nodes, an empty node at depth K (never graded)."""
    live_BxY = t.logp_BxY > tree.NO_NODE / 2
    return t.tokens_BxY, t.parent_BxY, jnp.where(live_BxY, t.depth_BxY, block_size)


def probe_outcome(tokens_BxY, parent_BxY, depth_BxY, at_B, live_B, out_BxS, num_out_B):
    """How a probe's nodes (verify tokens 1..Y under the root; a node at depth d drafts
    output position at_B[b] + d − 1) fared against the tokens committed since: the walk along
    them over the nodes, in order, before the first whose depth is not yet committed. Returns
    (realised_B: drafts the walk accepts, width_B: 1 + those nodes, graded_B: live rows with
    at least one such node)."""
    n, s = tokens_BxY.shape[1], out_BxS.shape[1]
    avail_B = jnp.maximum(num_out_B - at_B, 0)
    known_BxY = jnp.cumprod((depth_BxY <= avail_B[:, None]).astype(jnp.int32), axis=1)
    width_B = 1 + jnp.sum(known_BxY, axis=1)
    # the target's token at each verify token (the root at depth 0): the committed one
    depth_BxW = jnp.concatenate([jnp.zeros_like(depth_BxY[:, :1]), depth_BxY], axis=1)
    pos_BxW = jnp.clip(at_B[:, None] + depth_BxW, 0, s - 1)
    committed_BxW = jnp.take_along_axis(out_BxS, pos_BxW, axis=1)
    target_BxW = jnp.where(depth_BxW < avail_B[:, None], committed_BxW, -1)
    root_Bx1 = jnp.zeros_like(tokens_BxY[:, :1])
    tokens_BxW = jnp.concatenate([root_Bx1, tokens_BxY], axis=1)
    parent_BxW = jnp.concatenate([root_Bx1, parent_BxY], axis=1)
    realised_B, _, _ = tree.walk(tokens_BxW, parent_BxW, target_BxW, width_B, n)
    return realised_B, width_B, live_B & (width_B > 1)


def grade_probe(s, spec):
    """Feeds the latest probe's outcome to the policy, before anything replaces the
    estimates it was made with."""
    u = s.undrafted
    realised_B, width_B, graded_B = probe_outcome(
        u.probe_tokens_BxY,
        u.probe_parent_BxY,
        u.probe_depth_BxY,
        u.probe_at_B,
        u.probe_live_B,
        s.out_BxS,
        s.num_out_B,
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
    d = draft(target, drafter, s, spec, jax.random.fold_in(s.rng, s.probes))  # sampled trees
    _, policy_state = spec.policy.widths(d, s.policy_state)
    if d.tree is None:
        tokens_BxY, parent_BxY, depth_BxY = chain_nodes(jnp.argmax(d.logits_BxKm1xV, axis=-1))
    else:
        tokens_BxY, parent_BxY, depth_BxY = tree_nodes(d.tree, spec.block_size)
    u = s.undrafted.replace(
        probe_tokens_BxY=tokens_BxY,
        probe_parent_BxY=parent_BxY,
        probe_depth_BxY=depth_BxY,
        probe_at_B=s.num_out_B,
        probe_live_B=d.active_B,
        steps=jnp.zeros_like(s.undrafted.steps),
    )
    return s.replace(policy_state=policy_state, undrafted=u, probes=s.probes + 1)
