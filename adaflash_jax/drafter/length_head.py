"""AdaFlash adaptive length head (DESIGN §4.3, "two-model" head).

Dimensions: B batch, K block size, D drafter width, R bottleneck (256).

Reads the drafter's final-normed states of one whole block (detached by the caller's
`stop_gradient`, so no gradient reaches the drafter) and predicts r ≈ verify length / K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.drafter.config import LengthHeadConfig
from adaflash_jax.model.layers import Dense


class LengthHead(nnx.Module):
    def __init__(self, hidden_size: int, cfg: LengthHeadConfig, *, rngs: nnx.Rngs):
        r = cfg.bottleneck_dim
        kw = dict(rngs=rngs, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32)
        self.down = Dense(2 * hidden_size, r, logical_axes=("head_in", "head_hidden"), **kw)
        self.res = Dense(r, r, logical_axes=("head_hidden", "head_hidden"), **kw)
        self.out = Dense(r, 1, logical_axes=("head_hidden", None), **kw)

    def __call__(self, hidden_BxKxD) -> jax.Array:
        """Returns r_B in (0, 1)."""
        y = hidden_BxKxD.astype(jnp.float32)
        f_Bx2D = jnp.concatenate([y.mean(axis=1), y[:, -1]], axis=-1)
        h_BxR = jax.nn.silu(self.down(f_Bx2D))
        h_BxR = h_BxR + jax.nn.silu(self.res(h_BxR))
        return jax.nn.sigmoid(self.out(h_BxR))[:, 0]


def length_label(accepted_B, block_size: int):
    """Direct-length regression target y = clip((A + 1) / K, 0, 1)."""
    return jnp.clip((accepted_B.astype(jnp.float32) + 1.0) / block_size, 0.0, 1.0)


def verify_length(r_B, block_size: int, rate: float = 1.3):
    """Reference serving rule: clamp(round(r·K·rate), 1, K)."""
    return jnp.clip(jnp.round(r_B * block_size * rate), 1, block_size).astype(jnp.int32)
