"""Lossless acceptance of a drafted block against the target's verify logits (docs/design.md §5).

Dimensions: B rows, K block size (verify positions: the bonus token + K−1 drafts), V vocab.

Verify position i (0-based) holds the target logits after [bonus, d_1..d_i]: its prediction
for the token draft d_{i+1} proposes. A row of requested width w_b accepts at most w_b − 1
drafts; its new bonus comes from position n_acc. Every acceptance function has one
signature, so tests can give the engine a deliberately biased one (`tests/doubles.py`):

    fn(key, drafts_BxKm1, q_BxKm1xV | None, logits_BxKxV, width_B, temperature, top_p)
        -> (accepted_B int32 in [0, width_B − 1], bonus_B int32)

Called in each verify branch with K = its width W; W = 1 (no drafts: the bonus from p at
position 0) must work. top_p None: no nucleus filter (`tokens.logits_to_probs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaflash_jax.decode.tokens import logits_to_probs


def _accepted(ok_BxKm1, width_B) -> jax.Array:
    """Leading run of accepted drafts per row, at most width_B − 1 [B] int32."""
    ok_BxKm1 &= jnp.arange(ok_BxKm1.shape[1], dtype=jnp.int32)[None, :] < width_B[:, None] - 1
    return jnp.sum(jnp.cumprod(ok_BxKm1.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def greedy_accept(key, drafts_BxKm1, q_BxKm1xV, logits_BxKxV, width_B, temperature, top_p):
    """Longest prefix of drafts equal to the target's argmax; bonus = argmax after it."""
    del key, q_BxKm1xV, temperature, top_p
    best_BxK = jnp.argmax(logits_BxKxV, axis=-1).astype(jnp.int32)
    accepted_B = _accepted(drafts_BxKm1 == best_BxK[:, :-1], width_B)
    bonus_B = jnp.take_along_axis(best_BxK, accepted_B[:, None], axis=1)[:, 0]
    return accepted_B, bonus_B


def target_probs(logits_BxKxV, temperature, top_p):
    """The target's sampling distribution at every verify position [B, K, V]."""
    b, k, v = logits_BxKxV.shape
    return logits_to_probs(logits_BxKxV.reshape(b * k, v), temperature, top_p).reshape(b, k, v)


def _residual_sample(key, p_BxV, q_BxV):
    """Draws from norm(max(0, p − q)); falls back to p where the residual has no mass (p == q
    up to rounding, so a rejection there had probability ~0)."""
    residual_BxV = jnp.maximum(p_BxV - q_BxV, 0.0)
    mass_B = jnp.sum(residual_BxV, axis=-1, keepdims=True)
    dist_BxV = jnp.where(mass_B > 1e-12, residual_BxV, p_BxV)
    return jax.random.categorical(key, jnp.log(dist_BxV), axis=-1).astype(jnp.int32)


def rejection_accept(key, drafts_BxKm1, q_BxKm1xV, logits_BxKxV, width_B, temperature, top_p):
    """Speculative sampling: accept d_i with prob min(1, p_i(d_i)/q_i(d_i)); at the first
    rejection draw from norm(max(0, p − q)); if all w−1 drafts pass, the bonus is from p.
    With q the distribution each draft was SAMPLED from (the same temperature/top-p as the
    target's), every committed token is distributed as plain sampling from the target."""
    b, k, _ = logits_BxKxV.shape
    p_BxKxV = target_probs(logits_BxKxV, temperature, top_p)
    p_draft_BxKm1 = jnp.take_along_axis(p_BxKxV[:, :-1], drafts_BxKm1[..., None], axis=-1)[..., 0]
    q_draft_BxKm1 = jnp.take_along_axis(q_BxKm1xV, drafts_BxKm1[..., None], axis=-1)[..., 0]
    key_u, key_r = jax.random.split(key)
    u_BxKm1 = jax.random.uniform(key_u, (b, k - 1))
    ok_BxKm1 = u_BxKm1 * q_draft_BxKm1 < p_draft_BxKm1  # u < p/q without dividing by q
    accepted_B = _accepted(ok_BxKm1, width_B)
    rows_B = jnp.arange(b)
    p_at_BxV = p_BxKxV[rows_B, accepted_B]
    # A rejection happened at position `accepted` unless the row accepted all its drafts;
    # then q is "absent" (zero) and the residual is p itself.
    if k == 1:  # nothing drafted: plain sampling from p
        return accepted_B, _residual_sample(key_r, p_at_BxV, jnp.zeros_like(p_at_BxV))
    rejected_B = accepted_B < width_B - 1
    q_at_BxV = jnp.where(
        rejected_B[:, None], q_BxKm1xV[rows_B, jnp.minimum(accepted_B, k - 2)], 0.0
    )
    return accepted_B, _residual_sample(key_r, p_at_BxV, q_at_BxV)
