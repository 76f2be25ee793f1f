"""Building blocks shared by the target LLM and the drafter.

Dimensions: B batch, T query tokens, S key tokens (a cache's capacity), D model, H query
heads, Kv kv heads (G = H/Kv queries per kv head), Dh head dim, F MLP hidden.

Every parameter carries `logical_axes` metadata; `adaflash_jax.sharding.rules` maps those
names to mesh axes, so modules never mention a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.model.rope import apply_rope, attention_factor, inverse_frequencies

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
    """HF semantics: normalise in float32, cast back, then scale by the weight. Zero-centred
    (Qwen3.5): the weight is stored as w and scales by (1 + w), in float32 before the cast."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float,
        zero_centered: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        self.eps, self.zero_centered, self.dtype = eps, zero_centered, dtype
        init = jnp.zeros if zero_centered else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype), logical_axes=("norm",))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.zero_centered:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


class SwiGLU(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Dense(dim, hidden, logical_axes=("embed", "mlp"), **kw)
        self.up_proj = Dense(dim, hidden, logical_axes=("embed", "mlp"), **kw)
        self.down_proj = Dense(hidden, dim, logical_axes=("mlp", "embed"), **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def in_window(key_pos, query_pos_BxT, window: int | None):
    """bool [B, T, S]: the query at `query_pos` is within `window` of the key at `key_pos`
    ([B, S] or [S]): key_pos > query_pos − window (HF's sliding-window rule; the causal side
    is the caller's). None: every key."""
    key_pos_BxS = jnp.broadcast_to(key_pos, (query_pos_BxT.shape[0], key_pos.shape[-1]))
    if window is None:
        return jnp.ones((*query_pos_BxT.shape, key_pos_BxS.shape[1]), bool)
    return key_pos_BxS[:, None, :] > query_pos_BxT[:, :, None] - window


def _sink_logits(sinks_H, kv_heads: int):
    """A sink logit per query head as [1, Kv, G, 1, 1] float32 (the scores' layout)."""
    return sinks_H.astype(jnp.float32).reshape(1, kv_heads, -1, 1, 1)


def attend(q_BxTxHxDh, k_BxSxKvxDh, v_BxSxKvxDh, mask_BxTxS, sinks_H=None):
    """Grouped-query softmax attention; scores and softmax in float32. `sinks_H` (gpt-oss): a
    learned logit per query head joins each softmax's denominator and attends to nothing."""
    b, t, h, dh = q_BxTxHxDh.shape
    kv_heads = k_BxSxKvxDh.shape[2]
    q_BxTxKvxGxDh = q_BxTxHxDh.reshape(b, t, kv_heads, h // kv_heads, dh)
    scores_BxKvxGxTxS = jnp.einsum(
        "btkgd,bskd->bkgts", q_BxTxKvxGxDh, k_BxSxKvxDh, preferred_element_type=jnp.float32
    ) * (dh**-0.5)
    scores_BxKvxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKvxGxTxS, NEG_INF)
    if sinks_H is None:
        probs = jax.nn.softmax(scores_BxKvxGxTxS, axis=-1)
    else:
        sink = _sink_logits(sinks_H, kv_heads)
        top = jnp.maximum(scores_BxKvxGxTxS.max(axis=-1, keepdims=True), sink)
        p = jnp.exp(scores_BxKvxGxTxS - top)
        probs = p / (p.sum(axis=-1, keepdims=True) + jnp.exp(sink - top))
    out_BxTxKvxGxDh = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BxSxKvxDh.dtype), v_BxSxKvxDh)
    return out_BxTxKvxGxDh.reshape(b, t, h, dh)


def attend_cached(
    q_BxTxHxDh,
    cache_k_BxSxKvxDh,
    cache_v,
    lengths_B,
    new_k_BxTxKvxDh,
    new_v,
    visible_BxTxT=None,
    *,
    sinks_H=None,
    window: int | None = None,
    positions_BxT=None,
):
    """Attention of T new tokens over [a cache's committed entries ; themselves (causal, or
    where `visible_BxTxT` says: a tree's ancestors)] WITHOUT writing them into the cache: a
    two-part softmax (no concatenation, which would copy the cache), float32 scores,
    probabilities normalised before the value product. `sinks_H`: a logit per query head in
    every denominator (gpt-oss). `window`: a sliding-window layer over a full cache (entry s
    at position s): the new tokens at `positions_BxT` see only keys within the window."""
    b, t, h, dh = q_BxTxHxDh.shape
    kv = cache_k_BxSxKvxDh.shape[2]
    q = q_BxTxHxDh.reshape(b, t, kv, h // kv, dh)
    scale = dh**-0.5
    f32 = jnp.float32
    cache_k, cache_v = cache_k_BxSxKvxDh.astype(q.dtype), cache_v.astype(q.dtype)
    s_cache = jnp.einsum("btkgd,bskd->bkgts", q, cache_k, preferred_element_type=f32) * scale
    s_new = jnp.einsum("btkgd,bukd->bkgtu", q, new_k_BxTxKvxDh, preferred_element_type=f32)
    s_new = s_new * scale
    key_pos_S = jnp.arange(cache_k.shape[1], dtype=jnp.int32)
    visible_BxTxS = (key_pos_S[None, :] < lengths_B[:, None])[:, None, :]
    if visible_BxTxT is None:
        visible_BxTxT = jnp.tril(jnp.ones((t, t), bool))[None]
    if window is not None:
        visible_BxTxS = visible_BxTxS & in_window(key_pos_S, positions_BxT, window)
        visible_BxTxT = visible_BxTxT & in_window(positions_BxT, positions_BxT, window)
    s_cache = jnp.where(visible_BxTxS[:, None, None], s_cache, NEG_INF)
    s_new = jnp.where(visible_BxTxT[:, None, None], s_new, NEG_INF)
    top = jnp.maximum(s_cache.max(axis=-1), s_new.max(axis=-1))[..., None]
    if sinks_H is not None:
        sink = _sink_logits(sinks_H, kv)
        top = jnp.maximum(top, sink)
    p_cache, p_new = jnp.exp(s_cache - top), jnp.exp(s_new - top)
    denom = p_cache.sum(axis=-1, keepdims=True) + p_new.sum(axis=-1, keepdims=True)
    if sinks_H is not None:
        denom = denom + jnp.exp(sink - top)
    p_cache = (p_cache / denom).astype(cache_v.dtype)
    p_new = (p_new / denom).astype(new_v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p_cache, cache_v)
    out = out + jnp.einsum("bkgtu,bukd->btkgd", p_new, new_v)
    return out.reshape(b, t, h, dh)


class AttentionProjections(nnx.Module):
    """The q/k/v/o projections, optional per-head q/k RMSNorm and RoPE of one attention layer.

    Shared by the target's attention and the drafter's KV-injected attention, so both compute
    queries, keys and values the same way. Qwen3.5's gated attention (`output_gate`): q_proj
    also yields, per head, a gate after the Dh query dims, and the attended heads are scaled
    by sigmoid(gate) before o_proj; its q/k norms are zero-centred.
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
        rope: tuple,  # (rotated dims, theta, RopeScaling | None): static, built at trace
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
        output_gate: bool = False,
        zero_centered_norms: bool = False,
        bias: bool = False,
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, use_bias=bias)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        q_width = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = Dense(dim, q_width, logical_axes=("embed", "q_heads"), **kw)
        self.k_proj = Dense(dim, num_kv_heads * head_dim, logical_axes=("embed", "kv_heads"), **kw)
        self.v_proj = Dense(dim, num_kv_heads * head_dim, logical_axes=("embed", "kv_heads"), **kw)
        self.o_proj = Dense(num_heads * head_dim, dim, logical_axes=("q_heads", "embed"), **kw)
        norm_kw = dict(
            eps=eps, zero_centered=zero_centered_norms, dtype=dtype, param_dtype=param_dtype
        )
        self.q_norm = RMSNorm(head_dim, **norm_kw) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, **norm_kw) if qk_norm else None
        self.rope = rope

    def queries(self, x_BxTxD, positions_BxT):
        """Normed, rotated queries [B, T, H, Dh] (without the output gate's half)."""
        return self.gated_queries(x_BxTxD, positions_BxT)[0]

    def gated_queries(self, x_BxTxD, positions_BxT):
        """(queries [B, T, H, Dh], output gate [B, T, H, Dh] or None)."""
        b, t, _ = x_BxTxD.shape
        q = self.q_proj(x_BxTxD).reshape(b, t, self.num_heads, -1)
        q, gate = (
            (q[..., : self.head_dim], q[..., self.head_dim :]) if self.output_gate else (q, None)
        )
        if self.q_norm is not None:
            q = self.q_norm(q)
        return self._rotate(q, positions_BxT), gate

    def keys_values(self, x_BxTxD, positions_BxT):
        """Normed, rotated keys and values of any token stream."""
        b, t, _ = x_BxTxD.shape
        k = self.k_proj(x_BxTxD).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BxTxD).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self._rotate(k, positions_BxT), v

    def _rotate(self, x_BxTxHxDh, positions_BxT):
        scaling = self.rope[2]
        freqs = inverse_frequencies(*self.rope)
        return apply_rope(x_BxTxHxDh, positions_BxT, freqs, attention_factor(scaling))

    def output(self, attended_BxTxHxDh, gate_BxTxHxDh=None):
        b, t = attended_BxTxHxDh.shape[:2]
        if gate_BxTxHxDh is not None:
            attended_BxTxHxDh = attended_BxTxHxDh * jax.nn.sigmoid(gate_BxTxHxDh)
        return self.o_proj(attended_BxTxHxDh.reshape(b, t, -1))
