"""Block-sparse training attention == the dense masked path: outputs and gradients, fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.drafter import masks
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.drafter.train_attention import (
    NEG_INF,
    flops_left_out,
    prefix_attention,
    train_attention,
)
from adaflash_jax.model.presets import target_preset

TOL = dict(atol=1e-5, rtol=1e-5)

# (K, S, chunk, H, Kv, anchors [B, N], valid [B, N]); anchors at 0 and S−K, unsorted rows,
# invalid blocks (row 1 of the first case is all padding), chunks that do and do not divide S
# and do not line up with the anchors, one chunk larger than S, one key per chunk.
CASES = {
    "K4_chunk5_of_13": (
        4,
        13,
        5,
        4,
        2,
        [[0, 9, 3, 6], [0, 0, 0, 0]],
        [[1, 1, 1, 0], [0, 0, 0, 0]],
    ),
    "K8_chunk8_of_24": (8, 24, 8, 4, 4, [[16, 0, 5], [7, 11, 16]], [[1, 1, 1], [1, 0, 1]]),
    "K16_chunk64_of_40": (16, 40, 64, 4, 1, [[24, 0], [13, 2]], [[1, 1], [0, 1]]),
    "K4_chunk1_of_9": (4, 9, 1, 6, 2, [[5, 1, 2]], [[1, 1, 1]]),
    # a sliding-window layer (window 6 >= K): each query's context starts past p − 6
    "K4_chunk5_of_13_window6": (4, 13, 5, 4, 2, [[12, 1, 7], [9, 4, 0]], [[1, 1, 1], [1, 0, 1]], 6),
}


def _inputs(key, b, s, t, h, kv, dh=8):
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (b, t, h, dh))
    ctx_k, ctx_v = (jax.random.normal(k_, (b, s, kv, dh)) for k_ in ks[1:3])
    blk_k, blk_v = (jax.random.normal(k_, (b, t, kv, dh)) for k_ in ks[3:5])
    return (q, ctx_k, ctx_v, blk_k, blk_v), jax.random.normal(ks[5], (b, t, h, dh))


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_train_attention_equals_dense_mask(case):
    k, s, chunk, h, kv, anchors, valid, *window = case
    window = window[0] if window else None
    anchors, valid = jnp.array(anchors, jnp.int32), jnp.array(valid, bool)
    b, n = anchors.shape
    args, cot = _inputs(jax.random.key(n * k + s), b, s, n * k, h, kv)
    dense = masks.DenseMask(masks.train_mask(anchors, valid, s, k, window=window))
    context_len = jnp.where(valid, anchors, 0)

    def sparse(*a):
        return train_attention(*a, context_len, chunk=chunk, window=window)

    @jax.jit
    def value_and_grads(*a):
        outs = [dense(*a), sparse(*a)]
        grads = [
            jax.grad(lambda *x, f=f: jnp.sum(f(*x) * cot), argnums=tuple(range(5)))(*a)
            for f in (dense, sparse)
        ]
        return outs, grads

    (want, got), (want_g, got_g) = value_and_grads(*args)
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got, want, **TOL)
    for name, w, g in zip(("q", "ctx_k", "ctx_v", "blk_k", "blk_v"), want_g, got_g):
        np.testing.assert_allclose(g, w, **TOL, err_msg=name)
    # keys a block may not see get no gradient: context at or after every anchor of the row
    last = int(jnp.max(context_len[0]))
    assert not np.any(np.asarray(got_g[1][0, last:]))


def _prefix_reference(q, k, v, limit_BxT):
    """Plain masked softmax over the whole [T, S] score matrix: (out, lse) as documented."""
    b, t, h, dh = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, dh)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k) * dh**-0.5
    visible = (jnp.arange(k.shape[1])[None, None, :] < limit_BxT[:, :, None])[:, None, None]
    seen = jnp.any(visible, axis=-1)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(visible, s, -jnp.inf), axis=-1))
    m = jnp.where(seen, m, 0.0)
    e = jnp.where(visible, jnp.exp(jnp.where(visible, s, 0.0) - m[..., None]), 0.0)
    l = jnp.where(seen, e.sum(-1), 1.0)
    out = jnp.einsum("bkgts,bskd->btkgd", e / l[..., None], v).reshape(b, t, h, dh)
    return out, jnp.where(seen, m + jnp.log(l), NEG_INF)


@pytest.mark.parametrize("remat", [False, True], ids=["recompute", "remat_scan"])
def test_prefix_attention_out_lse_and_grads(remat):
    """Both backwards (custom_vjp recompute, checkpointed scan) against a plain softmax,
    with cotangents on the output AND the log-sum-exp (the merge uses both)."""
    b, s, t, h, kv = 2, 11, 6, 4, 2
    (q, k, v, _, _), cot = _inputs(jax.random.key(7), b, s, t, h, kv)
    limit = jnp.array([[0, 1, 4, 5, 11, 7], [3, 0, 10, 2, 6, 9]], jnp.int32)
    lse_cot = jax.random.normal(jax.random.key(8), (b, kv, h // kv, t))
    seen = (limit > 0)[:, None, None, :]

    def loss(f, *a):
        out, lse = f(*a)
        return jnp.sum(out * cot) + jnp.sum(jnp.where(seen, lse, 0.0) * lse_cot)

    def ours(*a):
        return prefix_attention(*a, limit, chunk=4, remat=remat)

    def ref(*a):
        return _prefix_reference(*a, limit)

    got, want = jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL)
    got_g = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(q, k, v)
    want_g = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got_g, want_g):
        np.testing.assert_allclose(g, w, **TOL)


def test_flops_left_out_completes_the_compilers_count():
    """The compiler counts one chunk of the loop; with what it leaves out, the total is the
    analytic 14·B·T·S·H·Dh of forward + backward (elementwise work adds a little)."""
    b, t, s, h, kv, dh, chunk = 1, 128, 128, 4, 2, 16, 32
    q = jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32)
    k = jax.ShapeDtypeStruct((b, s, kv, dh), jnp.float32)
    limit = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(q, k, v, limit):
        out, lse = prefix_attention(q, k, v, limit, chunk=chunk)
        return jnp.sum(out) + jnp.sum(lse)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    counted = step.lower(q, k, k, limit).compile().cost_analysis()["flops"]
    total = counted + flops_left_out(b, t, s, h, dh, chunk)
    assert 1.0 <= total / (14 * b * t * s * h * dh) < 1.1


TARGET = target_preset("test", vocab_size=64, intermediate_size=48, num_hidden_layers=4)


def test_train_hidden_sparse_equals_dense_with_param_grads():
    block_size = 4
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=63, num_layers=2, block_size=block_size, num_features=2
    )
    graphdef, params = nnx.split(Drafter(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    b, s = 2, 21
    keys = jax.random.split(jax.random.key(block_size), 4)
    feats = jax.random.normal(keys[0], (b, s, 2 * 32))
    tokens = jax.random.randint(keys[1], (b, s), 0, 63)
    emb = jax.random.normal(keys[2], (64, 32))
    last = s - block_size
    anchors = jnp.array([[0, last, 6, 11], [3, 9, last, 2]], jnp.int32)  # 11: padding
    valid = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    cot = jax.random.normal(keys[3], (b, 4, block_size, 32))

    def run(p, attention, chunk):
        drafter = nnx.merge(graphdef, p)
        return drafter.train_hidden(
            feats, tokens, anchors, valid, emb, attention=attention, attention_chunk=chunk
        )

    @jax.jit
    def value_and_grads(p):
        outs, grads = [], []
        for attention in ("dense", "sparse"):
            out, vjp = jax.vjp(lambda p_, a=attention: run(p_, a, 5), p)  # 5 does not divide S
            outs.append(out)
            grads.append(vjp(cot)[0])
        return outs, grads

    (want, got), (want_g, got_g) = value_and_grads(params)
    np.testing.assert_allclose(got, want, **TOL)
    flat_w, flat_g = jax.tree.leaves(want_g), jax.tree.leaves(got_g)
    assert len(flat_w) == len(flat_g) > 10
    for w, g in zip(flat_w, flat_g):
        np.testing.assert_allclose(g, w, **TOL)


def test_train_hidden_rejects_unknown_attention():
    cfg = DrafterConfig.for_target(TARGET, mask_token_id=63, num_layers=1, block_size=2)
    drafter = Drafter(cfg, rngs=nnx.Rngs(0))
    feats = jnp.zeros((1, 6, cfg.num_features * 32))
    args = (feats, jnp.zeros((1, 6), jnp.int32), jnp.zeros((1, 1), jnp.int32))
    args += (jnp.ones((1, 1), bool), jnp.zeros((64, 32)))
    with pytest.raises(ValueError, match="'sparse' or 'dense'"):
        drafter.train_hidden(*args, attention="flash")
    with pytest.raises(ValueError, match="chunk must be positive"):
        drafter.train_hidden(*args, attention_chunk=0)
