"""Block attention masks of the DFlash drafter (docs/design.md §3).

Dimensions: B batch, C context slots (committed tokens with target features), N blocks
(anchors) per sequence, K block size, S sequence length (training context).

Keys are laid out as [context ; block tokens]. A block query sees every context token
strictly before its anchor, and all K tokens of its own block (bidirectional), nothing else.
In a sliding-window layer (window W ≥ K) the block query at position p = anchor + k sees
only the context keys at positions j > p − W: the flash-attention window (W−1 each way)
that z-lab's reference passes for its `sliding_attention` layers. Its own block's keys are
all within W. Serving uses the dense mask; training may use it too
(`Drafter.train_hidden(attention="dense")`), though `train_attention.BlockSparse` computes
the same attention without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.model import ring_cache
from adaflash_jax.model.layers import attend


@struct.dataclass
class DenseMask:
    """A drafter layer's attention over [context ; block] keys under one bool mask
    [B, T, C + T] (`decode_mask` or `train_mask`)."""

    mask_BxTx_CT: jax.Array

    def __call__(self, q_BxTxHxDh, ctx_k, ctx_v, blk_k, blk_v):
        k = jnp.concatenate([ctx_k.astype(blk_k.dtype), blk_k], axis=1)
        v = jnp.concatenate([ctx_v.astype(blk_v.dtype), blk_v], axis=1)
        return attend(q_BxTxHxDh, k, v, self.mask_BxTx_CT)


def context_visible(key_pos_BxC, anchor_B, block_size: int, window: int | None):
    """bool [B, K, C]: block position k (at `anchor + k`) sees the context key at position
    `key_pos` iff 0 <= key_pos < anchor and, in a window W, key_pos > anchor + k − W (the
    window rule of `model/ring_cache.visible`)."""
    query_pos_BxK = anchor_B[:, None] + jnp.arange(block_size, dtype=jnp.int32)[None, :]
    seen_BxKxC = ring_cache.visible(key_pos_BxC, anchor_B, query_pos_BxK, window)
    return jnp.broadcast_to(seen_BxKxC, (anchor_B.shape[0], block_size, key_pos_BxC.shape[1]))


def decode_mask(context_len_B, context_capacity: int, block_size: int, window=None):
    """Serving: one block per row, anchored at `context_len_B`, over the whole context cache
    (slot j holds position j) → bool [B, K, C + K]."""
    slots_BxC = jnp.broadcast_to(
        jnp.arange(context_capacity, dtype=jnp.int32), (context_len_B.shape[0], context_capacity)
    )
    return _with_block(context_visible(slots_BxC, context_len_B, block_size, window))


def window_slots(context_len_B, window: int):
    """The W − 1 context positions a window-W block can see: [B, W−1] int32, from
    `len − W + 1` (negative where the context is shorter; masked by `context_visible`)."""
    return ring_cache.window_positions(context_len_B, window)


def windowed_mask(slots_BxW, context_len_B, block_size: int, window: int):
    """Serving over the W − 1 entries at `window_slots` only (gathered from a full cache, or
    a `RingKVLayer`'s window) → bool [B, K, (W−1) + K]."""
    return _with_block(context_visible(slots_BxW, context_len_B, block_size, window))


def _with_block(ctx_BxKxC):
    b, k = ctx_BxKxC.shape[:2]
    return jnp.concatenate([ctx_BxKxC, jnp.ones((b, k, k), bool)], axis=-1)


def train_mask(anchors_BxN, valid_BxN, seq_len: int, block_size: int, window=None):
    """Training: N blocks per sequence in one forward → bool [B, N·K, S + N·K].

    Invalid (padding) blocks see only themselves, so their rows stay finite and are
    dropped by the loss mask.
    """
    b, n = anchors_BxN.shape
    k = block_size
    pos_S = jnp.arange(seq_len, dtype=jnp.int32)
    ctx = jax.vmap(context_visible, in_axes=(None, 1, None, None), out_axes=1)(
        jnp.broadcast_to(pos_S, (b, seq_len)), anchors_BxN, k, window
    )  # [B, N, K, S]
    ctx_BxNKxS = (ctx & valid_BxN[:, :, None, None]).reshape(b, n * k, seq_len)
    block_id_NK = jnp.repeat(jnp.arange(n), k)
    same_block = block_id_NK[:, None] == block_id_NK[None, :]
    blocks_BxNKxNK = jnp.broadcast_to(same_block, (b, n * k, n * k))
    return jnp.concatenate([ctx_BxNKxS, blocks_BxNKxNK], axis=-1)
