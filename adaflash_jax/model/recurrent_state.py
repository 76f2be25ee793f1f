"""A Gated DeltaNet layer's decode state, and how it moves on by a per-row number of tokens
(docs/design.md §2.1, §5.2).

Dimensions: B rows, T new tokens per row, X conv channels (q, k, v before the conv), A conv
taps (A − 1 of history), J value heads, Dk / Dv key / value head dims.

A cache kind of `model/cache.py`. An attention cache drops tokens by moving lengths; a
recurrence cannot. So the layer's pass returns the recurrence's per-token inputs
(`RecurrentEntries`: the conv inputs and the post-conv k, v, g, β, all B·T·(X + J·(Dk + Dv +
2)) numbers, against the state's B·J·Dk·Dv), and `commit` replays the cheap recurrence over
each row's first n_b tokens of its path: a token past n_b gets g = 0 and β = 0, which leaves
the state as it was (`kept`: the one commit mask), and the conv history shifts by n_b. The
state is float32.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.model.cache import path_entries
from adaflash_jax.model.delta_rule import DEFAULT_CHUNK, chunked_form


@struct.dataclass
class RecurrentEntries:
    """One pass's per-token recurrence inputs, for `RecurrentState.commit`."""

    qkv_BxTxX: jax.Array  # conv inputs (for the history)
    k_BxTxJxDk: jax.Array  # after the conv, L2-normalised, repeated to the value heads
    v_BxTxJxDv: jax.Array
    g_BxTxJ: jax.Array  # log decay (≤ 0)
    beta_BxTxJ: jax.Array

    def kept(self, n_B) -> RecurrentEntries:
        """The entries with each row's tokens past its first `n_B[b]` made state-neutral
        (g = 0, β = 0): the one commit mask."""
        t = self.g_BxTxJ.shape[1]
        keep_BxTx1 = (jnp.arange(t)[None, :] < n_B[:, None])[..., None]
        return self.replace(
            g_BxTxJ=jnp.where(keep_BxTx1, self.g_BxTxJ, 0.0),
            beta_BxTxJ=jnp.where(keep_BxTx1, self.beta_BxTxJ, 0.0),
        )


@struct.dataclass
class RecurrentState:
    history_BxA1xX: jax.Array  # the last A − 1 conv inputs, float32
    state_BxJxDkxDv: jax.Array  # the delta rule's state, float32
    chunk: int = struct.field(pytree_node=False, default=DEFAULT_CHUNK)  # the replay's
    rolls_back: ClassVar[bool] = False

    @classmethod
    def create(cls, *, batch, taps, channels, heads, key_dim, value_dim, chunk=DEFAULT_CHUNK):
        return cls(
            history_BxA1xX=jnp.zeros((batch, taps - 1, channels), jnp.float32),
            state_BxJxDkxDv=jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32),
            chunk=chunk,
        )

    def commit(
        self, entries: RecurrentEntries, lengths_B, path_BxZ, n_B, *, state_after=None
    ) -> RecurrentState:
        """The state after each row's first `n_B[b]` tokens of its path through `entries`.
        `state_after`: the delta state a pass already reached over `entries.kept(n_B)` in
        order ("write" mode, path None): taken instead of replaying the rule."""
        del lengths_B  # a recurrence has no positions
        new = path_entries(entries, path_BxZ).kept(n_B)
        history = shift_history(self.history_BxA1xX, new.qkv_BxTxX, n_B)
        if state_after is not None:
            if path_BxZ is not None:
                raise ValueError("a pass's end state holds for its tokens in order, not a path")
            return self.replace(history_BxA1xX=history, state_BxJxDkxDv=state_after)
        _, state = chunked_form(
            jnp.zeros_like(new.k_BxTxJxDk),  # no outputs are read
            new.k_BxTxJxDk,
            new.v_BxTxJxDv,
            new.g_BxTxJ,
            new.beta_BxTxJ,
            self.state_BxJxDkxDv,
            self.chunk,
        )
        return self.replace(history_BxA1xX=history, state_BxJxDkxDv=state)


def shift_history(history_BxA1xX, new_BxTxX, n_B):
    """The last A − 1 conv inputs after each row takes its first `n_B[b]` new ones."""
    a1 = history_BxA1xX.shape[1]
    seq_BxA1TxX = jnp.concatenate([history_BxA1xX, new_BxTxX.astype(history_BxA1xX.dtype)], 1)
    idx_BxA1 = n_B[:, None].astype(jnp.int32) + jnp.arange(a1, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(seq_BxA1TxX, idx_BxA1[..., None], axis=1)
