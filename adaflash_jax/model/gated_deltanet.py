"""Gated DeltaNet, the linear-attention mixer of Qwen3.5 / Qwen3.6 (docs/design.md §2.1).

Dimensions: B batch, T new tokens per row, D model, X = 2·Jk·Dk + J·Dv conv channels, A conv
taps, Jk key heads, J value heads (J/Jk value heads share a key head), Dk / Dv head dims.

Per token: x → in_proj_qkv → a causal depthwise conv over the last A inputs → SiLU → q, k, v;
z = in_proj_z(x); β = sigmoid(in_proj_b(x)); g = −exp(A_log)·softplus(in_proj_a(x) + dt_bias);
q and k L2-normalised and repeated to the value heads; the gated delta rule
(`model/delta_rule.py`); a gated RMSNorm with z per value head; out_proj. Transformers'
`Qwen3_5GatedDeltaNet` is the reference; its parameter names are kept.

The call has the attention layer's shape (`model/target.py` runs one layer loop over both):
without a cache (training) the chunked form from a zero state; with the layer's
`RecurrentState`, outputs from that state (the recurrent form for one token, the chunked form
for more). "read": the state is left as it was and the pass's `RecurrentEntries` return,
which `RecurrentState.commit` replays for the tokens kept (`model/cache.py`). "write"
(`commit_B` known before the pass): the pass runs over the entries kept at `commit_B`
(`RecurrentEntries.kept`; a token's output never depends on later ones) and commits the
state it ends in, so the rule runs once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.model.delta_rule import (
    DEFAULT_CHUNK,
    chunked_form,
    l2_normalize,
    recurrent_form,
)
from adaflash_jax.model.layers import Dense
from adaflash_jax.model.packing import to_rows, to_tokens
from adaflash_jax.model.recurrent_state import RecurrentEntries, RecurrentState


class GatedRMSNorm(nnx.Module):
    """RMSNorm of x (float32, cast back, scaled by w: weights start at one), times silu(gate)."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
        self.eps, self.dtype = eps, dtype
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

    def __call__(self, x, gate):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        out = self.weight[...].astype(self.dtype) * x32.astype(self.dtype)
        return (out * jax.nn.silu(gate.astype(jnp.float32))).astype(self.dtype)


def causal_conv(history_BxA1xX, new_BxTxX, weight_XxA, packing=None):
    """Depthwise causal conv of the new inputs over [history ; new], then SiLU: output t is
    Σ_a w[:, a] · input[t − (A − 1) + a]; in a tree (`packing.is_tree`) the inputs before a
    token are its ancestors', then the history."""
    t, taps = new_BxTxX.shape[1], weight_XxA.shape[1]
    seq_BxA1TxX = jnp.concatenate([history_BxA1xX.astype(new_BxTxX.dtype), new_BxTxX], axis=1)
    if packing is None or not packing.is_tree:
        out_BxTxX = sum(seq_BxA1TxX[:, a : a + t] * weight_XxA[:, a] for a in range(taps))
        return jax.nn.silu(out_BxTxX)
    out_BxTxX = 0.0
    for a in range(taps):  # the input `taps − 1 − a` generations up: column A − 1 + ancestor
        at_BxT = packing.ancestors(taps - 1 - a) + (taps - 1)
        out_BxTxX = (
            out_BxTxX + jnp.take_along_axis(seq_BxA1TxX, at_BxT[..., None], 1) * (weight_XxA[:, a])
        )
    return jax.nn.silu(out_BxTxX)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg, *, rngs, dtype, param_dtype, chunk: int = DEFAULT_CHUNK):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dtype, self.chunk = dtype, chunk
        self.key_heads, self.heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.taps = cfg.linear_conv_kernel_dim
        d, j = cfg.hidden_size, self.heads
        self.channels = 2 * self.key_heads * self.key_dim + j * self.value_dim
        self.in_proj_qkv = Dense(d, self.channels, logical_axes=("embed", "linear_qkv"), **kw)
        self.in_proj_z = Dense(d, j * self.value_dim, logical_axes=("embed", "linear_v"), **kw)
        self.in_proj_b = Dense(d, j, logical_axes=("embed", "linear_heads"), **kw)
        self.in_proj_a = Dense(d, j, logical_axes=("embed", "linear_heads"), **kw)
        conv = 0.2 * jax.random.normal(rngs.params(), (self.channels, 1, self.taps), jnp.float32)
        self.conv1d = nnx.Param(conv.astype(param_dtype), logical_axes=("linear_qkv", None, None))
        a_log = jnp.log(jax.random.uniform(rngs.params(), (j,), jnp.float32, 1.0, 16.0))
        self.A_log = nnx.Param(a_log.astype(param_dtype), logical_axes=("linear_heads",))
        self.dt_bias = nnx.Param(jnp.ones((j,), param_dtype), logical_axes=("linear_heads",))
        self.norm = GatedRMSNorm(
            self.value_dim, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype
        )
        self.out_proj = Dense(j * self.value_dim, d, logical_axes=("linear_v", "embed"), **kw)

    def init_state(self, batch: int) -> RecurrentState:
        return RecurrentState.create(
            batch=batch,
            taps=self.taps,
            channels=self.channels,
            heads=self.heads,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
            chunk=self.chunk,
        )

    def __call__(
        self,
        x_BxTxD,
        positions_BxT,
        mask,
        cache=None,
        lengths_B=None,
        packing=None,
        commit_B=None,
    ):
        """Same shape as the attention layer's call; `cache` is this layer's RecurrentState.
        Returns (output [B, T, D], the pass's entries ("read"), the committed state ("write":
        `commit_B`), or None without a cache). With a `packing`, x is the packed stream
        [M, 1, D]: the projections run there, the conv and the recurrence per row in the
        row layout [B, W, ...], where the entries return."""
        del positions_BxT, mask  # a recurrence is causal by construction
        qkv_BxTxX = to_rows(packing, self.in_proj_qkv(x_BxTxD))
        b, t, _ = qkv_BxTxX.shape
        state = self.init_state(b) if cache is None else cache
        mixed_BxTxX = causal_conv(state.history_BxA1xX, qkv_BxTxX, self.conv1d[...][:, 0], packing)
        kd = self.key_heads * self.key_dim
        repeat = self.heads // self.key_heads
        q = mixed_BxTxX[..., :kd].reshape(b, t, self.key_heads, self.key_dim)
        k = mixed_BxTxX[..., kd : 2 * kd].reshape(b, t, self.key_heads, self.key_dim)
        v_BxTxJxDv = mixed_BxTxX[..., 2 * kd :].reshape(b, t, self.heads, self.value_dim)
        q_BxTxJxDk = jnp.repeat(l2_normalize(q), repeat, axis=2)
        k_BxTxJxDk = jnp.repeat(l2_normalize(k), repeat, axis=2)
        beta = jax.nn.sigmoid(self.in_proj_b(x_BxTxD).astype(jnp.float32))
        beta_BxTxJ = to_rows(packing, beta)
        a_BxTxJ = to_rows(packing, self.in_proj_a(x_BxTxD).astype(jnp.float32))
        decay_J = jnp.exp(self.A_log[...].astype(jnp.float32))
        g_BxTxJ = -decay_J * jax.nn.softplus(a_BxTxJ + self.dt_bias[...].astype(jnp.float32))
        entries = RecurrentEntries(qkv_BxTxX, k_BxTxJxDk, v_BxTxJxDv, g_BxTxJ, beta_BxTxJ)
        run = entries if commit_B is None else entries.kept(commit_B)
        form_args = (q_BxTxJxDk, k_BxTxJxDk, v_BxTxJxDv, run.g_BxTxJ, run.beta_BxTxJ)
        form_args += (state.state_BxJxDkxDv,)
        visible = None if packing is None else packing.visible_BxWxW  # a tree's ancestors
        if t == 1:
            out_BxTxJxDv, final = recurrent_form(*form_args)
        else:
            out_BxTxJxDv, final = chunked_form(*form_args, self.chunk, visible)
        if cache is None:
            entries = None
        elif commit_B is not None:
            entries = cache.commit(entries, lengths_B, None, commit_B, state_after=final)
        out = to_tokens(packing, out_BxTxJxDv)
        lead = x_BxTxD.shape[:2]  # (B, T), or (M, 1) packed
        z = self.in_proj_z(x_BxTxD).reshape(*lead, self.heads, self.value_dim)
        normed = self.norm(out.astype(self.dtype), z)
        return self.out_proj(normed.reshape(*lead, -1)), entries
