"""Token sampling: temperature, top-p (nucleus) and greedy, as pure functions.

Dimensions: B rows, V vocab.

`logits_to_probs` IS the distribution `sample_tokens` draws from, so lossless speculative
decoding (rejection sampling against these probabilities) reproduces plain sampling exactly.
Temperature 0 is the greedy limit: a one-hot at the argmax (the first one, on ties).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _per_row(value, batch: int) -> jax.Array:
    """A python scalar or [B] array as a float32 [B] array."""
    return jnp.broadcast_to(jnp.asarray(value, jnp.float32), (batch,))


def logits_to_probs(logits_BxV: jax.Array, temperature, top_p=1.0) -> jax.Array:
    """Sampling distribution [B, V] (float32) for temperature and top-p, scalar or per row.

    Top-p keeps the smallest head of the sorted distribution whose mass reaches `top_p`
    (always at least the most likely token); tokens tied with the last kept probability are
    kept too, so the set does not depend on how the sort breaks ties. `top_p >= 1` keeps all.
    """
    b, v = logits_BxV.shape
    temp_B = _per_row(temperature, b)
    top_p_B = _per_row(top_p, b)
    logits_BxV = logits_BxV.astype(jnp.float32)
    greedy_B = temp_B <= 0.0
    safe_temp_B = jnp.where(greedy_B, 1.0, temp_B)
    probs_BxV = jax.nn.softmax(logits_BxV / safe_temp_B[:, None], axis=-1)
    one_hot_BxV = jax.nn.one_hot(jnp.argmax(logits_BxV, axis=-1), v, dtype=jnp.float32)
    if isinstance(top_p, int | float) and top_p >= 1.0:  # static: no nucleus, no sort
        return jnp.where(greedy_B[:, None], one_hot_BxV, probs_BxV)

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


def sample_tokens(key: jax.Array, logits_BxV: jax.Array, temperature, top_p=1.0) -> jax.Array:
    """Draws one token per row [B] int32 from `logits_to_probs`; temperature 0 → argmax."""
    b = logits_BxV.shape[0]
    temp_B = _per_row(temperature, b)
    probs_BxV = logits_to_probs(logits_BxV, temp_B, top_p)
    # log(0) = -inf removes filtered tokens exactly; categorical never draws them.
    sampled_B = jax.random.categorical(key, jnp.log(probs_BxV), axis=-1)
    greedy_B = jnp.argmax(logits_BxV, axis=-1)
    return jnp.where(temp_B <= 0.0, greedy_B, sampled_B).astype(jnp.int32)


def greedy_tokens(logits_BxV: jax.Array) -> jax.Array:
    """Argmax per row [B] int32 (skips the vocabulary sort when no row samples)."""
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
