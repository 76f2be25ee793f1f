"""Rotary position embeddings, rotate-half layout (HF Llama/Qwen3/gpt-oss), optional llama3 or
YaRN frequency scaling.

Dimensions: B batch, T tokens, H heads, Dh head dim, Dr rotated dims (Dh, or its leading
`partial_rotary_factor` part: Qwen3.5 rotates 64 of 256).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from adaflash_jax.model.config import RopeScaling, YarnScaling


@functools.lru_cache(maxsize=64)
def inverse_frequencies(
    rotary_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None
) -> np.ndarray:
    """Per-pair inverse frequencies [Dr/2] in float32, computed on the host once (cached)."""
    if isinstance(scaling, YarnScaling):
        return _readonly(yarn_frequencies(rotary_dim, theta, scaling))
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
    return _readonly(inv_freq)


def _readonly(inv_freq: np.ndarray) -> np.ndarray:
    out = inv_freq.astype(np.float32)
    out.setflags(write=False)
    return out


def yarn_frequencies(rotary_dim: int, theta: float, scaling: YarnScaling) -> np.ndarray:
    """YaRN (arXiv 2309.00071): pair i keeps its frequency (extrapolation) below the
    correction range of dims [low, high], takes it divided by `factor` (interpolation) above
    it, and a linear ramp between; the range is where a pair turns `beta_fast` and
    `beta_slow` times over the original context. Float32 as transformers computes it."""
    dim = rotary_dim
    exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    pos_freqs = np.float32(theta) ** exponents
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(scaling.factor) * pos_freqs)
    ctx = scaling.original_max_position_embeddings

    def correction_dim(rotations):
        return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = np.float32(1.0) - ramp.astype(np.float32)
    return interpolation * (1 - keep) + extrapolation * keep


def attention_factor(scaling: RopeScaling | YarnScaling | None) -> float:
    """The factor cos and sin are scaled by (YaRN's attention temperature; 1 otherwise)."""
    return scaling.attention_factor if isinstance(scaling, YarnScaling) else 1.0


def apply_rope(
    x_BxTxHxDh: jnp.ndarray, positions_BxT: jnp.ndarray, inv_freq: np.ndarray, scale: float = 1.0
):
    """Rotates the first Dr = 2·len(inv_freq) dims of each head of `x` by its absolute
    positions (the rest pass through), cos and sin times `scale`; math in float32, result
    in x's dtype."""
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BxTxDr = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)
    cos = jnp.cos(angles_BxTxDr)[:, :, None, :]
    sin = jnp.sin(angles_BxTxDr)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x = x_BxTxHxDh.astype(jnp.float32)
    dr = angles_BxTxDr.shape[-1]
    x_rot, x_pass = x[..., :dr], x[..., dr:]
    rotated = jnp.concatenate([-x_rot[..., dr // 2 :], x_rot[..., : dr // 2]], axis=-1)
    out = jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
    return out.astype(x_BxTxHxDh.dtype)
