"""Packed verification's two layouts of one step's tokens (docs/design.md §5.5).

Dimensions: B rows, W row width (the most tokens a row may verify), M packed tokens (a
static bucket >= Σ w_b).

Row b verifies its first w_b tokens (w_b = 0: none). In the packed layout they sit at
[start_b, start_b + w_b) of one M-token stream, padding after Σ w_b; the target runs its
position-wise work there (projections, MLP / MoE, the LM head), as M rows of one token. Token
mixing runs in the row layout [B, W], each row over its own window: attention over its cache
and its new tokens, the recurrence of a Gated DeltaNet. `unpack` and `pack` move between the
two with one gather of B·W or M entries; nothing indexes a cache.

A row's tokens may form a tree instead of a chain (`create` with `parent_BxW`: token j's
parent is an earlier token of its row, token 0 the root): a token then sits at its row's
length plus its depth, and sees its row's cache and its ancestors only (`visible_BxWxW`, in
place of the causal mask; `ancestors` gives a token's ancestor at a distance, which a
convolution over the last few inputs reads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Packing:
    row_M: jax.Array  # int32: the row a packed token belongs to (padding: the last row)
    col_M: jax.Array  # int32: its column in that row (padding: clamped into [0, W))
    valid_M: jax.Array  # bool: false on padding
    slot_BxW: jax.Array  # int32: the packed index of row b's column j; M where j >= w_b
    # a tree's (None: chains): each token's depth, the parents, and who sees whom
    depth_BxW: jax.Array | None = None  # int32: its ancestors' count
    parent_BxW: jax.Array | None = None  # int32: its parent's column (the root: itself)
    visible_BxWxW: jax.Array | None = None  # bool: [b, i, j] token j is i or its ancestor
    # every row at the full width (`dense`): pack and unpack are reshapes, no gathers
    full: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def create(cls, width_B, tokens: int, row_width: int, parent_BxW=None) -> Packing:
        """Rows of `width_B` tokens packed in order into `tokens` (M >= Σ width_B) slots;
        with `parent_BxW` (each token's parent column, earlier than itself; the root's is
        ignored) the rows' tokens are trees."""
        tree = {} if parent_BxW is None else tree_fields(parent_BxW)
        width_B = width_B.astype(jnp.int32)
        end_B = jnp.cumsum(width_B)
        start_B = end_B - width_B
        p_M = jnp.arange(tokens, dtype=jnp.int32)
        row_M = jnp.minimum(jnp.searchsorted(end_B, p_M, side="right"), width_B.shape[0] - 1)
        j_W = jnp.arange(row_width, dtype=jnp.int32)
        return cls(
            row_M=row_M.astype(jnp.int32),
            col_M=jnp.clip(p_M - start_B[row_M], 0, row_width - 1),
            valid_M=p_M < end_B[-1],
            slot_BxW=jnp.where(j_W[None] < width_B[:, None], start_B[:, None] + j_W[None], tokens),
            **tree,
        )

    @classmethod
    def dense(cls, rows: int, row_width: int) -> Packing:
        """Every row at the full width: the row layout read as a stream of B·W tokens."""
        p_M = np.arange(rows * row_width, dtype=np.int32)
        return cls(
            row_M=jnp.asarray(p_M // row_width),
            col_M=jnp.asarray(p_M % row_width),
            valid_M=jnp.ones(p_M.shape, bool),
            slot_BxW=jnp.asarray(p_M.reshape(rows, row_width)),
            full=True,
        )

    @property
    def tokens(self) -> int:
        return self.row_M.shape[0]

    @property
    def row_width(self) -> int:
        return self.slot_BxW.shape[1]

    @property
    def is_tree(self) -> bool:
        return self.visible_BxWxW is not None

    def positions(self, lengths_B) -> jax.Array:
        """[M] int32: each packed token's absolute position (its row's length + its column,
        or its depth in a tree)."""
        offset_M = self.col_M if self.depth_BxW is None else self.depth_BxW[self.row_M, self.col_M]
        return lengths_B[self.row_M] + offset_M

    def ancestors(self, distance: int) -> jax.Array:
        """[B, W] int32: each token's ancestor `distance` generations up (the column), or
        −1 − the generations still missing where the row's root is nearer (a chain: j −
        distance either way)."""
        w = self.row_width
        j_BxW = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32)[None], self.slot_BxW.shape)
        if self.parent_BxW is None:
            return j_BxW - distance
        at_BxW = j_BxW
        for _ in range(distance):
            at_BxW = jnp.take_along_axis(self.parent_BxW, at_BxW, axis=1)
        return jnp.where(self.depth_BxW >= distance, at_BxW, self.depth_BxW - distance)

    def pack(self, x_BxWx):
        """Row layout [B, W, ...] → packed [M, ...] (padding takes some row's last column)."""
        if self.full:
            return x_BxWx.reshape(-1, *x_BxWx.shape[2:])
        return x_BxWx[self.row_M, self.col_M]

    def unpack(self, x_Mx, fill=0):
        """Packed [M, ...] → row layout [B, W, ...], `fill` past each row's width."""
        if self.full:
            return x_Mx.reshape(*self.slot_BxW.shape, *x_Mx.shape[1:])
        return jnp.take(x_Mx, self.slot_BxW, axis=0, mode="fill", fill_value=fill)


def to_rows(packing: Packing | None, x_Mx1x):
    """A layer's packed activations [M, 1, ...] in the row layout [B, W, ...]; without a
    packing they are in it already."""
    return x_Mx1x if packing is None else packing.unpack(x_Mx1x[:, 0])


def to_tokens(packing: Packing | None, x_BxWx):
    """The row layout [B, W, ...] back to the packed activations [M, 1, ...]."""
    return x_BxWx if packing is None else packing.pack(x_BxWx)[:, None]


def tree_fields(parent_BxW) -> dict:
    """Depths, parents (the root its own) and the ancestor-or-self mask of trees given by
    each token's parent column (earlier than itself): the mask by repeated squaring of the
    parent relation, log2 W boolean products of [W, W] matrices per row."""
    b, w = parent_BxW.shape
    j_W = jnp.arange(w, dtype=jnp.int32)
    parent_BxW = jnp.where(j_W[None] == 0, 0, jnp.minimum(parent_BxW.astype(jnp.int32), j_W - 1))
    parent_BxW = jnp.maximum(parent_BxW, 0)
    eye_WxW = jnp.eye(w, dtype=bool)
    up_BxWxW = (parent_BxW[:, :, None] == j_W[None, None, :]) | eye_WxW[None]
    reach, span = up_BxWxW, 1
    while span < w:
        hops = jnp.einsum("bij,bjk->bik", reach.astype(jnp.int32), reach.astype(jnp.int32))
        reach, span = hops > 0, 2 * span
    depth_BxW = jnp.sum(reach.astype(jnp.int32), axis=2) - 1
    return dict(depth_BxW=depth_BxW, parent_BxW=parent_BxW, visible_BxWxW=reach)
