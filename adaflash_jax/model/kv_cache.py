"""Fixed-shape KV cache with per-row lengths (docs/design.md §8.1: rollback only moves lengths).

Dimensions: L layers, B rows, S capacity, T new tokens per row, Kv kv heads, Dh head dim.

Entries at positions >= lengths[b] are stale and never read: attention masks by absolute
position, and the next write overwrites them. Row b's next T tokens sit at `positions(T)`;
`write` puts their keys/values there and commits as many as it is told to.

A hybrid target's Gated DeltaNet layers keep no keys/values (their `k`/`v` entries are None)
but a `RecurrentState` each (`recurrent`, None on attention layers; () on an all-attention
model). `write` moves it by the same per-row count, replaying the pass's per-token inputs
(`model/recurrent_state.py`): the one place where a step's tokens are committed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.model.recurrent_state import RecurrentState


@struct.dataclass
class KVCache:
    k: tuple[jax.Array | None, ...]  # per layer [B, S, Kv, Dh]; None on a recurrent layer
    v: tuple[jax.Array | None, ...]
    lengths: jax.Array  # [B] int32: committed tokens per row
    recurrent: tuple[RecurrentState | None, ...] = ()  # per layer on a hybrid target

    @classmethod
    def create(
        cls, *, num_layers, batch, capacity, kv_heads, head_dim, dtype=jnp.float32, recurrent=()
    ):
        """`recurrent`: per layer a fresh RecurrentState (that layer keeps no K/V) or None."""
        shape = (batch, capacity, kv_heads, head_dim)
        attends = [not recurrent or recurrent[i] is None for i in range(num_layers)]
        return cls(
            k=tuple(jnp.zeros(shape, dtype) if a else None for a in attends),
            v=tuple(jnp.zeros(shape, dtype) if a else None for a in attends),
            lengths=jnp.zeros((batch,), jnp.int32),
            recurrent=tuple(recurrent),
        )

    @property
    def _first_kv(self) -> jax.Array:
        return next(k for k in self.k if k is not None)

    @property
    def capacity(self) -> int:
        return self._first_kv.shape[1]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def dtype(self):
        return self._first_kv.dtype

    def layer(self, i: int):
        """Layer i's cache: its (k, v), or its RecurrentState."""
        if self.recurrent and self.recurrent[i] is not None:
            return self.recurrent[i]
        return self.k[i], self.v[i]

    def positions(self, t: int) -> jax.Array:
        """[B, T] int32: where each row's next `t` tokens go (`lengths[b] + t`)."""
        return self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    def write(self, k, v, advance=None, recurrent=()) -> KVCache:
        """Writes per-layer [B, T, Kv, Dh] entries at `positions(T)` and moves the lengths by
        `advance` [B] (None: written but not committed, the lengths stay). Entries past a
        row's advance are written but stay masked; positions past the capacity drop. A
        recurrent layer's state takes the first `advance[b]` of its per-token `recurrent`
        entries (None on attention layers), so committing is not optional there."""
        t = next(x for x in k if x is not None).shape[1]
        positions_BxT = self.positions(t)
        if self.recurrent and (advance is None or len(recurrent) != len(self.recurrent)):
            raise ValueError("a recurrent state needs its layers' entries and the advance")
        lengths = self.lengths if advance is None else self.lengths + advance.astype(jnp.int32)
        states = tuple(
            None if st is None else st.advance(new, advance.astype(jnp.int32))
            for st, new in zip(self.recurrent, recurrent)
        )
        return KVCache(
            k=tuple(_write(c, n, positions_BxT) for c, n in zip(self.k, k)),
            v=tuple(_write(c, n, positions_BxT) for c, n in zip(self.v, v)),
            lengths=lengths,
            recurrent=states,
        )

    def rollback(self, lengths_B: jax.Array) -> KVCache:
        """Keeps only the first `lengths_B[b]` tokens of each row (attention layers only: a
        recurrent state cannot drop tokens it took, see `write`)."""
        if self.recurrent:
            raise ValueError("a recurrent state cannot roll back; commit with write(advance=)")
        return self.replace(lengths=jnp.minimum(self.lengths, lengths_B.astype(jnp.int32)))

    def with_lengths(self, lengths_B: jax.Array) -> KVCache:
        return self.replace(lengths=lengths_B.astype(jnp.int32))


def empty_cache(config, batch: int, capacity: int, dtype, recurrent=()) -> KVCache:
    """An empty cache for a model config's layers (a target's or a drafter's: both carry HF's
    num_hidden_layers, num_key_value_heads and head_dim)."""
    return KVCache.create(
        num_layers=config.num_hidden_layers,
        batch=batch,
        capacity=capacity,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=dtype,
        recurrent=recurrent,
    )


def _write(cache, new, positions_BxT):
    return None if cache is None else write_rows(cache, new, positions_BxT)


def write_rows(cache_BxSxKvxDh, new_BxTxKvxDh, positions_BxT):
    """Scatters T new entries per row at their absolute positions; out-of-range writes drop
    (dynamic_update_slice would clamp and silently overwrite valid entries)."""
    rows_Bx1 = jnp.arange(cache_BxSxKvxDh.shape[0])[:, None]
    return cache_BxSxKvxDh.at[rows_Bx1, positions_BxT].set(
        new_BxTxKvxDh.astype(cache_BxSxKvxDh.dtype), mode="drop"
    )
