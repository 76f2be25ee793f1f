"""The gated delta rule, the recurrence inside a Gated DeltaNet layer (docs/design.md §2.1).

Dimensions: B batch, T tokens, J value heads (keys and queries already repeated to J), Dk key
head dim, Dv value head dim, Nc chunks, Tc chunk length.

Per head, with a state S [Dk, Dv], L2-normalised q and k, q scaled by Dk^-1/2, a decay g ≤ 0
and a write strength β in (0, 1), token t does
    S ← exp(g_t) · S;   S ← S + k_t ⊗ β_t (v_t − S^T k_t);   o_t = S^T q_t.
Two forms compute it, in float32:
- `recurrent_form`: one token at a time (a scan): decoding and the engine's replay;
- `chunked_form`: Tc tokens at a time. Inside a chunk the rule is the triangular system
  (I + A) U = β·(v − decayed state reads), A[i, j] = β_i (k_i·k_j) exp(G_i − G_j) for j < i
  (G the in-chunk cumulative decay), solved once per chunk; chunks then pass the state on.
  Training and prefill use it: the per-token scan is T sequential steps, this is T/Tc.
  A is strictly lower triangular, so nilpotent: (I + A)^-1 = (I − A)(I + A²)(I + A⁴)…, log2 Tc
  squarings and products of Tc × Tc matrices (`unit_lower_inverse`). Matmuls only: the MXU
  runs them, XLA's cost model counts them, and no LAPACK custom call runs (XLA:CPU's batched
  triangular solve waited on a thread pool its own callers held, hanging 8-device runs).
  With one chunk (T ≤ Tc: decoding's verify and replay) there is no loop over chunks.
A token with g = 0 and β = 0 leaves the state as it was: masking does that for padding and for
drafted tokens a row did not accept.

A draft tree (`chunked_form` with `visible_BxTxT`, one chunk) runs the same system with the
ancestor mask in place of the causal one and G each token's decay summed along its own path:
a token's row of (I + A)^-1 only reaches its ancestors (the mask is closed under taking
ancestors), whose entries are those of the chain along its path, so every token's output is
the chain's along its root-to-token path. The state it ends in means nothing for a tree: the
commit replays the accepted path (`recurrent_state.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_CHUNK = 64


def l2_normalize(x, eps: float = 1e-6):
    """x / sqrt(Σx² + eps) over the last axis, in float32 (HF's `l2norm`)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def recurrent_form(q_BxTxJxDk, k_BxTxJxDk, v_BxTxJxDv, g_BxTxJ, beta_BxTxJ, state_BxJxDkxDv):
    """Token by token. q and k are normalised already; returns (outputs [B, T, J, Dv] f32,
    final state [B, J, Dk, Dv] f32)."""
    scale = q_BxTxJxDk.shape[-1] ** -0.5
    f32 = jnp.float32

    def token(state, xs):
        q_BxJxDk, k_BxJxDk, v_BxJxDv, g_BxJ, beta_BxJ = xs
        state = state * jnp.exp(g_BxJ)[..., None, None]
        read_BxJxDv = jnp.einsum("bjkv,bjk->bjv", state, k_BxJxDk)
        delta_BxJxDv = (v_BxJxDv - read_BxJxDv) * beta_BxJ[..., None]
        state = state + k_BxJxDk[..., :, None] * delta_BxJxDv[..., None, :]
        return state, jnp.einsum("bjkv,bjk->bjv", state, q_BxJxDk * scale)

    xs = tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (q_BxTxJxDk, k_BxTxJxDk, v_BxTxJxDv))
    xs += tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (g_BxTxJ, beta_BxTxJ))
    state, out_TxBxJxDv = jax.lax.scan(token, state_BxJxDkxDv.astype(f32), xs)
    return jnp.moveaxis(out_TxBxJxDv, 0, 1), state


def chunked_form(
    q_BxTxJxDk,
    k_BxTxJxDk,
    v_BxTxJxDv,
    g_BxTxJ,
    beta_BxTxJ,
    state_BxJxDkxDv,
    chunk=DEFAULT_CHUNK,
    visible_BxTxT=None,
):
    """Tc = min(chunk, T) tokens at a time (T padded to a multiple with state-neutral tokens);
    the same outputs and final state as `recurrent_form`. `visible_BxTxT` (a tree's
    ancestor-or-self mask, the tokens in topological order): one chunk, each token's output
    the chain's along its path; the final state is not meaningful."""
    b, t, j, dk = q_BxTxJxDk.shape
    dv = v_BxTxJxDv.shape[-1]
    tc = min(chunk, t) if visible_BxTxT is None else t
    nc = -(-t // tc)
    f32 = jnp.float32

    def chunks(x):  # [B, T, J, ...] → [Nc, B, J, Tc, ...], zero-padded
        x = x.astype(f32)
        x = jnp.pad(x, [(0, 0), (0, nc * tc - t)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, nc, tc, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    q, k, v = chunks(q_BxTxJxDk * dk**-0.5), chunks(k_BxTxJxDk), chunks(v_BxTxJxDv)
    g_NcxBxJxTc, beta_NcxBxJxTc = chunks(g_BxTxJ), chunks(beta_BxTxJ)
    if visible_BxTxT is None:
        cum_NcxBxJxTc = jnp.cumsum(g_NcxBxJxTc, axis=-1)
        lower_TcxTc = jnp.tril(jnp.ones((tc, tc), bool))
        strict_TcxTc = jnp.tril(jnp.ones((tc, tc), bool), -1)
    else:  # the decay summed along each token's path; ancestors in place of earlier tokens
        cum_NcxBxJxTc = jnp.einsum("brs,nbjs->nbjr", visible_BxTxT.astype(f32), g_NcxBxJxTc)
        lower_TcxTc = visible_BxTxT[None, :, None]
        strict_TcxTc = lower_TcxTc & ~jnp.eye(tc, dtype=bool)
    # decay from token s to token r inside a chunk (s before r), 0 elsewhere
    gap = cum_NcxBxJxTc[..., :, None] - cum_NcxBxJxTc[..., None, :]
    decay_NcxBxJxTcxTc = jnp.where(lower_TcxTc, jnp.exp(jnp.where(lower_TcxTc, gap, 0.0)), 0.0)
    kk = jnp.einsum("nbjrd,nbjsd->nbjrs", k, k)
    a_NcxBxJxTcxTc = jnp.where(strict_TcxTc, beta_NcxBxJxTc[..., None] * kk * decay_NcxBxJxTcxTc, 0)
    # U = (I + A)^-1 β v and W = (I + A)^-1 β exp(G) k: the chunk's writes before the state
    rhs = jnp.concatenate(
        [beta_NcxBxJxTc[..., None] * v, (beta_NcxBxJxTc * jnp.exp(cum_NcxBxJxTc))[..., None] * k],
        axis=-1,
    )
    solved = unit_lower_inverse(a_NcxBxJxTcxTc) @ rhs
    u_NcxBxJxTcxDv, w_NcxBxJxTcxDk = solved[..., :dv], solved[..., dv:]
    qk_NcxBxJxTcxTc = jnp.einsum("nbjrd,nbjsd->nbjrs", q, k) * decay_NcxBxJxTcxTc

    def one_chunk(state_BxJxDkxDv, xs):
        q, k, u, w, qk, cum = xs
        new_BxJxTcxDv = u - jnp.einsum("bjsd,bjdv->bjsv", w, state_BxJxDkxDv)
        out = jnp.einsum("bjrd,bjdv->bjrv", q * jnp.exp(cum)[..., None], state_BxJxDkxDv)
        out = out + jnp.einsum("bjrs,bjsv->bjrv", qk, new_BxJxTcxDv)
        last_BxJ = cum[..., -1]
        to_end_BxJxTc = jnp.exp(last_BxJ[..., None] - cum)
        state = state_BxJxDkxDv * jnp.exp(last_BxJ)[..., None, None]
        state = state + jnp.einsum("bjsd,bjsv->bjdv", k * to_end_BxJxTc[..., None], new_BxJxTcxDv)
        return state, out

    xs = (q, k, u_NcxBxJxTcxDv, w_NcxBxJxTcxDk, qk_NcxBxJxTcxTc, cum_NcxBxJxTc)
    if nc == 1:
        state, out = one_chunk(state_BxJxDkxDv.astype(f32), jax.tree.map(lambda x: x[0], xs))
        out_NcxBxJxTcxDv = out[None]
    else:
        state, out_NcxBxJxTcxDv = jax.lax.scan(one_chunk, state_BxJxDkxDv.astype(f32), xs)
    out_BxTxJxDv = jnp.moveaxis(out_NcxBxJxTcxDv, 3, 2).transpose(1, 0, 2, 3, 4)
    return out_BxTxJxDv.reshape(b, nc * tc, j, dv)[:, :t], state


def unit_lower_inverse(a_xTcxTc):
    """(I + A)^-1 for strictly lower triangular A [..., Tc, Tc]: since A^Tc = 0,
    (I + A)(I − A)(I + A²)(I + A⁴)…(I + A^m) = I − A^2m = I once 2m ≥ Tc."""
    tc = a_xTcxTc.shape[-1]
    eye = jnp.eye(tc, dtype=a_xTcxTc.dtype)
    inverse, power, m = eye - a_xTcxTc, a_xTcxTc, 2
    while m < tc:
        power = power @ power  # A^m
        inverse = inverse @ (eye + power)
        m *= 2
    return inverse
