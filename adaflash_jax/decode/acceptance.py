"""Lossless acceptance of drafted blocks against the target's verify logits (docs/design.md §5).

Dimensions: B rows, K block size (verify positions: the bonus token + K−1 drafts), V vocab,
M verify tokens (the step's tokens in the packed layout, `model/packing.py`; B·W padded).

Verify position i (0-based) of a row holds the target logits after [bonus, d_1..d_i]: its
prediction for the token draft d_{i+1} proposes. A row of requested width w_b accepts at
most w_b − 1 drafts; its new bonus comes from position n_acc. Acceptance works per verify
token, then per row (`accept`): a token-wise rule says whether the draft after each position
passes and which bonus that position would give, and a row's accepted count is its leading
run of passes. Every token-wise rule has one signature, so tests can give the engine a
deliberately biased one (`tests/doubles.py`):

    fn(key, next_M, q_MxV | None, logits_MxV, last_M, temperature, top_p)
        -> (ok_M bool, candidate_M int32)

next_M: the draft after the position; q_MxV: the distribution it was sampled from (None:
greedy, or nothing drafted); last_M: the row's last verified position (no draft to verify;
a sampled bonus comes from p alone). top_p None: no nucleus filter (`tokens.logits_to_probs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decode.tokens import logits_to_probs


def accept(fn, key, layout, tokens_BxK, q_BxKm1xV, logits_MxV, width_B, temperature, top_p):
    """(accepted_B int32 in [0, w_b − 1], bonus_B int32) of the rows whose verify tokens sit
    in `layout` (a `Packing`: the packed stream, or `Packing.dense` for the row layout) with
    their logits `logits_MxV`, under the token-wise rule `fn`. A width-0 row accepts 0."""
    k = tokens_BxK.shape[1]
    row_M, col_M = layout.row_M, layout.col_M
    next_M = tokens_BxK[row_M, jnp.minimum(col_M + 1, k - 1)]
    last_M = col_M >= jnp.minimum(width_B[row_M], layout.row_width) - 1
    q_MxV = None if q_BxKm1xV is None or k == 1 else q_BxKm1xV[row_M, jnp.minimum(col_M, k - 2)]
    ok_M, candidate_M = fn(key, next_M, q_MxV, logits_MxV, last_M, temperature, top_p)
    ok_BxW = layout.unpack(ok_M & ~last_M, fill=False)
    accepted_B = jnp.sum(jnp.cumprod(ok_BxW.astype(jnp.int32), axis=1), axis=1)
    candidate_BxW = layout.unpack(candidate_M.astype(jnp.int32))
    bonus_B = jnp.take_along_axis(candidate_BxW, accepted_B[:, None], axis=1)[:, 0]
    return accepted_B.astype(jnp.int32), bonus_B


def greedy_accept(key, next_M, q_MxV, logits_MxV, last_M, temperature, top_p):
    """A draft passes if it is the target's argmax; the bonus is the argmax."""
    del key, q_MxV, last_M, temperature, top_p
    best_M = jnp.argmax(logits_MxV, axis=-1).astype(jnp.int32)
    return next_M == best_M, best_M


def _residual_sample(key, p_MxV, q_MxV):
    """Draws from norm(max(0, p − q)); falls back to p where the residual has no mass (p == q
    up to rounding, so a rejection there had probability ~0)."""
    residual_MxV = jnp.maximum(p_MxV - q_MxV, 0.0)
    mass_M = jnp.sum(residual_MxV, axis=-1, keepdims=True)
    dist_MxV = jnp.where(mass_M > 1e-12, residual_MxV, p_MxV)
    return jax.random.categorical(key, jnp.log(dist_MxV), axis=-1).astype(jnp.int32)


def rejection_accept(key, next_M, q_MxV, logits_MxV, last_M, temperature, top_p):
    """Speculative sampling: the draft passes with prob min(1, p(d)/q(d)); the bonus at the
    first rejection is drawn from norm(max(0, p − q)), and after a row's last position (all
    its drafts passed) from p. With q the distribution each draft was SAMPLED from (the same
    temperature/top-p as the target's), every committed token is distributed as plain
    sampling from the target."""
    p_MxV = logits_to_probs(logits_MxV, temperature, top_p)
    if q_MxV is None:  # nothing drafted: plain sampling from p
        q_MxV = jnp.zeros_like(p_MxV)
        last_M = jnp.ones_like(last_M)
    p_next_M = jnp.take_along_axis(p_MxV, next_M[:, None], axis=-1)[:, 0]
    q_next_M = jnp.take_along_axis(q_MxV, next_M[:, None], axis=-1)[:, 0]
    key_u, key_r = jax.random.split(key)
    ok_M = jax.random.uniform(key_u, next_M.shape) * q_next_M < p_next_M  # u < p/q, no divide
    # a rejection happens at a position unless it is the row's last: then q is "absent"
    # (zero) and the residual is p itself
    q_at_MxV = jnp.where(last_M[:, None], 0.0, q_MxV)
    return ok_M & ~last_M, _residual_sample(key_r, p_MxV, q_at_MxV)
