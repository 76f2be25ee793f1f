"""Block attention masks of the DFlash drafter (docs/design.md §3).

Dimensions: B batch, C context slots (committed tokens with target features), N blocks
(anchors) per sequence, K block size, S sequence length (training context).

Keys are laid out as [context ; block tokens]. A block query sees every context token
strictly before its anchor, and all K tokens of its own block (bidirectional), nothing else.
Serving uses the dense mask; training may use it too (`Drafter.train_hidden(attention=
"dense")`), though `train_attention.BlockSparse` computes the same attention without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

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


def decode_mask(context_len_B, context_capacity: int, block_size: int):
    """Serving: one block per row, anchored at `context_len_B` → bool [B, K, C + K]."""
    ctx_BxC = jnp.arange(context_capacity)[None, :] < context_len_B[:, None]
    ctx_BxKxC = jnp.broadcast_to(
        ctx_BxC[:, None, :], (context_len_B.shape[0], block_size, context_capacity)
    )
    block_BxKxK = jnp.ones((context_len_B.shape[0], block_size, block_size), bool)
    return jnp.concatenate([ctx_BxKxC, block_BxKxK], axis=-1)


def train_mask(anchors_BxN, valid_BxN, seq_len: int, block_size: int):
    """Training: N blocks per sequence in one forward → bool [B, N·K, S + N·K].

    Invalid (padding) blocks see only themselves, so their rows stay finite and are
    dropped by the loss mask.
    """
    b, n = anchors_BxN.shape
    k = block_size
    ctx_BxNxS = jnp.arange(seq_len)[None, None, :] < anchors_BxN[:, :, None]
    ctx_BxNxS &= valid_BxN[:, :, None]
    ctx_BxNKxS = jnp.repeat(ctx_BxNxS, k, axis=1)
    block_id_NK = jnp.repeat(jnp.arange(n), k)
    same_block = block_id_NK[:, None] == block_id_NK[None, :]
    blocks_BxNKxNK = jnp.broadcast_to(same_block, (b, n * k, n * k))
    return jnp.concatenate([ctx_BxNKxS, blocks_BxNKxNK], axis=-1)
