"""Verify attention as a Pallas TPU kernel that reads each row's committed cache only
(docs/design.md §5.6): the kernel form of `layers.attend_cached`.

Dimensions: B rows, W new tokens per row (a verify width or a tree's W = Y + 1), S cache
capacity, Ts cache tokens per tile, H query heads, Kv kv heads (G = H / Kv), Dh head dim,
R = G · W query rows per kv head.

`attend_cached` scores every row's queries against the whole capacity S and masks what lies
past the row's length, so a step reads B · S cache entries and materialises a float32
[B, Kv, G, W, S] score tensor, whatever the rows' lengths. Here the grid runs (row, cache
tile): a tile past the row's length repeats the index of the row's last live tile, which the
pipeline does not fetch again, and computes nothing, so a row reads ⌈length / Ts⌉ tiles;
scores exist one tile at a time under an online softmax (running max, normaliser and
accumulator in VMEM scratch). The row's new tokens come last, masked by `visible_BxWxW` (a
tree's ancestors-or-self; the causal mask for a chain). Scores and the softmax run in
float32, as in `attend_cached`.

gpt-oss (docs/design.md §2.3): a sink logit per query head starts each running softmax (max
the sink, normaliser 1, accumulator 0: a logit that attends to nothing), and a sliding-window
layer's queries see cache positions >= their position − window + 1 only: a row's tiles wholly
before its earliest query's window are neither fetched (their index is the first live tile's)
nor computed, so a windowed row reads about ⌈window / Ts⌉ + 1 tiles however long it is.

Checked in interpret mode against `attend_cached` on CPU, and compiled by Mosaic for v5e
deviceless (tests/test_ragged_attention.py); opt-in (`TargetLM(verify_attention="pallas")`)
until it has run on a TPU (docs/design.md §5.6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from adaflash_jax.model.layers import NEG_INF, in_window

DEFAULT_TILE = 128  # cache tokens per tile (Ts)
LANES = 128  # the running max and normaliser are kept lane-replicated


def _online_update(m_ref, l_ref, acc_ref, kv: int, scores_RxT, v_TxDh):
    """Folds one block of masked float32 scores [R, T] of kv head `kv` and its values into
    the running softmax (max and normaliser kept lane-replicated, [R, LANES])."""
    m_old = m_ref[kv]
    m_new = jnp.maximum(m_old, jnp.max(scores_RxT, axis=-1, keepdims=True))
    p_RxT = jnp.exp(scores_RxT - m_new[:, :1])
    rescale = jnp.exp(m_old - m_new)
    l_ref[kv] = l_ref[kv] * rescale + jnp.sum(p_RxT, axis=-1, keepdims=True)
    pv = jax.lax.dot_general(
        p_RxT, v_TxDh.astype(jnp.float32), (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    acc_ref[kv] = acc_ref[kv] * rescale[:, :1] + pv
    m_ref[kv] = m_new


def _scores(q_RxDh, k_TxDh):
    return jax.lax.dot_general(
        q_RxDh, k_TxDh.astype(jnp.float32), (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )  # fmt: skip


def _kernel(lengths_ref, firsts_ref, q_ref, k_ref, v_ref, new_k_ref, new_v_ref, visible_ref,
            low_ref, sinks_ref, o_ref, m_ref, l_ref, acc_ref, *, tile: int, scale: float,
            sinks: bool):  # fmt: skip
    """One (row, cache tile) step for every kv head; a query row r is (g, w) = divmod(r, W)."""
    b, s = pl.program_id(0), pl.program_id(1)
    kv_heads = q_ref.shape[1]

    @pl.when(s == 0)
    def _init():
        if sinks:  # each query row's sink logit, already counted once in the normaliser
            m_ref[...] = sinks_ref[...]
            l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
        else:
            m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((s * tile < lengths_ref[b]) & ((s + 1) * tile > firsts_ref[b]))
    def _cache_tile():
        key_1xT = s * tile + jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1)
        live_RxT = (key_1xT < lengths_ref[b]) & (key_1xT >= low_ref[0][:, :1])
        live_Tx1 = s * tile + jax.lax.broadcasted_iota(jnp.int32, (tile, 1), 0) < lengths_ref[b]
        for kv in range(kv_heads):
            q_RxDh = q_ref[0, kv].astype(jnp.float32) * scale
            scores = jnp.where(live_RxT, _scores(q_RxDh, k_ref[0, :, kv, :]), NEG_INF)
            v_TxDh = jnp.where(live_Tx1, v_ref[0, :, kv, :].astype(jnp.float32), 0.0)
            _online_update(m_ref, l_ref, acc_ref, kv, scores, v_TxDh)

    @pl.when(s == pl.num_programs(1) - 1)
    def _new_tokens_and_out():
        visible_RxW = visible_ref[0] > 0
        for kv in range(kv_heads):
            q_RxDh = q_ref[0, kv].astype(jnp.float32) * scale
            scores = jnp.where(visible_RxW, _scores(q_RxDh, new_k_ref[0, :, kv, :]), NEG_INF)
            _online_update(m_ref, l_ref, acc_ref, kv, scores, new_v_ref[0, :, kv, :])
            o_ref[0, kv] = (acc_ref[kv] / l_ref[kv][:, :1]).astype(o_ref.dtype)


def tile_for(capacity: int, tile: int = DEFAULT_TILE) -> int:
    """The largest tile <= `tile` that divides the capacity (the capacity itself if none)."""
    for t in range(min(tile, capacity), 0, -1):
        if capacity % t == 0 and (t % 8 == 0 or t == capacity):
            return t
    return capacity


@functools.partial(jax.jit, static_argnames=("tile", "interpret", "window"))
def ragged_attend_cached(q_BxWxHxDh, cache_k_BxSxKvxDh, cache_v, lengths_B, new_k_BxWxKvxDh,
                         new_v, visible_BxWxW=None, *, sinks_H=None, window: int | None = None,
                         positions_BxT=None, tile: int | None = None,
                         interpret: bool = False):  # fmt: skip
    """`layers.attend_cached`'s result, reading each row's first ⌈length / Ts⌉ cache tiles
    only (of them, with a `window`, those the window of the queries at `positions_BxT`
    reaches). `visible_BxWxW` None: causal over the new tokens; `sinks_H`: a logit per
    query head in every denominator."""
    b, w, h, dh = q_BxWxHxDh.shape
    s, kv = cache_k_BxSxKvxDh.shape[1], cache_k_BxSxKvxDh.shape[2]
    ts = tile_for(s) if tile is None else tile
    if s % ts:
        raise ValueError(f"cache tile {ts} must divide the capacity {s}")
    if visible_BxWxW is None:
        visible_BxWxW = jnp.broadcast_to(jnp.tril(jnp.ones((w, w), bool)), (b, w, w))
    lengths_B = lengths_B.astype(jnp.int32)
    g = h // kv
    r = g * w  # query rows per kv head: (g, w)
    q_BxKvxRxDh = q_BxWxHxDh.reshape(b, w, kv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, kv, r, dh)
    if window is None:
        low_BxW = jnp.zeros((b, w), jnp.int32)
    else:  # the lowest cache position each query sees; its own tokens under the window too
        visible_BxWxW = visible_BxWxW & in_window(positions_BxT, positions_BxT, window)
        low_BxW = jnp.maximum(positions_BxT.astype(jnp.int32) - window + 1, 0)
    firsts_B = low_BxW.min(axis=1)
    visible_BxRxW = jnp.tile(visible_BxWxW.astype(jnp.int32), (1, g, 1))
    low_BxRxL = jnp.broadcast_to(jnp.tile(low_BxW, (1, g))[:, :, None], (b, r, LANES))
    sink_H = jnp.full((h,), NEG_INF, jnp.float32) if sinks_H is None else sinks_H
    sinks_KvxRxL = jnp.broadcast_to(
        jnp.repeat(sink_H.astype(jnp.float32).reshape(kv, g), w, axis=1)[:, :, None],
        (kv, r, LANES),
    )

    def cache_block(i, t, lengths, firsts):  # outside the row's live tiles: the nearest one
        last = jax.lax.div(jnp.maximum(lengths[i] - 1, 0), ts)  # >= 0: no floor rounding
        first = jnp.minimum(jax.lax.div(firsts[i], ts), last)
        return (i, jnp.clip(t, first, last), 0, 0)

    def row_block(i, t, lengths, firsts):
        return (i, 0, 0, 0)

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, s // ts),
        in_specs=[
            pl.BlockSpec((1, kv, r, dh), row_block),
            pl.BlockSpec((1, ts, kv, dh), cache_block),
            pl.BlockSpec((1, ts, kv, dh), cache_block),
            pl.BlockSpec((1, w, kv, dh), row_block),
            pl.BlockSpec((1, w, kv, dh), row_block),
            pl.BlockSpec((1, r, w), lambda i, t, lengths, firsts: (i, 0, 0)),
            pl.BlockSpec((1, r, LANES), lambda i, t, lengths, firsts: (i, 0, 0)),
            pl.BlockSpec((kv, r, LANES), lambda i, t, lengths, firsts: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((1, kv, r, dh), row_block),
        scratch_shapes=[
            pltpu.VMEM((kv, r, LANES), jnp.float32),
            pltpu.VMEM((kv, r, LANES), jnp.float32),
            pltpu.VMEM((kv, r, dh), jnp.float32),
        ],
    )
    kernel = functools.partial(_kernel, tile=ts, scale=dh**-0.5, sinks=sinks_H is not None)
    out_BxKvxRxDh = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, kv, r, dh), q_BxWxHxDh.dtype),
        grid_spec=spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(lengths_B, firsts_B, q_BxKvxRxDh, cache_k_BxSxKvxDh, cache_v, new_k_BxWxKvxDh, new_v,
      visible_BxRxW, low_BxRxL, sinks_KvxRxL)  # fmt: skip
    return out_BxKvxRxDh.reshape(b, kv, g, w, dh).transpose(0, 3, 1, 2, 4).reshape(b, w, h, dh)
