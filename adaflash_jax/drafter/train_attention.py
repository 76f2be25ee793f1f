"""Block-sparse training attention of the DFlash drafter (docs/design.md §3), computed in parts.

Dimensions: B batch, S context keys (the training sequence), N blocks, K block size,
T = N·K block queries, H query heads, Kv kv heads, G = H/Kv, Dh head dim, C context chunk,
J = ⌈S/C⌉ chunks.

Block n's queries see the context keys at positions < `context_len_BxN[n]` (its anchor; 0
for a padding block, which then sees only itself) and the K keys of their own block, both
ways. In a sliding-window layer (window W) the query at position p = anchor + k also needs
key position > p − W (`masks.context_visible`): each query has a [start, limit) range.
The dense path (`masks.train_mask` + `layers.attend`) scores all T·(S + T) pairs;
here the two visible parts are computed apart and merged by their log-sum-exp:
- block → context (`prefix_attention`): C keys at a time with an online softmax, so no
  [T, S] score matrix exists. Its `jax.custom_vjp` saves only (output, log-sum-exp) and the
  backward recomputes each chunk's scores (flash-attention style, pure JAX);
- block → own block (`block_attention`): scores [B, Kv, G, N, K, K].
Scores and softmax are float32, masked scores are `NEG_INF` (finite), as in `attend`.
Anchors need not be sorted: nothing here relies on their order.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.model.layers import NEG_INF

# Custom kernels (Pallas) on this path, whose cost XLA's cost analysis leaves out: none. The
# path is plain XLA ops; splash attention is not used because its masks are static NumPy
# arrays, while the per-block context limits here are data (they move with the anchors).
UNCOSTED_KERNELS: tuple[str, ...] = ()
DEFAULT_CHUNK = 512


def flops_left_out(
    batch: int, queries: int, context: int, heads: int, head_dim: int, chunk: int, *, backward=True
) -> int:
    """Matmul FLOPs of one `prefix_attention` call that XLA's cost analysis does not count.

    The chunks run as a rolled loop (`lax.scan`: unrolled, XLA shares the forward's scores
    with the backward's recomputation and memory grows), and the cost analysis counts a loop
    body once, i.e. one chunk of J. Each chunk costs 4·B·T·C·H·Dh forward (scores, P·V) and
    10·B·T·C·H·Dh backward (scores again, dP, dV, dK, dQ); this returns the other J − 1.
    """
    chunk = min(chunk, context)
    per_chunk = (4 + 10 * backward) * batch * queries * chunk * heads * head_dim
    return (-(-context // chunk) - 1) * per_chunk


def _grouped(x_BxTxHxDh, kv_heads: int):
    b, t, h, dh = x_BxTxHxDh.shape
    return x_BxTxHxDh.reshape(b, t, kv_heads, h // kv_heads, dh)


def _chunked(x_BxSxKvxDh, chunk: int):
    """[B, S, Kv, Dh] → [J, B, C, Kv, Dh], zero-padded to J·C keys (the padding is masked)."""
    b, s = x_BxSxKvxDh.shape[:2]
    j = -(-s // chunk)
    x = jnp.pad(x_BxSxKvxDh, ((0, 0), (0, j * chunk - s), (0, 0), (0, 0)))
    return jnp.moveaxis(x.reshape(b, j, chunk, *x.shape[2:]), 1, 0)


def _chunk_scores(q_BxTxKvxGxDh, k_BxCxKvxDh, first_BxT, limit_BxT, start):
    """Masked float32 scores [B, Kv, G, T, C] of one chunk starting at key `start`; query t
    sees keys in [first_BxT[t], limit_BxT[t])."""
    scale = q_BxTxKvxGxDh.shape[-1] ** -0.5
    s = jnp.einsum(
        "btkgd,bckd->bkgtc", q_BxTxKvxGxDh, k_BxCxKvxDh, preferred_element_type=jnp.float32
    )
    pos_C = start + jnp.arange(k_BxCxKvxDh.shape[1], dtype=jnp.int32)
    pos_1x1xC = pos_C[None, None, :]
    visible_BxTxC = (pos_1x1xC < limit_BxT[:, :, None]) & (pos_1x1xC >= first_BxT[:, :, None])
    visible = visible_BxTxC[:, None, None]
    return jnp.where(visible, s * scale, NEG_INF), visible


def _online_step(q_BxTxKvxGxDh, first_BxT, limit_BxT, carry, chunk_xs):
    """One chunk of the online softmax: (max, sum, unnormalised output) updated."""
    m_BxKvxGxT, l_BxKvxGxT, acc_BxKvxGxTxDh = carry
    k_c, v_c, start = chunk_xs
    s, visible = _chunk_scores(q_BxTxKvxGxDh, k_c, first_BxT, limit_BxT, start)
    m_new = jnp.maximum(m_BxKvxGxT, s.max(axis=-1))
    correction = jnp.exp(m_BxKvxGxT - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
    l_new = l_BxKvxGxT * correction + p.sum(axis=-1)
    pv = jnp.einsum(
        "bkgtc,bckd->bkgtd", p.astype(v_c.dtype), v_c, preferred_element_type=jnp.float32
    )
    return (m_new, l_new, acc_BxKvxGxTxDh * correction[..., None] + pv), None


def _prefix_forward(
    q_BxTxHxDh, k_BxSxKvxDh, v_BxSxKvxDh, first_BxT, limit_BxT, chunk: int, remat: bool
):
    b, t, h, dh = q_BxTxHxDh.shape
    kv = k_BxSxKvxDh.shape[2]
    q = _grouped(q_BxTxHxDh, kv)
    k_J, v_J = _chunked(k_BxSxKvxDh, chunk), _chunked(v_BxSxKvxDh, chunk)
    starts_J = jnp.arange(k_J.shape[0], dtype=jnp.int32) * chunk
    step = partial(_online_step, q, first_BxT, limit_BxT)
    if remat:
        step = jax.checkpoint(step)
    init = (
        jnp.full((b, kv, h // kv, t), NEG_INF, jnp.float32),
        jnp.zeros((b, kv, h // kv, t), jnp.float32),
        jnp.zeros((b, kv, h // kv, t, dh), jnp.float32),
    )
    (m, l, acc), _ = jax.lax.scan(step, init, (k_J, v_J, starts_J))
    seen = l > 0  # rows with no visible key: output 0, lse NEG_INF (weight 0 when merged)
    lse_BxKvxGxT = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    out_BxTxHxDh = jnp.moveaxis(out, 3, 1).reshape(b, t, h, dh).astype(v_BxSxKvxDh.dtype)
    return out_BxTxHxDh, lse_BxKvxGxT


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _prefix_recompute(q, k, v, first_BxT, limit_BxT, chunk):
    return _prefix_forward(q, k, v, first_BxT, limit_BxT, chunk, remat=False)


def _prefix_fwd(q, k, v, first_BxT, limit_BxT, chunk):
    out, lse = _prefix_forward(q, k, v, first_BxT, limit_BxT, chunk, remat=False)
    return (out, lse), (q, k, v, first_BxT, limit_BxT, out, lse)


def _prefix_bwd(chunk, residuals, cotangents):
    """Flash-attention backward, one chunk at a time: dS = P ⊙ (dP − Δ), Δ = rowsum(dO ⊙ O)
    − d(lse), with P recomputed from the saved log-sum-exp."""
    q_BxTxHxDh, k_BxSxKvxDh, v_BxSxKvxDh, first_BxT, limit_BxT, out, lse_BxKvxGxT = residuals
    dout_BxTxHxDh, dlse_BxKvxGxT = cotangents
    s, kv = k_BxSxKvxDh.shape[1], k_BxSxKvxDh.shape[2]
    scale = q_BxTxHxDh.shape[-1] ** -0.5
    q = _grouped(q_BxTxHxDh, kv)
    do = _grouped(dout_BxTxHxDh, kv)
    delta_BxKvxGxT = (
        jnp.einsum(
            "btkgd,btkgd->bkgt", do.astype(jnp.float32), _grouped(out, kv).astype(jnp.float32)
        )
        - dlse_BxKvxGxT
    )
    k_J, v_J = _chunked(k_BxSxKvxDh, chunk), _chunked(v_BxSxKvxDh, chunk)
    starts_J = jnp.arange(k_J.shape[0], dtype=jnp.int32) * chunk

    def step(dq_BxTxKvxGxDh, chunk_xs):
        k_c, v_c, start = chunk_xs
        scores, visible = _chunk_scores(q, k_c, first_BxT, limit_BxT, start)
        p = jnp.where(visible, jnp.exp(scores - lse_BxKvxGxT[..., None]), 0.0)
        dp = jnp.einsum("btkgd,bckd->bkgtc", do, v_c, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_BxKvxGxT[..., None])).astype(q.dtype)
        dv_c = jnp.einsum(
            "bkgtc,btkgd->bckd", p.astype(do.dtype), do, preferred_element_type=jnp.float32
        )
        dk_c = jnp.einsum("bkgtc,btkgd->bckd", ds, q, preferred_element_type=jnp.float32) * scale
        dq = jnp.einsum("bkgtc,bckd->btkgd", ds, k_c, preferred_element_type=jnp.float32) * scale
        return dq_BxTxKvxGxDh + dq, (dk_c.astype(k_c.dtype), dv_c.astype(v_c.dtype))

    dq, (dk_J, dv_J) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32), (k_J, v_J, starts_J))

    def unchunk(x_JxBxCxKvxDh):
        j, b, c = x_JxBxCxKvxDh.shape[:3]
        return jnp.moveaxis(x_JxBxCxKvxDh, 0, 1).reshape(b, j * c, *x_JxBxCxKvxDh.shape[3:])[:, :s]

    dq_BxTxHxDh = dq.reshape(q_BxTxHxDh.shape).astype(q_BxTxHxDh.dtype)
    return dq_BxTxHxDh, unchunk(dk_J), unchunk(dv_J), None, None


_prefix_recompute.defvjp(_prefix_fwd, _prefix_bwd)


def prefix_attention(
    q_BxTxHxDh,
    k_BxSxKvxDh,
    v_BxSxKvxDh,
    limit_BxT,
    *,
    first_BxT=None,
    chunk: int = DEFAULT_CHUNK,
    remat=False,
):
    """Query t attends to keys [first_BxT[t], limit_BxT[t]) (first: 0 when None) → (output
    [B, T, H, Dh] in v's dtype, float32 log-sum-exp [B, Kv, G, T]; NEG_INF and a zero output
    where nothing is visible).

    The backward recomputes each chunk from the saved (output, lse) (`jax.custom_vjp`);
    `remat=True` instead differentiates the chunk scan itself with each step under
    `jax.checkpoint` (kept to measure against: it saves every step's running state).
    """
    if chunk < 1:
        raise ValueError(f"attention chunk must be positive, got {chunk}")
    chunk = min(chunk, k_BxSxKvxDh.shape[1])
    if first_BxT is None:
        first_BxT = jnp.zeros_like(limit_BxT)
    args = (q_BxTxHxDh, k_BxSxKvxDh, v_BxSxKvxDh, first_BxT, limit_BxT, chunk)
    if remat:
        return _prefix_forward(*args, remat=True)
    return _prefix_recompute(*args)


def block_attention(q_BxNxKxHxDh, k_BxNxKxKvxDh, v_BxNxKxKvxDh):
    """Each block's queries over its own K keys, both ways → (output [B, N, K, H, Dh] in v's
    dtype, float32 log-sum-exp [B, Kv, G, N, K])."""
    b, n, k, h, dh = q_BxNxKxHxDh.shape
    kv = k_BxNxKxKvxDh.shape[3]
    q = q_BxNxKxHxDh.reshape(b, n, k, kv, h // kv, dh)
    s = jnp.einsum("bnqkgd,bnckd->bkgnqc", q, k_BxNxKxKvxDh, preferred_element_type=jnp.float32) * (
        dh**-0.5
    )
    lse_BxKvxGxNxK = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse_BxKvxGxNxK[..., None]).astype(v_BxNxKxKvxDh.dtype)
    out = jnp.einsum("bkgnqc,bnckd->bnqkgd", p, v_BxNxKxKvxDh)
    return out.reshape(b, n, k, h, dh), lse_BxKvxGxNxK


def train_attention(
    q_BxTxHxDh,
    ctx_k,
    ctx_v,
    blk_k,
    blk_v,
    context_len_BxN,
    *,
    chunk: int = DEFAULT_CHUNK,
    window: int | None = None,
):
    """Block-sparse drafter attention → [B, T, H, Dh] in `blk_v`'s dtype.

    `ctx_k/ctx_v` [B, S, Kv, Dh] are the context's keys/values, `blk_k/blk_v` [B, T, Kv, Dh]
    the blocks' (T = N·K, block-major). Equals `attend` under `masks.train_mask` (with the
    same `window`).
    """
    b, t, h, dh = q_BxTxHxDh.shape
    n = context_len_BxN.shape[1]
    k = t // n
    kv = blk_k.shape[2]
    limit_BxNxK = jnp.broadcast_to(context_len_BxN.astype(jnp.int32)[..., None], (b, n, k))
    first_BxT = None
    if window is not None:  # query at anchor + k sees keys > anchor + k − W
        first_BxNxK = limit_BxNxK + jnp.arange(k, dtype=jnp.int32) - window + 1
        first_BxT = first_BxNxK.reshape(b, t)
    ctx_out, ctx_lse = prefix_attention(
        q_BxTxHxDh,
        ctx_k.astype(blk_k.dtype),
        ctx_v.astype(blk_v.dtype),
        limit_BxNxK.reshape(b, t),
        first_BxT=first_BxT,
        chunk=chunk,
    )
    blk_out, blk_lse = block_attention(
        q_BxTxHxDh.reshape(b, n, k, h, dh),
        blk_k.reshape(b, n, k, kv, dh),
        blk_v.reshape(b, n, k, kv, dh),
    )
    ctx_lse_BxKvxGxNxK = ctx_lse.reshape(blk_lse.shape)
    lse = jnp.logaddexp(ctx_lse_BxKvxGxNxK, blk_lse)

    def weight(part_lse_BxKvxGxNxK):  # → [B, N, K, H, 1], matching the outputs' layout
        w = jnp.exp(part_lse_BxKvxGxNxK - lse)
        return jnp.moveaxis(w, (3, 4), (1, 2)).reshape(b, n, k, h, 1)

    out = weight(ctx_lse_BxKvxGxNxK) * ctx_out.reshape(b, n, k, h, dh).astype(jnp.float32)
    out += weight(blk_lse) * blk_out.astype(jnp.float32)
    return out.reshape(b, t, h, dh).astype(blk_v.dtype)


@struct.dataclass
class BlockSparse:
    """The training pattern as a drafter layer's attention: [context ; own block], sparse."""

    context_len_BxN: jax.Array  # context keys [0, len) visible to block n (0: padding block)
    chunk: int = struct.field(pytree_node=False, default=DEFAULT_CHUNK)
    window: int | None = struct.field(pytree_node=False, default=None)  # sliding layers

    def __call__(self, q_BxTxHxDh, ctx_k, ctx_v, blk_k, blk_v):
        return train_attention(
            q_BxTxHxDh,
            ctx_k,
            ctx_v,
            blk_k,
            blk_v,
            self.context_len_BxN,
            chunk=self.chunk,
            window=self.window,
        )
