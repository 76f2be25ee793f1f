"""One engine step for all slots: drafted or plain (docs/design.md §5).

Dimensions: B slots, K block size, W verify width (a bucket), S cache capacity.

A drafted step: the drafter proposes K−1 tokens after each row's bonus, the policy asks for
widths, the target verifies at the bucket, row b accepts n_b drafts and commits n_b + 1
tokens (drafts + a new bonus); both caches commit them in one place (`Cache.commit`): the
rejected rest is never committed. On a hybrid target that commit also replays each row's
n_b + 1 accepted tokens through its Gated DeltaNet states (docs/design.md §5.2), so no state
is kept per verified position. A plain step (no drafter, or a policy's undrafted step) runs
the target over each row's bonus in "write" cache mode and picks the next token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decode.drafting import draft, draft_probs, sample_drafts
from adaflash_jax.decode.policy import Outcome
from adaflash_jax.decode.state import EngineSpec, SpecState
from adaflash_jax.decode.tokens import append_tokens, pick_tokens
from adaflash_jax.decode.verify import verify


def commit_tokens(s: SpecState, tokens_BxT, n_B, active_B) -> SpecState:
    out_BxS, num_out_B, done_B = append_tokens(
        s.out_BxS, s.num_out_B, s.done_B, tokens_BxT, n_B, active_B, s.max_new_B, s.eos_E
    )
    return s.replace(out_BxS=out_BxS, num_out_B=num_out_B, done_B=done_B)


def record(s: SpecState, active_B, accepted_B, width, request_B) -> SpecState:
    """Appends one step's statistics to each active row's buffers; `width` is the verify
    width, one for the batch or [B]."""
    b, c = s.accepted_BxS.shape
    rows_B, at_B = jnp.arange(b), jnp.where(active_B, s.steps_B, c)
    return s.replace(
        accepted_BxS=s.accepted_BxS.at[rows_B, at_B].set(accepted_B, mode="drop"),
        width_BxS=s.width_BxS.at[rows_B, at_B].set(jnp.broadcast_to(width, (b,)), mode="drop"),
        request_BxS=s.request_BxS.at[rows_B, at_B].set(request_B, mode="drop"),
        steps_B=s.steps_B + active_B.astype(jnp.int32),
    )


def drafted_step(target, drafter, s: SpecState, spec: EngineSpec) -> SpecState:
    """Draft → widths → verify → accept → commit for all slots. With `spec.tree` the rows
    verify trees (`decode/tree.py`) and commit the path their walk accepted."""
    active_B = ~s.done_B
    rng, key_draft, key_accept = jax.random.split(s.rng, 3)
    d = draft(target, drafter, s, spec, key_draft)
    width_B, policy_state = spec.policy.widths(d, s.policy_state)
    if d.tree is None:
        width_B = jnp.clip(width_B, 1, spec.buckets[-1])
        drafts_BxKm1, q_BxKm1xV = sample_drafts(key_draft, d.logits_BxKm1xV, s, spec)
        tokens_BxW = jnp.concatenate([s.bonus_B[:, None], drafts_BxKm1], axis=1)
        parent_BxW = None
    else:  # the tree's candidates came with the draft (drawn from q when sampling)
        width_B = jnp.clip(width_B, 1, 1 + d.tree.size_B)
        tokens_BxW, parent_BxW = d.tree.verify_tokens(s.bonus_B)
        q_BxKm1xV = None if spec.greedy else draft_probs(d.logits_BxKm1xV, s, spec)
    width_B = jnp.where(active_B, width_B, 0).astype(jnp.int32)
    candidates = None if d.tree is None else d.tree.candidates_BxKm1xKc
    accepted_B, bonus_B, path_BxZ, target_entries, context_entries, bucket = verify(
        target, drafter, s, spec, tokens_BxW, (parent_BxW, candidates), q_BxKm1xV, width_B,
        key_accept,
    )  # fmt: skip
    accepted_B = jnp.where(active_B, accepted_B, 0)
    j_K = jnp.arange(spec.block_size, dtype=jnp.int32)[None, :]
    walked_BxK = tokens_BxW if path_BxZ is None else jnp.take_along_axis(tokens_BxW, path_BxZ, 1)
    drafts_BxK = jnp.concatenate([walked_BxK[:, 1:], jnp.zeros_like(walked_BxK[:, :1])], axis=1)
    committed_BxK = jnp.where(j_K < accepted_B[:, None], drafts_BxK, bonus_B[:, None])
    advance_B = jnp.where(active_B, accepted_B + 1, 0)
    s = commit_tokens(s, committed_BxK, accepted_B + 1, active_B)
    s = record(s, active_B, accepted_B, width_B if spec.packed else bucket, width_B)
    b = width_B.shape[0]
    computed = bucket if spec.packed else b * bucket
    s = s.replace(verified=s.verified + jnp.sum(width_B), computed=s.computed + computed)
    outcome = Outcome(verified_B=active_B, width_B=width_B, accepted_B=accepted_B)
    return s.replace(
        target_cache=s.target_cache.commit(target_entries, advance_B, path_BxZ),
        context_cache=s.context_cache.commit(context_entries, advance_B),
        bonus_B=jnp.where(active_B, bonus_B, s.bonus_B),
        undrafted=s.undrafted.replace(steps=jnp.zeros_like(s.undrafted.steps)),
        policy_state=spec.policy.observe(outcome, policy_state),
        rng=rng,
    )


def plain_step(target, s: SpecState, spec: EngineSpec, *, requested: int):
    """One target token per active row, the target cache written in place; recorded as a
    step of width 1 and requested width `requested`. Returns (state, the committed token's
    target features [B, 1, nD], None without feature layers)."""
    active_B = ~s.done_B
    rng, _, key = jax.random.split(s.rng, 3)
    advance_B = active_B.astype(jnp.int32)
    out = target(
        s.bonus_B[:, None],
        cache=s.target_cache,
        num_new_B=advance_B,
        feature_layers=spec.feature_layers,
        rows=spec.rows,
    )
    logits_BxV = out.logits_BxTxV[:, 0].astype(jnp.float32)
    tok_B = pick_tokens(key, logits_BxV, s.temperature, spec.top_p(s), greedy=spec.greedy)
    s = commit_tokens(s, tok_B[:, None], jnp.ones_like(advance_B), active_B)
    s = record(s, active_B, jnp.zeros_like(advance_B), 1, jnp.full_like(advance_B, requested))
    s = s.replace(target_cache=out.cache, bonus_B=jnp.where(active_B, tok_B, s.bonus_B), rng=rng)
    return s, out.features_BxTxnD
