"""Verification of a drafted block inside one `lax.switch` over static shapes.

Dimensions: B slots, K block size, W verify width (a bucket), M packed tokens (a token
bucket), V vocab, Kv kv heads, Dh head dim, nD concatenated target features.

Two layouts, an engine option (docs/design.md §5.5):
- padded: the target runs over [bonus, d_1..d_{W−1}] of every row at the smallest bucket W
  >= the largest active request, one switch branch per bucket;
- packed: row b contributes its own w_b tokens (0 when inactive) to one stream padded to the
  smallest token bucket M >= Σ w_b, one branch per token bucket. Position-wise work (the
  projections, MLP / MoE, LM head and acceptance) costs M tokens; attention and the
  recurrence run per row in the row layout [B, K] (`model/packing.py`).
Each branch runs the target in "read" cache mode (a branch that wrote the cache would make
XLA copy it every step; see `model/target.py`) and accepts there: the logits never leave
their branch (padding them to K and accepting outside would cost as much as the forward at
small widths). It computes the drafter-context entries of its committable tokens too, and
returns both caches' per-layer entries (`model/cache.py`) in the row layout padded to K; the
step commits them after the switch. A hybrid target's Gated DeltaNet layers return their
per-token recurrence inputs as entries, padded the same way: the commit replays each row's
accepted prefix of them, so the state ends at the row's own accepted length.

A draft tree (`EngineSpec.tree`, packed only) verifies each row's root and nodes (W = Y + 1
row layout, `decode/tree.py`) under the ancestor mask, and accepts by walking the tree; the
branch returns the walked path too. The target's entries are committed along it
(`Cache.commit(..., path_BxZ)`); the drafter context's are computed from the path's features
in order, so they commit as a chain.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from adaflash_jax.decode.acceptance import accept
from adaflash_jax.decode.tokens import logits_to_probs, pick_tokens
from adaflash_jax.decode.tree import children, recursive_choice, walk
from adaflash_jax.model.cache import path_entries
from adaflash_jax.model.packing import Packing, to_rows, to_tokens


def _pad_to(k: int, entries):
    """Per-token entries [B, W, ...] (any pytree of them) zero-padded to [B, K, ...]."""
    return jax.tree.map(
        lambda x: jnp.pad(x, [(0, 0), (0, k - x.shape[1])] + [(0, 0)] * (x.ndim - 2)), entries
    )


def _branch(
    target, drafter, s, spec, tokens_BxW, tree_of, q_BxKm1xV, width_B, key, size, target_cache
):
    """One bucket's verify: `size` is its width W (padded) or its token count M (packed)."""
    b, w = tokens_BxW.shape
    k = spec.block_size
    parent_BxW, candidates_BxKm1xKc = tree_of
    if spec.packed:
        packing = Packing.create(width_B, tokens=size, row_width=w, parent_BxW=parent_BxW)
        tokens_MxT, layout = to_tokens(packing, tokens_BxW), packing
    else:
        packing, tokens_MxT, layout = None, tokens_BxW[:, :size], Packing.dense(b, size)
    out = target(
        tokens_MxT,
        cache=target_cache,
        cache_mode="read",
        feature_layers=spec.feature_layers,
        rows=spec.rows,
        packing=packing,
    )
    features_BxWxnD = to_rows(packing, out.features_BxTxnD)
    logits_MxV = out.logits_BxTxV.reshape(layout.tokens, -1).astype(jnp.float32)
    if parent_BxW is None:
        accepted_B, bonus_B = accept(
            spec.accept_fn,
            key,
            layout,
            tokens_BxW,
            q_BxKm1xV,
            logits_MxV,
            width_B,
            s.temperature,
            spec.top_p(s),
        )
        path_BxZ = None
    else:  # each token's target choice, then the walk; the context takes the path's features
        if spec.greedy:
            choice_M = pick_tokens(key, logits_MxV, s.temperature, greedy=True)
        else:
            at_M = jnp.minimum(packing.depth_BxW[packing.row_M, packing.col_M], k - 2)
            choice_M = recursive_choice(
                key,
                logits_to_probs(logits_MxV, s.temperature, spec.top_p(s)),
                q_BxKm1xV[packing.row_M, at_M],
                candidates_BxKm1xKc[packing.row_M, at_M],
                packing.pack(children(packing.parent_BxW, width_B)),
            )
        choice_BxW = layout.unpack(choice_M)
        accepted_B, path_BxZ, bonus_B = walk(
            tokens_BxW, parent_BxW, choice_BxW, width_B, spec.block_size - 1
        )
        features_BxWxnD = path_entries(features_BxWxnD, path_BxZ)
    ctx_entries = drafter.context_entries(s.context_cache, features_BxWxnD)
    return (
        accepted_B,
        bonus_B,
        path_BxZ,
        _pad_to(w, out.entries),
        _pad_to(spec.block_size, ctx_entries),
    )


def verify(target, drafter, s, spec, tokens_BxW, tree_of, q_BxKm1xV, width_B, key):
    """Verifies each row's first `width_B[b]` tokens of `tokens_BxW`: a chain [B, K] (`tree_of`
    (None, None)), or a tree [B, Y + 1] (`tree_of`: its parents [B, W] and its positions'
    candidates [B, K − 1, Kc], which a sampled walk tries against q). Returns (accepted_B,
    bonus_B, the accepted path [B, K] of token indices (None: a chain's prefix), the
    target's per-layer entries of the verified tokens [B, W, ...] and the drafter context's
    of the committable ones [B, K, ...] with zeros past a row's tokens, and the bucket: W
    padded, M packed)."""
    sizes = spec.token_buckets if spec.packed else spec.buckets
    need = jnp.sum(width_B) if spec.packed else jnp.max(width_B)
    sizes_N = jnp.asarray(sizes, jnp.int32)
    bucket = jnp.sum((sizes_N < need).astype(jnp.int32))
    bucket = jnp.minimum(bucket, len(sizes) - 1)  # a spec pinned below K caps it
    args = (target, drafter, s, spec, tokens_BxW, tree_of, q_BxKm1xV, width_B, key)
    branches = [functools.partial(_branch, *args, size) for size in sizes]
    return (*jax.lax.switch(bucket, branches, s.target_cache), sizes_N[bucket])
