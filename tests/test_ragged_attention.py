"""The Pallas verify-attention kernel (model/ragged_attention.py), in interpret mode on CPU,
against the XLA reference `layers.attend_cached`: chains (causal) and trees (ancestor masks),
ragged row lengths from 0 to the capacity, grouped-query heads, several tiles per row; with
gpt-oss's attention sinks and sliding window (tiles before the window skipped)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.model.layers import attend_cached
from adaflash_jax.model.packing import Packing
from adaflash_jax.model.ragged_attention import ragged_attend_cached, tile_for

B, W, H, KV, DH, S = 4, 6, 4, 2, 8, 64


def _inputs(seed, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, W, H, DH), dtype)
    ck = jax.random.normal(keys[1], (B, S, KV, DH), dtype)
    cv = jax.random.normal(keys[2], (B, S, KV, DH), dtype)
    nk = jax.random.normal(keys[3], (B, W, KV, DH), dtype)
    nv = jax.random.normal(keys[4], (B, W, KV, DH), dtype)
    return q, ck, cv, nk, nv


def _tree_visible(seed):
    """Ancestor-or-self masks of random trees (each token's parent an earlier token)."""
    rng = np.random.default_rng(seed)
    parent = np.zeros((B, W), np.int32)
    for i in range(1, W):
        parent[:, i] = rng.integers(0, i, size=B)
    widths = jnp.full((B,), W, jnp.int32)
    packing = Packing.create(widths, W * B, W, parent_BxW=jnp.asarray(parent))
    return packing.visible_BxWxW


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("tile", [8, 16, 64])
def test_kernel_equals_the_xla_reference(tree, tile):
    q, ck, cv, nk, nv = _inputs(tile)
    lengths = jnp.array([0, 5, 33, S - W], jnp.int32)  # an empty row, part tiles, a full one
    visible = _tree_visible(tile) if tree else None
    want = attend_cached(q, ck, cv, lengths, nk, nv, visible)
    got = ragged_attend_cached(q, ck, cv, lengths, nk, nv, visible, tile=tile, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "window, tree", [(None, True), (5, False), (20, True)], ids=["tree", "5-chain", "20-tree"]
)
def test_kernel_with_sinks_and_window_equals_the_xla_reference(window, tree):
    """gpt-oss: sink logits per head (some large, so they take most of the mass) and a
    sliding window shorter than a tile, longer than one, or none; cache entries before each
    row's window are NaN, so a skipped tile that were read would show."""
    q, ck, cv, nk, nv = _inputs(7)
    lengths = jnp.array([0, 5, 33, S - W], jnp.int32)
    sinks = jnp.array([0.5, -1.0, 3.0, 8.0], jnp.float32)
    visible = _tree_visible(3) if tree else None
    depth = jnp.arange(W, dtype=jnp.int32)[None]
    if tree:  # a token's position is its row's length plus its depth
        depth = jnp.sum(visible, axis=2).astype(jnp.int32) - 1
    positions = lengths[:, None] + depth
    kw = dict(sinks_H=sinks, window=window, positions_BxT=positions)
    want = attend_cached(q, ck, cv, lengths, nk, nv, visible, **kw)
    if window is not None:
        before_BxS = jnp.arange(S)[None, :] < (lengths - window + 1)[:, None] - 8
        ck, cv = (jnp.where(before_BxS[..., None, None], jnp.nan, c) for c in (ck, cv))
    got = ragged_attend_cached(q, ck, cv, lengths, nk, nv, visible, **kw, tile=8, interpret=True)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_kernel_reads_nothing_past_a_row_length():
    """Garbage (NaN) past each row's length never reaches the output: those tiles are not
    computed, and the live tile's tail is masked."""
    q, ck, cv, nk, nv = _inputs(1)
    lengths = jnp.array([3, 17, 8, 40], jnp.int32)
    past_BxS = jnp.arange(S)[None, :] >= lengths[:, None]
    poisoned = [jnp.where(past_BxS[..., None, None], jnp.nan, c) for c in (ck, cv)]
    want = attend_cached(q, ck, cv, lengths, nk, nv)
    got = ragged_attend_cached(q, *poisoned, lengths, nk, nv, tile=8, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_bfloat16_inputs_score_in_float32():
    q, ck, cv, nk, nv = _inputs(2, jnp.bfloat16)
    lengths = jnp.array([1, 9, 30, 58], jnp.int32)
    want = attend_cached(q, ck, cv, lengths, nk, nv).astype(jnp.float32)
    got = ragged_attend_cached(q, ck, cv, lengths, nk, nv, tile=16, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)


def test_tile_choice():
    assert tile_for(256) == 128 and tile_for(96) == 96 and tile_for(200) == 40
    assert tile_for(7) == 7  # no multiple of 8 divides it: the whole capacity
    q, ck, cv, nk, nv = _inputs(3)
    with pytest.raises(ValueError, match="divide the capacity"):
        ragged_attend_cached(q, ck, cv, jnp.ones((B,), jnp.int32), nk, nv, tile=24, interpret=True)


def test_kernel_compiles_for_tpu():
    """Mosaic lowers and compiles the kernel for a v5e chip (deviceless, libtpu of the test
    extras): the same kernel the interpret-mode tests check, at serving shapes."""
    from adaflash_jax.aot.topology import parse_slice, slice_devices

    sharding = jax.sharding.SingleDeviceSharding(slice_devices(parse_slice("v5e-1"))[0])
    b, w, h, kv, dh, s = 8, 16, 16, 8, 128, 1024

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    args = (arg((b, w, h, dh)), arg((b, s, kv, dh)), arg((b, s, kv, dh)), arg((b,), jnp.int32),
            arg((b, w, kv, dh)), arg((b, w, kv, dh)), arg((b, w, w), bool))  # fmt: skip
    compiled = jax.jit(ragged_attend_cached, static_argnames=("tile",)).lower(*args, tile=128)
    assert "tpu_custom_call" in compiled.as_text()
    compiled.compile()
    gpt_oss = dict(sinks_H=arg((h,), jnp.float32), positions_BxT=arg((b, w), jnp.int32))
    jax.jit(ragged_attend_cached, static_argnames=("tile", "window")).lower(
        *args, **gpt_oss, window=128, tile=128
    ).compile()  # sinks and a sliding window
