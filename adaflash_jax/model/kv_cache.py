"""The attention layer's cache kind: keys and values per position (docs/design.md §8.1).

Dimensions: B rows, S capacity, T new tokens per row, Z committed path length, Kv kv heads,
Dh head dim.

Entries at positions >= a row's length are stale and never read: attention masks by absolute
position, and the next commit overwrites them. So dropping tokens (rollback) only moves the
lengths (`model/cache.py`). The drafter's context cache is a cache of this kind too: the
keys/values its full-attention layers project from the committed tokens' target features
(its sliding-window layers keep a `ring_cache.RingKVLayer` of the window instead).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.model.cache import path_entries


@struct.dataclass
class KVEntries:
    """One pass's new keys/values [B, T, Kv, Dh], in the cache dtype."""

    k_BxTxKvxDh: jax.Array
    v_BxTxKvxDh: jax.Array


@struct.dataclass
class KVLayer:
    k_BxSxKvxDh: jax.Array
    v_BxSxKvxDh: jax.Array
    rolls_back: ClassVar[bool] = True

    @classmethod
    def create(cls, *, batch, capacity, kv_heads, head_dim, dtype) -> KVLayer:
        shape = (batch, capacity, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def capacity(self) -> int:
        return self.k_BxSxKvxDh.shape[1]

    @property
    def dtype(self):
        return self.k_BxSxKvxDh.dtype

    def commit(self, entries: KVEntries, lengths_B, path_BxZ, n_B) -> KVLayer:
        """Writes the path's entries at `lengths_B + 0..Z−1` (the contiguous write: those past
        `n_B` are written but stay stale; positions past the capacity drop)."""
        del n_B  # the lengths say which entries are committed
        new = path_entries(entries, path_BxZ)
        z = new.k_BxTxKvxDh.shape[1]
        positions_BxZ = lengths_B[:, None] + jnp.arange(z, dtype=jnp.int32)[None, :]
        return KVLayer(
            write_rows(self.k_BxSxKvxDh, new.k_BxTxKvxDh, positions_BxZ),
            write_rows(self.v_BxSxKvxDh, new.v_BxTxKvxDh, positions_BxZ),
        )


def write_rows(cache_BxSxKvxDh, new_BxTxKvxDh, positions_BxT):
    """Scatters T new entries per row at their absolute positions; out-of-range writes drop
    (dynamic_update_slice would clamp and silently overwrite valid entries)."""
    rows_Bx1 = jnp.arange(cache_BxSxKvxDh.shape[0])[:, None]
    return cache_BxSxKvxDh.at[rows_Bx1, positions_BxT].set(
        new_BxTxKvxDh.astype(cache_BxSxKvxDh.dtype), mode="drop"
    )
