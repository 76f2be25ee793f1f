"""Verification of a drafted block at a bucketed width, inside one `lax.switch`.

Dimensions: B slots, K block size, W verify width (a bucket), V vocab, Kv kv heads, Dh head
dim, nD concatenated target features.

The target runs over [bonus, d_1..d_{W−1}] at the smallest bucket W >= the largest active
request, one switch branch per bucket (one compiled program for every width). Each branch
runs the target in "read" cache mode (a branch that wrote the cache would make XLA copy it
every step; see `model/target.py`) and accepts there: the logits never leave their branch
(padding [B, W, V] to K and accepting over K would cost as much as the forward at small
widths). It computes the drafter-context entries of its (at most W) committable tokens too,
and returns both caches' new entries padded to K; the step writes them after the switch.
On a hybrid target the Gated DeltaNet layers return their per-token recurrence inputs
instead of keys/values (`model/recurrent_state.py`), padded the same way: the write replays
each row's accepted prefix of them, so the state ends at the row's own accepted length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _pad_to(k: int, entries):
    """Per-token entries [B, W, ...] (any pytree of them) zero-padded to [B, K, ...]."""
    return jax.tree.map(
        lambda x: jnp.pad(x, [(0, 0), (0, k - x.shape[1])] + [(0, 0)] * (x.ndim - 2)), entries
    )


def verify(target, drafter, s, spec, tokens_BxK, q_BxKm1xV, width_B, key):
    """Returns (accepted_B, bonus_B, the target's new (k, v) and the drafter context's, each
    per layer [B, K, Kv, Dh] with zeros past the bucket, the target's per-layer recurrent
    entries (() unless hybrid), and the bucket W)."""
    k = spec.block_size

    def branch(w, target_cache):
        out = target(
            tokens_BxK[:, :w],
            cache=target_cache,
            cache_mode="read",
            feature_layers=spec.feature_layers,
            rows=spec.rows,
        )
        ctx_kv = drafter.context_entries(s.context_cache, out.features_BxTxnD)
        q_BxWm1xV = None if q_BxKm1xV is None else q_BxKm1xV[:, : w - 1]
        logits_BxWxV = out.logits_BxTxV.astype(jnp.float32)
        accepted_B, bonus_B = spec.accept_fn(
            key, tokens_BxK[:, 1:w], q_BxWm1xV, logits_BxWxV, width_B, s.temperature, spec.top_p(s)
        )
        new = _pad_to(k, out.new_kv), _pad_to(k, ctx_kv), _pad_to(k, out.new_recurrent)
        return accepted_B.astype(jnp.int32), bonus_B.astype(jnp.int32), *new

    buckets_NW = jnp.asarray(spec.buckets, jnp.int32)
    bucket = jnp.sum((buckets_NW < jnp.max(width_B)).astype(jnp.int32))
    bucket = jnp.minimum(bucket, len(spec.buckets) - 1)  # a spec pinned below K caps it
    branches = [functools.partial(branch, w) for w in spec.buckets]
    return (*jax.lax.switch(bucket, branches, s.target_cache), buckets_NW[bucket])
