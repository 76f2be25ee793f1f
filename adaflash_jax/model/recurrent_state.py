"""A Gated DeltaNet layer's decode state, and how it moves on by a per-row number of tokens
(docs/design.md §2.1, §5.2).

Dimensions: B rows, T new tokens per row, X conv channels (q, k, v before the conv), A conv
taps (A − 1 of history), J value heads, Dk / Dv key / value head dims.

An attention cache commits tokens by moving lengths; a recurrence has no lengths. So a pass
that may not commit all its tokens (the engine's verify, "read" cache mode) returns the
recurrence's per-token inputs (`RecurrentEntries`: the conv inputs and the post-conv k, v, g,
β, all B·T·(X + J·(Dk + Dv + 2)) numbers, against the state's B·J·Dk·Dv), and `advance` replays
the cheap recurrence over each row's first n_b of them: a token past n_b gets g = 0 and β = 0,
which leaves the state as it was, and the conv history shifts by n_b. The state is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.model.delta_rule import DEFAULT_CHUNK, chunked_form


@struct.dataclass
class RecurrentEntries:
    """One pass's per-token recurrence inputs, for `RecurrentState.advance`."""

    qkv_BxTxX: jax.Array  # conv inputs (for the history)
    k_BxTxJxDk: jax.Array  # after the conv, L2-normalised, repeated to the value heads
    v_BxTxJxDv: jax.Array
    g_BxTxJ: jax.Array  # log decay (≤ 0)
    beta_BxTxJ: jax.Array


@struct.dataclass
class RecurrentState:
    history_BxA1xX: jax.Array  # the last A − 1 conv inputs, float32
    state_BxJxDkxDv: jax.Array  # the delta rule's state, float32

    @classmethod
    def create(cls, *, batch, taps, channels, heads, key_dim, value_dim):
        return cls(
            history_BxA1xX=jnp.zeros((batch, taps - 1, channels), jnp.float32),
            state_BxJxDkxDv=jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32),
        )

    def advance(self, new: RecurrentEntries, n_B, chunk: int = DEFAULT_CHUNK) -> RecurrentState:
        """The state after each row's first `n_B[b]` tokens of `new` (the rest dropped)."""
        t = new.g_BxTxJ.shape[1]
        keep_BxTx1 = (jnp.arange(t)[None, :] < n_B[:, None])[..., None]
        q_dummy = jnp.zeros_like(new.k_BxTxJxDk)
        _, state = chunked_form(
            q_dummy,
            new.k_BxTxJxDk,
            new.v_BxTxJxDv,
            jnp.where(keep_BxTx1, new.g_BxTxJ, 0.0),
            jnp.where(keep_BxTx1, new.beta_BxTxJ, 0.0),
            self.state_BxJxDkxDv,
            chunk,
        )
        return RecurrentState(shift_history(self.history_BxA1xX, new.qkv_BxTxX, n_B), state)


def shift_history(history_BxA1xX, new_BxTxX, n_B):
    """The last A − 1 conv inputs after each row takes its first `n_B[b]` new ones."""
    a1 = history_BxA1xX.shape[1]
    seq_BxA1TxX = jnp.concatenate([history_BxA1xX, new_BxTxX.astype(history_BxA1xX.dtype)], 1)
    idx_BxA1 = n_B[:, None].astype(jnp.int32) + jnp.arange(a1, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(seq_BxA1TxX, idx_BxA1[..., None], axis=1)
