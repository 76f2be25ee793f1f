"""One cache per layer, one commit path (docs/design.md §8.1).

Dimensions: L layers, B rows, T new tokens per row (one pass), Z committed path length.

A model's decode cache is a tuple of per-layer caches plus each row's committed length
(`lengths`: where its next token goes, the same for every layer). A layer cache is a small
pytree of its own kind (`LayerCache`): attention K/V (`kv_cache.KVLayer`), a sliding-window
layer's ring buffer of its window (`ring_cache.RingKVLayer`), a Gated DeltaNet's recurrent
state (`recurrent_state.RecurrentState`), the drafter's context K/V (`KVLayer`s, rings in its
sliding layers, of projected target features). Each keeps its own storage and capacity.

Only a kind's `commit` writes a cache. Called with its cache in "read" mode (the engine's
verify), a layer only reads it and returns, besides its output, its per-token *entries* for
the pass's T tokens (K/V, or the recurrence's inputs); `Cache.commit` later hands each layer
its entries and the tokens to keep, and moves the lengths. In "write" mode (prefill, plain
steps) the count is known before the pass: the layer commits its entries through its
kind's `commit` as it runs (K/V are written before they are attended, so the update stays
in place; a recurrence keeps the state its pass ends in) and `Cache.committed` moves the
lengths.

`commit(entries, lengths_B, path_BxZ, n_B)` keeps, per row, the first `n_B[b]` tokens of the
path `path_BxZ[b]` (indices into the pass's T tokens, in order; None: 0..T−1, a chain), as
positions `lengths_B[b] + 0..n_B[b]−1`. A new kind adds one class with that method (the ring
buffer writes the kept entries at their position modulo its window − 1 slots; a latent cache
would store one compressed entry per token) and the layer that returns its entries; nothing
else changes.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp
from flax import struct


class LayerCache(Protocol):
    """What `Cache` asks of one layer's cache (a `flax.struct` pytree with rows first)."""

    # whether tokens committed past a row's length may be dropped by moving the length back
    # (`Cache.rollback`): true where entries are stored per position, false for a recurrence
    rolls_back: ClassVar[bool]

    def commit(self, entries, lengths_B, path_BxZ, n_B) -> LayerCache:
        """This layer's cache after each row keeps the first `n_B[b]` tokens of its path."""


@struct.dataclass
class Cache:
    layers: tuple  # per layer a LayerCache
    lengths: jax.Array  # [B] int32: committed tokens per row
    capacity: int = struct.field(pytree_node=False)  # the positions a row may reach
    dtype: object = struct.field(pytree_node=False)  # the K/V dtype it was made with

    @classmethod
    def create(cls, layers, *, batch: int, capacity: int, dtype) -> Cache:
        return cls(tuple(layers), jnp.zeros((batch,), jnp.int32), capacity, jnp.dtype(dtype))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def positions(self, t: int) -> jax.Array:
        """[B, T] int32: the positions of each row's next `t` tokens along a chain."""
        return self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    def commit(self, entries: tuple, n_B, path_BxZ=None) -> Cache:
        """Each layer keeps the first `n_B[b]` tokens of row b's path through the pass whose
        per-layer `entries` are given (path None: the pass's tokens in order), and the
        lengths move by `n_B`. Entries past a row's count may be stored but stay unread."""
        if len(entries) != len(self.layers):
            raise ValueError(f"{len(entries)} layers' entries for a {len(self.layers)}-layer cache")
        n_B = n_B.astype(jnp.int32)
        layers = tuple(
            c.commit(e, self.lengths, path_BxZ, n_B) for c, e in zip(self.layers, entries)
        )
        return self.committed(layers, n_B)

    def committed(self, layers: tuple, n_B) -> Cache:
        """The cache whose layers committed `n_B` more tokens per row each (a "write" mode
        forward: each layer commits through its kind's `commit` during the pass)."""
        return self.replace(layers=tuple(layers), lengths=self.lengths + n_B.astype(jnp.int32))

    def rollback(self, lengths_B) -> Cache:
        """Keeps only the first `lengths_B[b]` committed tokens of each row (every layer's
        kind must store entries per position: a recurrence cannot drop what it took)."""
        kinds = sorted({type(c).__name__ for c in self.layers if not c.rolls_back})
        if kinds:
            raise ValueError(f"{', '.join(kinds)} cannot roll back; commit only what is kept")
        return self.with_lengths(jnp.minimum(self.lengths, lengths_B.astype(jnp.int32)))

    def with_lengths(self, lengths_B) -> Cache:
        return self.replace(lengths=lengths_B.astype(jnp.int32))


def path_entries(entries_BxTx, path_BxZ):
    """Per-token entries (any pytree of [B, T, ...] leaves) along each row's path → [B, Z, ...]
    (None: the entries as they are)."""
    if path_BxZ is None:
        return entries_BxTx

    def take(x):
        index = path_BxZ.reshape(path_BxZ.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, index.astype(jnp.int32), axis=1)

    return jax.tree.map(take, entries_BxTx)
