"""Building blocks shared by the target LLM and the drafter.

Dimensions: B batch, T query tokens, S key tokens, D model, H query heads, K kv heads
(G = H/K queries per kv head), Dh head dim, F MLP hidden.

Every parameter carries `logical_axes` metadata; `adaflash_jax.sharding.rules` maps those
names to mesh axes, so modules never mention a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.model.rope import apply_rope, inverse_frequencies

NEG_INF = -1e30  # finite, so a fully masked (padding) query row stays NaN-free


def normal_init(rngs: nnx.Rngs, shape, dtype, stddev: float = 0.02):
    return (stddev * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Dense(nnx.Module):
    """x @ kernel (+ bias). Kernel is [in, out]; HF/PyTorch checkpoints store [out, in]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        logical_axes: tuple[str | None, str | None],
        rngs: nnx.Rngs,
        use_bias: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        self.dtype = dtype
        self.kernel = nnx.Param(
            normal_init(rngs, (in_features, out_features), param_dtype), logical_axes=logical_axes
        )
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), param_dtype), logical_axes=(logical_axes[1],))
            if use_bias
            else None
        )

    def __call__(self, x):
        y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """HF semantics: normalise in float32, cast back, then scale by the weight."""

    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32, param_dtype=jnp.float32):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


class SwiGLU(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Dense(dim, hidden, logical_axes=("embed", "mlp"), **kw)
        self.up_proj = Dense(dim, hidden, logical_axes=("embed", "mlp"), **kw)
        self.down_proj = Dense(hidden, dim, logical_axes=("mlp", "embed"), **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def attend(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS):
    """Grouped-query softmax attention; scores and softmax in float32."""
    b, t, h, dh = q_BxTxHxDh.shape
    kv_heads = k_BxSxKxDh.shape[2]
    q_BxTxKxGxDh = q_BxTxHxDh.reshape(b, t, kv_heads, h // kv_heads, dh)
    scores_BxKxGxTxS = jnp.einsum(
        "btkgd,bskd->bkgts", q_BxTxKxGxDh, k_BxSxKxDh, preferred_element_type=jnp.float32
    ) * (dh**-0.5)
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS, NEG_INF)
    probs = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxDh.dtype)
    out_BxTxKxGxDh = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxDh)
    return out_BxTxKxGxDh.reshape(b, t, h, dh)


class AttentionProjections(nnx.Module):
    """The q/k/v/o projections, optional per-head q/k RMSNorm and RoPE of one attention layer.

    Shared by the target's attention, its cache-reading verify path and the drafter's
    KV-injected attention, so the three compute queries, keys and values the same way.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        eps: float,
        qk_norm: bool,
        rope: tuple,  # (head_dim, theta, RopeScaling | None): static, frequencies built at trace
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Dense(dim, num_heads * head_dim, logical_axes=("embed", "q_heads"), **kw)
        self.k_proj = Dense(dim, num_kv_heads * head_dim, logical_axes=("embed", "kv_heads"), **kw)
        self.v_proj = Dense(dim, num_kv_heads * head_dim, logical_axes=("embed", "kv_heads"), **kw)
        self.o_proj = Dense(num_heads * head_dim, dim, logical_axes=("q_heads", "embed"), **kw)
        norm_kw = dict(eps=eps, dtype=dtype, param_dtype=param_dtype)
        self.q_norm = RMSNorm(head_dim, **norm_kw) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, **norm_kw) if qk_norm else None
        self.rope = rope

    def queries(self, x_BxTxD, positions_BxT):
        b, t, _ = x_BxTxD.shape
        q = self.q_proj(x_BxTxD).reshape(b, t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, positions_BxT, inverse_frequencies(*self.rope))

    def keys_values(self, x_BxTxD, positions_BxT):
        """Normed, rotated keys and values of any token stream."""
        b, t, _ = x_BxTxD.shape
        k = self.k_proj(x_BxTxD).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BxTxD).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, positions_BxT, inverse_frequencies(*self.rope)), v

    def output(self, attended_BxTxHxDh):
        b, t = attended_BxTxHxDh.shape[:2]
        return self.o_proj(attended_BxTxHxDh.reshape(b, t, -1))
