"""Choosing and committing tokens: the sampling distribution, one token per row, and the
append of committed tokens to each row's output (EOS and max-new-tokens stops).

Dimensions: B rows, V vocab, T tokens committed per row at once, S output buffer length,
E eos ids.

`logits_to_probs` IS the distribution `pick_tokens` draws from and rejection sampling
verifies against, so lossless speculative decoding reproduces plain sampling exactly.
Temperature 0 is the greedy limit: a one-hot at the (first) argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _per_row(value, batch: int) -> jax.Array:
    """A python scalar or [B] array as a float32 [B] array."""
    return jnp.broadcast_to(jnp.asarray(value, jnp.float32), (batch,))


def logits_to_probs(logits_BxV: jax.Array, temperature, top_p=None) -> jax.Array:
    """Sampling distribution [B, V] (float32) for temperature and top-p, scalar or per row.

    Top-p keeps the smallest head of the sorted distribution whose mass reaches `top_p`
    (always at least the most likely token); tokens tied with the last kept probability are
    kept too, so the set does not depend on how the sort breaks ties. `top_p >= 1` keeps all;
    a static `None` or python `top_p >= 1` skips the sort over the vocabulary.
    """
    b, v = logits_BxV.shape
    temp_B = _per_row(temperature, b)
    logits_BxV = logits_BxV.astype(jnp.float32)
    greedy_B = temp_B <= 0.0
    safe_temp_B = jnp.where(greedy_B, 1.0, temp_B)
    probs_BxV = jax.nn.softmax(logits_BxV / safe_temp_B[:, None], axis=-1)
    one_hot_BxV = jax.nn.one_hot(jnp.argmax(logits_BxV, axis=-1), v, dtype=jnp.float32)
    if top_p is None or (isinstance(top_p, int | float) and top_p >= 1.0):  # static: no sort
        return jnp.where(greedy_B[:, None], one_hot_BxV, probs_BxV)
    top_p_B = _per_row(top_p, b)
    sorted_BxV = -jnp.sort(-probs_BxV, axis=-1)  # descending
    mass_before_BxV = jnp.cumsum(sorted_BxV, axis=-1) - sorted_BxV
    in_nucleus_BxV = mass_before_BxV < top_p_B[:, None]
    in_nucleus_BxV = in_nucleus_BxV.at[:, 0].set(True)
    # Smallest probability inside the nucleus: the keep threshold.
    threshold_B = jnp.min(jnp.where(in_nucleus_BxV, sorted_BxV, jnp.inf), axis=-1)
    keep_BxV = (probs_BxV >= threshold_B[:, None]) | (top_p_B[:, None] >= 1.0)
    nucleus_BxV = jnp.where(keep_BxV, probs_BxV, 0.0)
    nucleus_BxV = nucleus_BxV / jnp.sum(nucleus_BxV, axis=-1, keepdims=True)
    return jnp.where(greedy_B[:, None], one_hot_BxV, nucleus_BxV)


def pick_tokens(key, logits_BxV, temperature, top_p=None, *, greedy: bool = False):
    """One token per row [B] int32: the argmax when `greedy` (static), else a draw from
    `logits_to_probs` (a row at temperature 0 draws its argmax)."""
    if greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    probs_BxV = logits_to_probs(logits_BxV, temperature, top_p)
    # log(0) = -inf removes filtered tokens exactly; categorical never draws them.
    return jax.random.categorical(key, jnp.log(probs_BxV), axis=-1).astype(jnp.int32)


def append_tokens(out_BxS, num_out_B, done_B, tokens_BxT, n_B, active_B, max_new_B, eos_E):
    """Appends each active row's first `n_B` tokens, cut after the first EOS (kept) or at
    its max-new-tokens; a row that hit either is done. Returns (out, num_out, done)."""
    b, t = tokens_BxT.shape
    j_T = jnp.arange(t, dtype=jnp.int32)[None, :]
    is_eos_BxT = jnp.any(tokens_BxT[..., None] == eos_E[None, None, :], axis=-1)
    is_eos_BxT &= j_T < n_B[:, None]
    first_eos_B = jnp.where(jnp.any(is_eos_BxT, axis=1), jnp.argmax(is_eos_BxT, axis=1), t)
    keep_B = jnp.minimum(jnp.minimum(n_B, max_new_B - num_out_B), first_eos_B + 1)
    keep_B = jnp.where(active_B, keep_B, 0)
    slot_BxT = jnp.where(j_T < keep_B[:, None], num_out_B[:, None] + j_T, out_BxS.shape[1])
    out_BxS = out_BxS.at[jnp.arange(b)[:, None], slot_BxT].set(tokens_BxT, mode="drop")
    num_out_B = num_out_B + keep_B
    hit_eos_B = first_eos_B < keep_B
    done_B = done_B | (active_B & (hit_eos_B | (num_out_B >= max_new_B)))
    return out_BxS, num_out_B, done_B
