"""Rotary position embeddings, rotate-half layout (HF Llama/Qwen3), optional llama3 scaling.

Dimensions: B batch, T tokens, H heads, Dh head dim.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from adaflash_jax.model.config import RopeScaling


@functools.lru_cache(maxsize=64)
def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Per-pair inverse frequencies [Dh/2] in float32, computed on the host once (cached)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    out = inv_freq.astype(np.float32)
    out.setflags(write=False)
    return out


def apply_rope(x_BxTxHxDh: jnp.ndarray, positions_BxT: jnp.ndarray, inv_freq: np.ndarray):
    """Rotates `x` by its absolute positions; math in float32, result in x's dtype."""
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BxTxDh = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)
    cos = jnp.cos(angles_BxTxDh)[:, :, None, :]
    sin = jnp.sin(angles_BxTxDh)[:, :, None, :]
    x = x_BxTxHxDh.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x_BxTxHxDh.dtype)
