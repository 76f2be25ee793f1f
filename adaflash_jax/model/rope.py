"""Rotary position embeddings, rotate-half layout (HF Llama/Qwen3), optional llama3 scaling.

Dimensions: B batch, T tokens, H heads, Dh head dim, Dr rotated dims (Dh, or its leading
`partial_rotary_factor` part: Qwen3.5 rotates 64 of 256).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from adaflash_jax.model.config import RopeScaling


@functools.lru_cache(maxsize=64)
def inverse_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Per-pair inverse frequencies [Dr/2] in float32, computed on the host once (cached)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
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
    """Rotates the first Dr = 2·len(inv_freq) dims of each head of `x` by its absolute
    positions (the rest pass through); math in float32, result in x's dtype."""
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BxTxDr = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)
    cos = jnp.cos(angles_BxTxDr)[:, :, None, :]
    sin = jnp.sin(angles_BxTxDr)[:, :, None, :]
    x = x_BxTxHxDh.astype(jnp.float32)
    dr = angles_BxTxDr.shape[-1]
    x_rot, x_pass = x[..., :dr], x[..., dr:]
    rotated = jnp.concatenate([-x_rot[..., dr // 2 :], x_rot[..., : dr // 2]], axis=-1)
    out = jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
    return out.astype(x_BxTxHxDh.dtype)
