"""Fixed-shape KV cache with per-row lengths (DESIGN §8: rollback only moves lengths).

Dimensions: L layers, B rows, S capacity, K kv heads, Dh head dim.
Entries at positions >= lengths[b] are stale and never read: attention masks by absolute
position, and the next extend overwrites them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, S, K, Dh]
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # [B] int32: committed tokens per row

    @classmethod
    def create(cls, *, num_layers, batch, capacity, kv_heads, head_dim, dtype=jnp.float32):
        shape = (batch, capacity, kv_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def rollback(self, lengths_B: jax.Array) -> KVCache:
        """Keeps only the first `lengths_B[b]` tokens of each row."""
        return self.replace(lengths=jnp.minimum(self.lengths, lengths_B.astype(jnp.int32)))

    def with_lengths(self, lengths_B: jax.Array) -> KVCache:
        return self.replace(lengths=lengths_B.astype(jnp.int32))


def write_rows(cache_BxSxKxDh, new_BxTxKxDh, positions_BxT):
    """Scatters T new entries per row at their absolute positions; out-of-range writes drop
    (dynamic_update_slice would clamp and silently overwrite valid entries)."""
    rows_Bx1 = jnp.arange(cache_BxSxKxDh.shape[0])[:, None]
    return cache_BxSxKxDh.at[rows_Bx1, positions_BxT].set(
        new_BxTxKxDh.astype(cache_BxSxKxDh.dtype), mode="drop"
    )
