"""The sliding-window attention cache kind: a ring buffer of `window − 1` slots (docs/design.md
§2.2).

Dimensions: B rows, Sw ring slots (window − 1), T new tokens per row (one pass), Z committed
path length, Kv kv heads, Dh head dim, H query heads.

A query at position q of a window-`window` layer sees the keys at positions p with
q − window < p <= q (`visible`: the rule the drafter's masks and a target's sliding layer
share). The new tokens of a pass sit at positions `lengths_B[b] + 0..T−1`, and the earliest of
them sees the committed positions `lengths − window + 1 .. lengths − 1`: window − 1 entries,
the most any query of any pass reads from the cache (later queries read fewer, and the rest
from the pass's own keys). So a ring of window − 1 slots holds everything a pass can see:
position p lives in slot p mod (window − 1), and memory is constant past the window.

Writes happen only at commit, with the count kept (the protocol of `model/cache.py`: verify
reads the cache and returns its entries, `Cache.commit` hands back the accepted count). A
commit writes ONLY each row's kept tokens (a `KVLayer` may write stale entries past its count;
here they would overwrite live slots), and of those only the last window − 1 (a prefill longer
than the window: earlier ones would be overwritten in the same scatter, in an unspecified
order). A pass that was verified across the wrap and kept n < T tokens is therefore exact:
nothing it did not keep was ever written. Moving the lengths back (`Cache.rollback`) is
refused by name (`rolls_back` False): the slots of positions older than the window are reused,
so dropping committed tokens would expose entries that are gone. A ring that could roll back
r tokens would need window − 1 + r slots; the engine never rolls a cache back (it commits what
it keeps), so none is built.

What an attention layer calls, in both of the protocol's modes (a sliding-window target
layer in `model/target.py` the same way as the drafter's sliding layers):

    entries = KVEntries(k_BxTxKvxDh.astype(ring.dtype), v_BxTxKvxDh.astype(ring.dtype))
    out_BxTxHxDh = attend_window(q_BxTxHxDh, ring, lengths_B, positions_BxT,
                                 k_BxTxKvxDh, v_BxTxKvxDh, visible_BxTxT)
    # "read" (verify): return `entries`; `Cache.commit` later calls
    #     ring.commit(entries, lengths_B, path_BxZ, n_B)
    # "write" (prefill, plain step, count `commit_B` known before the pass):
    #     ring = ring.commit(entries, lengths_B, None, commit_B); return ring
    # (attend first, then commit: writing first would overwrite the slots of the positions
    # the pass's first queries still see. The ring is window − 1 slots, so the copy a
    # commit after the read makes is small.)

`positions_BxT` are the new tokens' positions (`lengths + 0..T−1` on a chain, `lengths +
depth` in a draft tree), `visible_BxTxT` the new tokens' own mask (None: causal; a tree's
ancestor mask otherwise); both masks are intersected with the window.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.model.cache import path_entries
from adaflash_jax.model.kv_cache import KVEntries
from adaflash_jax.model.layers import attend


@struct.dataclass
class RingKVLayer:
    k_BxSwxKvxDh: jax.Array
    v_BxSwxKvxDh: jax.Array
    window: int = struct.field(pytree_node=False)
    rolls_back: ClassVar[bool] = False

    @classmethod
    def create(cls, *, batch, window, kv_heads, head_dim, dtype) -> RingKVLayer:
        if window < 2:
            raise ValueError(f"a ring-buffer window must be at least 2, got {window}")
        shape = (batch, window - 1, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), window)

    @property
    def slots(self) -> int:
        return self.k_BxSwxKvxDh.shape[1]

    @property
    def dtype(self):
        return self.k_BxSwxKvxDh.dtype

    def commit(self, entries: KVEntries, lengths_B, path_BxZ, n_B) -> RingKVLayer:
        """Writes each row's kept path entries j < `n_B[b]` (the last window − 1 of them) at
        slot `(lengths_B[b] + j) mod (window − 1)`; nothing else is written."""
        new = path_entries(entries, path_BxZ)
        z, sw = new.k_BxTxKvxDh.shape[1], self.slots
        j_1xZ = jnp.arange(z, dtype=jnp.int32)[None, :]
        n_Bx1 = n_B.astype(jnp.int32)[:, None]
        keep_BxZ = (j_1xZ < n_Bx1) & (j_1xZ >= n_Bx1 - sw)
        slot_BxZ = jnp.where(keep_BxZ, (lengths_B[:, None] + j_1xZ) % sw, sw)  # sw: dropped
        rows_Bx1 = jnp.arange(slot_BxZ.shape[0])[:, None]

        def write(ring, values):
            return ring.at[rows_Bx1, slot_BxZ].set(values.astype(ring.dtype), mode="drop")

        return self.replace(
            k_BxSwxKvxDh=write(self.k_BxSwxKvxDh, new.k_BxTxKvxDh),
            v_BxSwxKvxDh=write(self.v_BxSwxKvxDh, new.v_BxTxKvxDh),
        )

    def read(self, lengths_B):
        """The window − 1 committed positions before each row's next token, oldest first:
        (keys, values [B, Sw, Kv, Dh], their positions [B, Sw] int32, negative where the row
        is shorter than the window: never visible)."""
        positions_BxSw = window_positions(lengths_B, self.window)
        slot_BxSwx1x1 = (positions_BxSw % self.slots)[:, :, None, None]
        k = jnp.take_along_axis(self.k_BxSwxKvxDh, slot_BxSwx1x1, axis=1)
        v = jnp.take_along_axis(self.v_BxSwxKvxDh, slot_BxSwx1x1, axis=1)
        return k, v, positions_BxSw


def window_positions(lengths_B, window: int):
    """The window − 1 positions `lengths − window + 1 .. lengths − 1` per row: [B, window − 1]
    int32 (negative where the row is shorter)."""
    return lengths_B[:, None] - (window - 1) + jnp.arange(window - 1, dtype=jnp.int32)[None, :]


def visible(key_pos_BxC, lengths_B, query_pos_BxT, window: int | None):
    """bool [B, T, C]: the query at `query_pos` sees the committed key at `key_pos` iff
    0 <= key_pos < lengths and, in a window, key_pos > query_pos − window."""
    key_pos_Bx1xC = key_pos_BxC[:, None, :]
    seen = (key_pos_Bx1xC >= 0) & (key_pos_Bx1xC < lengths_B[:, None, None])
    if window is not None:
        seen &= key_pos_Bx1xC > query_pos_BxT[:, :, None] - window
    return seen


def attend_window(
    q_BxTxHxDh, ring, lengths_B, positions_BxT, new_k_BxTxKvxDh, new_v, visible_BxTxT=None
):
    """Attention of T new tokens (at `positions_BxT`) over [the ring's window ; themselves
    (causal, or `visible_BxTxT`)], both under the window; the ring is only read."""
    t = q_BxTxHxDh.shape[1]
    ring_k, ring_v, key_pos_BxSw = ring.read(lengths_B)
    cache_BxTxSw = visible(key_pos_BxSw, lengths_B, positions_BxT, ring.window)
    if visible_BxTxT is None:
        visible_BxTxT = jnp.tril(jnp.ones((t, t), bool))[None]
    near_BxTxT = positions_BxT[:, None, :] > positions_BxT[:, :, None] - ring.window
    new_BxTxT = visible_BxTxT & near_BxTxT
    k = jnp.concatenate([ring_k.astype(q_BxTxHxDh.dtype), new_k_BxTxKvxDh], axis=1)
    v = jnp.concatenate([ring_v.astype(q_BxTxHxDh.dtype), new_v], axis=1)
    return attend(q_BxTxHxDh, k, v, jnp.concatenate([cache_BxTxSw, new_BxTxT], axis=-1))
