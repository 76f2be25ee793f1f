"""Fixed-shape KV cache with per-row lengths (docs/design.md §8.1: rollback only moves lengths).

Dimensions: L layers, B rows, S capacity, T new tokens per row, Kv kv heads, Dh head dim.

Entries at positions >= lengths[b] are stale and never read: attention masks by absolute
position, and the next write overwrites them. Row b's next T tokens sit at `positions(T)`;
`write` puts their keys/values there and commits as many as it is told to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, S, Kv, Dh]
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

    def positions(self, t: int) -> jax.Array:
        """[B, T] int32: where each row's next `t` tokens go (`lengths[b] + t`)."""
        return self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    def write(self, k, v, advance=None) -> KVCache:
        """Writes per-layer [B, T, Kv, Dh] entries at `positions(T)` and moves the lengths by
        `advance` [B] (None: written but not committed, the lengths stay). Entries past a
        row's advance are written but stay masked; positions past the capacity drop."""
        positions_BxT = self.positions(k[0].shape[1])
        lengths = self.lengths if advance is None else self.lengths + advance.astype(jnp.int32)
        return KVCache(
            k=tuple(write_rows(c, n, positions_BxT) for c, n in zip(self.k, k)),
            v=tuple(write_rows(c, n, positions_BxT) for c, n in zip(self.v, v)),
            lengths=lengths,
        )

    def rollback(self, lengths_B: jax.Array) -> KVCache:
        """Keeps only the first `lengths_B[b]` tokens of each row."""
        return self.replace(lengths=jnp.minimum(self.lengths, lengths_B.astype(jnp.int32)))

    def with_lengths(self, lengths_B: jax.Array) -> KVCache:
        return self.replace(lengths=lengths_B.astype(jnp.int32))


def write_rows(cache_BxSxKvxDh, new_BxTxKvxDh, positions_BxT):
    """Scatters T new entries per row at their absolute positions; out-of-range writes drop
    (dynamic_update_slice would clamp and silently overwrite valid entries)."""
    rows_Bx1 = jnp.arange(cache_BxSxKvxDh.shape[0])[:, None]
    return cache_BxSxKvxDh.at[rows_Bx1, positions_BxT].set(
        new_BxTxKvxDh.astype(cache_BxSxKvxDh.dtype), mode="drop"
    )
