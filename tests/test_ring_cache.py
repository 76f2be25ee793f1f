"""Ring-buffer windows (model/ring_cache.py, docs/design.md §2.2): a sliding-window layer's
cache of window − 1 slots equals a full cache read under the window mask, at contexts of 1×,
3× and 10× the window, through prefills longer than the window, verify passes across the wrap
and commits that keep part of them; the drafter's sliding layers serve from it (== the
training path's full-context window mask, == a full cache, speculative == plain greedy), and
its memory is constant past the window."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.decode.generate import generate
from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.cache import Cache
from adaflash_jax.model.kv_cache import KVEntries, KVLayer
from adaflash_jax.model.layers import attend
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.ring_cache import RingKVLayer, attend_window, window_positions
from adaflash_jax.model.target import TargetLM

W = 5  # the window: 4 ring slots
KV, DH = 2, 4


def _entries(key, b, t):
    k, v = jax.random.normal(key, (2, b, t, KV, DH))
    return KVEntries(k, v)


@jax.jit
def _commit_both(ring, full, entries, lengths_B, path_BxZ, n_B):
    return (
        ring.commit(entries, lengths_B, path_BxZ, n_B),
        full.commit(entries, lengths_B, path_BxZ, n_B),
    )


def _assert_window_equal(ring, full, lengths_B):
    """The ring's window == the full cache's entries at the same positions (where they exist)."""
    k, v, pos_BxW = ring.read(lengths_B)
    np.testing.assert_array_equal(pos_BxW, window_positions(lengths_B, W))
    idx = np.clip(np.asarray(pos_BxW), 0, None)
    live_BxW = np.asarray(pos_BxW) >= 0
    for got, want in ((k, full.k_BxSxKvxDh), (v, full.v_BxSxKvxDh)):
        want = np.take_along_axis(np.asarray(want), idx[:, :, None, None], axis=1)
        np.testing.assert_array_equal(np.asarray(got)[live_BxW], want[live_BxW])


def test_ring_commits_keep_the_full_caches_window():
    """Prefills longer than the ring (ragged, one row empty), chain passes committing part of
    their tokens (stale ones must not overwrite live slots), a tree path: after each commit the
    ring's window holds the full cache's entries at the same positions."""
    b, cap = 3, 64
    ring = RingKVLayer.create(batch=b, window=W, kv_heads=KV, head_dim=DH, dtype=jnp.float32)
    full = KVLayer.create(batch=b, capacity=cap, kv_heads=KV, head_dim=DH, dtype=jnp.float32)
    assert ring.slots == W - 1 and ring.k_BxSwxKvxDh.shape == (b, W - 1, KV, DH)
    lengths = jnp.zeros((b,), jnp.int32)
    key = jax.random.key(0)
    passes = [(13, [13, 5, 0], None)]  # a prefill of up to 13 tokens
    for n in ([1, 4, 2], [0, 3, 4], [4, 4, 1], [2, 0, 3], [3, 1, 4], [1, 2, 2]):
        passes.append((4, n, None))  # verify 4, keep n
    passes.append((4, [3, 2, 1], jnp.array([[0, 2, 3, 1], [0, 1, 3, 2], [0, 3, 1, 2]])))
    for t, n, path in passes:
        key, sub = jax.random.split(key)
        n_B = jnp.asarray(n, jnp.int32)
        ring, full = _commit_both(ring, full, _entries(sub, b, t), lengths, path, n_B)
        lengths = lengths + n_B
        _assert_window_equal(ring, full, lengths)
    assert int(lengths.min()) > 2 * W  # wrapped several times
    cache = Cache.create([ring], batch=b, capacity=cap, dtype=jnp.float32).with_lengths(lengths)
    with pytest.raises(ValueError, match="RingKVLayer cannot roll back"):
        cache.rollback(lengths - 1)


def _windowed_reference(q, k_all, v_all, lengths_B, positions_BxT, visible_BxTxT):
    """Full-context attention under the window: every committed position and the new tokens,
    one mask (key p seen from query q iff p < length or it is a visible new token, and
    p > q − W)."""
    b, t = positions_BxT.shape
    s = k_all.shape[1]
    key_pos_1x1xS = jnp.arange(s)[None, None, :]
    q_pos_BxTx1 = positions_BxT[:, :, None]
    committed = key_pos_1x1xS < lengths_B[:, None, None]
    new_BxTxS = jnp.zeros((b, t, s), bool)
    for u in range(t):  # new token u sits at lengths + u in k_all
        at = key_pos_1x1xS == lengths_B[:, None, None] + u
        new_BxTxS |= at & visible_BxTxT[:, :, u : u + 1]
    mask = (committed | new_BxTxS) & (key_pos_1x1xS > q_pos_BxTx1 - W)
    return attend(q, k_all, v_all, mask)


def test_attend_window_equals_full_context_window_attention_across_the_wrap():
    """What a sliding-window target layer calls: a verify pass read from the ring (chain and
    tree) == full-context attention under the window, at 1×, 3× and 10× the window; a pass
    that kept part of its tokens, then the next pass, stay equal (rollback across the wrap is
    committing only what is kept)."""
    b, t, h, cap = 3, 4, 4, 64
    ring = RingKVLayer.create(batch=b, window=W, kv_heads=KV, head_dim=DH, dtype=jnp.float32)
    full = KVLayer.create(batch=b, capacity=cap, kv_heads=KV, head_dim=DH, dtype=jnp.float32)
    prompt = jnp.array([W, 3 * W, 10 * W], jnp.int32)
    pre = _entries(jax.random.key(1), b, 10 * W)
    ring, full = _commit_both(ring, full, pre, jnp.zeros((b,), jnp.int32), None, prompt)
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    # a tree: token 0, its two children 1 and 2, a grandchild 3 under 1 (ancestor-or-self)
    tree = jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    tree = jnp.broadcast_to(tree, (b, t, t))
    depth = jnp.array([0, 1, 1, 2], jnp.int32)

    @jax.jit
    def both(ring, full, lengths_B, q, new, visible, depth_T):
        positions_BxT = lengths_B[:, None] + depth_T[None, :]
        got = attend_window(
            q, ring, lengths_B, positions_BxT, new.k_BxTxKvxDh, new.v_BxTxKvxDh, visible
        )
        written = full.commit(new, lengths_B, None, jnp.full((b,), t, jnp.int32))
        want = _windowed_reference(
            q, written.k_BxSxKvxDh, written.v_BxSxKvxDh, lengths_B, positions_BxT, visible
        )
        return got, want

    lengths = prompt
    key = jax.random.key(2)
    for step, (visible, depth_T, keep) in enumerate(
        [
            (chain, jnp.arange(t), [2, 0, 3]),
            (tree, depth, [1, 3, 2]),
            (chain, jnp.arange(t), [4, 1, 0]),
        ]
    ):
        key, kq, kn = jax.random.split(key, 3)
        q = jax.random.normal(kq, (b, t, h, DH))
        new = _entries(kn, b, t)
        got, want = both(ring, full, lengths, q, new, visible, depth_T)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"pass {step}")
        path = None if visible is chain else jnp.broadcast_to(jnp.array([0, 1, 3, 2]), (b, t))
        n_B = jnp.asarray(keep, jnp.int32)
        ring, full = _commit_both(ring, full, new, lengths, path, n_B)
        lengths = lengths + n_B


# ---- the drafter's sliding layers ---------------------------------------------------------------
TARGET = target_preset("test", vocab_size=96, num_hidden_layers=4)
K = 4


@pytest.fixture(scope="module")
def drafter():
    """Sliding (window 5), full, sliding: a ring for layers 0 and 2."""
    cfg = DrafterConfig.for_target(
        TARGET,
        mask_token_id=95,
        num_layers=3,
        block_size=K,
        num_features=2,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        sliding_window=W,
    )
    return Drafter(cfg, rngs=nnx.Rngs(3))


@nnx.jit
def _serve_step(drafter, cache, feats_BxSxnD, n_B, bonus_B, emb, head):
    """Commits each row's next `n_B[b]` tokens' features (from a pass of K: the rest are stale
    entries), then drafts after them."""
    at_BxK = jnp.minimum(cache.lengths[:, None] + jnp.arange(K), feats_BxSxnD.shape[1] - 1)
    chunk = jnp.take_along_axis(feats_BxSxnD, at_BxK[:, :, None], axis=1)
    cache = cache.commit(drafter.context_entries(cache, chunk), n_B)
    return cache, drafter.draft(cache, bonus_B, emb, head).hidden_BxKxD


def test_sliding_drafter_serves_the_training_window_at_1x_3x_10x(drafter):
    """Prefills of 1× and 3× the window, then ragged partial commits out past 10× the window:
    every draft from the ring == the training path's full-context window mask (dense), and
    == the same drafter on a full cache (bitwise: the same W − 1 entries are read)."""
    b, s = 2, 20 * W
    feats = jax.random.normal(jax.random.key(4), (b, s, 2 * TARGET.hidden_size))
    tokens = jax.random.randint(jax.random.key(5), (b, s), 0, 90)
    emb = jax.random.normal(jax.random.key(6), (TARGET.vocab_size, TARGET.hidden_size))
    caches = [drafter.init_context_cache(b, s, ring_windows=r) for r in (True, False)]
    kinds = [type(c).__name__ for c in caches[0].layers]
    assert kinds == ["RingKVLayer", "KVLayer", "RingKVLayer"]
    anchors, served = [], []
    ns = [[W, 3 * W]] + [[1 + (i % 4), 4 - (i % 3)] for i in range(24)]  # 1..4 of a pass of K
    ns_B = [jnp.asarray(n, jnp.int32) for n in ns]
    for n_B in ns_B:
        if n_B.max() > K:  # the prefill: one commit of up to 3 windows
            caches = [c.commit(drafter.context_entries(c, feats[:, : 3 * W]), n_B) for c in caches]
        else:
            outs = []
            for c in caches:
                bonus = jnp.take_along_axis(tokens, (c.lengths + n_B)[:, None], axis=1)[:, 0]
                outs.append(_serve_step(drafter, c, feats, n_B, bonus, emb, emb.T))
            caches = [c for c, _ in outs]
            np.testing.assert_array_equal(outs[0][1], outs[1][1])
            anchors.append(caches[0].lengths)
            served.append(outs[0][1])
    anchors_BxN = jnp.stack(anchors, axis=1)
    assert int(anchors_BxN.max()) >= 10 * W and int(anchors_BxN.max()) < s
    hidden = nnx.jit(
        lambda d, f, t, a: d.train_hidden(f, t, a, jnp.ones(a.shape, bool), emb, attention="dense")
    )(drafter, feats, tokens, anchors_BxN)
    for j, out in enumerate(served):
        np.testing.assert_allclose(out, hidden[:, j], atol=2e-5, err_msg=f"step {j}")


def test_ring_memory_is_constant_past_the_window(drafter):
    """An all-sliding drafter's context cache shapes and its compiled draft's memory at 3× and
    10× the window: the same with rings, growing with the context on a full cache."""
    sliding = dataclasses.replace(drafter.config, layer_types=("sliding_attention",) * 3)
    drafter = Drafter(sliding, rngs=nnx.Rngs(3))

    def compiled_bytes(capacity, ring_windows):
        cache = drafter.init_context_cache(2, capacity, ring_windows=ring_windows)
        graphdef, state = nnx.split(drafter)
        emb = jnp.zeros((TARGET.vocab_size, TARGET.hidden_size))

        def draft(state, cache, bonus_B):
            return nnx.merge(graphdef, state).draft(cache, bonus_B, emb, emb.T).logits_BxKm1xV

        bonus = jnp.zeros((2,), jnp.int32)
        mem = jax.jit(draft).lower(state, cache, bonus).compile().memory_analysis()
        shapes = [x.shape for x in jax.tree.leaves(cache.layers)]
        return shapes, mem.argument_size_in_bytes, mem.temp_size_in_bytes

    short, long = compiled_bytes(3 * W, True), compiled_bytes(10 * W, True)
    assert short == long
    assert set(short[0]) == {(2, W - 1, TARGET.num_key_value_heads, TARGET.head_dim)}
    full_short, full_long = compiled_bytes(3 * W, False), compiled_bytes(10 * W, False)
    assert full_long[1] > full_short[1] > short[1]


DRAFTS = {}  # tag → the (lengths, greedy drafts) of every draft a run made


def _record(tag, lengths_B, drafts_BxKm1):
    DRAFTS.setdefault(tag, []).append((lengths_B.tolist(), drafts_BxKm1.tolist()))


class _Recording(Drafter):
    """The drafter, on rings or a full context cache, recording every draft it makes."""

    def __init__(self, config, *, rngs, ring_windows: bool):
        super().__init__(config, rngs=rngs)
        self.ring_windows = ring_windows

    def init_context_cache(self, batch, capacity, dtype=None):
        return super().init_context_cache(batch, capacity, dtype, ring_windows=self.ring_windows)

    def draft(self, cache, bonus_B, embedding_VxD, lm_head_DxV):
        out = super().draft(cache, bonus_B, embedding_VxD, lm_head_DxV)
        drafts_BxKm1 = jnp.argmax(out.logits_BxKm1xV, axis=-1)
        tag = "ring" if self.ring_windows else "full"
        jax.debug.callback(functools.partial(_record, tag), cache.lengths, drafts_BxKm1)
        return out


def test_speculative_with_a_sliding_drafter_equals_plain_greedy(drafter):
    """Prompts of 1×, 3× and 4× the window, outputs to past 10×: the engine with ring windows
    decodes plain greedy's tokens and drafts what the full-cache drafter drafts, step for
    step."""
    target = TargetLM(TARGET, rngs=nnx.Rngs(0))
    prompts = [list(range(1, 1 + W)), list(range(10, 10 + 3 * W)), [7, 8] * (2 * W)]
    max_new = [10 * W, 7, 6 * W]
    reference = generate(target, prompts, max_new_tokens=max_new, eos_ids=())
    DRAFTS.clear()
    for ring_windows in (True, False):
        d = _Recording(drafter.config, rngs=nnx.Rngs(3), ring_windows=ring_windows)
        engine = SpeculativeEngine(target, d, slots=2, capacity=96, buckets=(1, 2, 4))
        results = engine.generate(list(zip(prompts, max_new, strict=True)))
        assert [r.output_ids for r in results] == reference
    jax.effects_barrier()
    assert len(DRAFTS["ring"]) >= sum(max_new) // 2
    assert sorted(DRAFTS["ring"]) == sorted(DRAFTS["full"])
