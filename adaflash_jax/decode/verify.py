"""Target verify forward that READS the KV cache and returns the new keys/values.

Dimensions: B rows, W new tokens (verify width), C cache capacity, D model, V vocab,
H query heads, Kv kv heads (G = H/Kv), Dh head dim, nD concatenated features.

Why not `TargetLM.__call__` with its cache: the engine runs one verify per width bucket
inside `lax.switch`, inside a `while_loop`. XLA copies a buffer that a conditional branch
updates (jax-ml/jax#5986, #38145): the whole target KV cache, every step — at 128 slots of an
8B model that is ~19 GB of traffic per copy. Here each branch only reads the cache: the W new
tokens attend to the committed entries (positions < lengths) and causally to each other via
a two-part softmax (no concatenation, which would copy too); the engine then writes the new
keys/values with one in-place scatter outside the switch.

The math mirrors `TargetLM.__call__` (the same submodules and q/k/v projections; keys/values
pass through the cache dtype as they would when written first); tests compare the two.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from adaflash_jax.model.kv_cache import KVCache, write_rows
from adaflash_jax.model.layers import NEG_INF


def attend_cache_and_new(q_BxWxHxDh, cache_k, cache_v, lengths_B, new_k_BxWxKvxDh, new_v):
    """Softmax attention over [committed cache entries ; new tokens (causal)], float32
    scores, probabilities normalised before the value product (as `layers.attend`)."""
    b, w, h, dh = q_BxWxHxDh.shape
    kv = cache_k.shape[2]
    q = q_BxWxHxDh.reshape(b, w, kv, h // kv, dh)
    scale = dh**-0.5
    f32 = jnp.float32
    cache_k, cache_v = cache_k.astype(q.dtype), cache_v.astype(q.dtype)
    s_cache = jnp.einsum("bwkgd,bckd->bkgwc", q, cache_k, preferred_element_type=f32) * scale
    s_new = jnp.einsum("bwkgd,bukd->bkgwu", q, new_k_BxWxKvxDh, preferred_element_type=f32)
    s_new = s_new * scale
    visible_BxC = jnp.arange(cache_k.shape[1])[None, :] < lengths_B[:, None]
    causal_WxW = jnp.tril(jnp.ones((w, w), bool))
    s_cache = jnp.where(visible_BxC[:, None, None, None, :], s_cache, NEG_INF)
    s_new = jnp.where(causal_WxW[None, None, None], s_new, NEG_INF)
    top = jnp.maximum(s_cache.max(axis=-1), s_new.max(axis=-1))[..., None]
    p_cache, p_new = jnp.exp(s_cache - top), jnp.exp(s_new - top)
    denom = p_cache.sum(axis=-1, keepdims=True) + p_new.sum(axis=-1, keepdims=True)
    p_cache = (p_cache / denom).astype(cache_v.dtype)
    p_new = (p_new / denom).astype(new_v.dtype)
    out = jnp.einsum("bkgwc,bckd->bwkgd", p_cache, cache_v)
    out = out + jnp.einsum("bkgwu,bukd->bwkgd", p_new, new_v)
    return out.reshape(b, w, h, dh)


def verify_forward(target, tokens_BxW, cache: KVCache, feature_layers: Sequence[int] = ()):
    """Runs W new tokens per row at positions `cache.lengths + t` WITHOUT writing the cache.

    Returns (logits_BxWxV, features_BxWxnD or None, new_k, new_v) with new_k/new_v per-layer
    tuples of [B, W, Kv, Dh] in the cache dtype, ready for `write_new_entries`."""
    b, w = tokens_BxW.shape
    positions_BxW = cache.lengths[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    x = target.embed(tokens_BxW)
    features, new_k, new_v = {}, [], []
    for i, layer in enumerate(target.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.queries(h, positions_BxW)
        k, v = attn.keys_values(h, positions_BxW)
        k, v = k.astype(cache.k[i].dtype), v.astype(cache.v[i].dtype)
        new_k.append(k)
        new_v.append(v)
        out = attend_cache_and_new(
            q, cache.k[i], cache.v[i], cache.lengths, k.astype(q.dtype), v.astype(q.dtype)
        )
        x = x + attn.output(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in feature_layers:
            features[i] = target.feature(i, x)
    feats = (
        jnp.concatenate([features[i] for i in feature_layers], axis=-1) if feature_layers else None
    )
    return target.logits(target.norm(x)), feats, tuple(new_k), tuple(new_v)


def write_new_entries(cache: KVCache, new_k, new_v) -> KVCache:
    """Writes per-layer [B, T, Kv, Dh] entries at positions lengths + t (lengths unchanged:
    the caller commits by moving them). Out-of-capacity positions drop."""
    t = new_k[0].shape[1]
    positions_BxT = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return cache.replace(
        k=tuple(write_rows(c, n, positions_BxT) for c, n in zip(cache.k, new_k)),
        v=tuple(write_rows(c, n, positions_BxT) for c, n in zip(cache.v, new_v)),
    )


def pad_width(x_BxWx, width: int) -> jax.Array:
    """Zero-pads axis 1 to `width`."""
    pad = [(0, 0)] * x_BxWx.ndim
    pad[1] = (0, width - x_BxWx.shape[1])
    return jnp.pad(x_BxWx, pad)
