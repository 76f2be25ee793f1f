"""Qwen3-MoE sparse block: a softmax router over E experts, top-k, per-expert SwiGLU.

Dimensions: N tokens (B·T flattened), D model, E experts, k experts per token
(`num_experts_per_tok`), F expert MLP hidden (`moe_intermediate_size`), M = N·k routed rows.

Matches transformers' Qwen3MoeSparseMoeBlock: router logits in the compute dtype, softmax in
float32 over ALL experts, top-k of the probabilities, renormalised over the k when
`norm_topk_prob`, cast back, and y = Σ_k p_k · expert_k(x). Dropless: every token reaches
its k experts (no capacity factor). The N·k (token, expert) rows are sorted by expert and
run as three grouped matmuls (`jax.lax.ragged_dot`), so each expert multiplies only its own
rows; the rows are then unsorted and summed per token with their router weights.

Expert weights are stacked [E, ...] with logical axes `expert` (E), `embed` (D) and
`expert_mlp` (F), which `sharding/rules.py` places on the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.model.layers import Dense, normal_init


class MoEBlock(nnx.Module):
    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool,
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
    ):
        self.top_k, self.norm_topk_prob, self.dtype = top_k, norm_topk_prob, dtype
        self.gate = Dense(
            dim,
            num_experts,
            logical_axes=("embed", None),
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        up_axes, down_axes = ("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed")
        self.gate_proj = nnx.Param(
            normal_init(rngs, (num_experts, dim, hidden), param_dtype), logical_axes=up_axes
        )
        self.up_proj = nnx.Param(
            normal_init(rngs, (num_experts, dim, hidden), param_dtype), logical_axes=up_axes
        )
        self.down_proj = nnx.Param(
            normal_init(rngs, (num_experts, hidden, dim), param_dtype), logical_axes=down_axes
        )

    def route(self, x_NxD):
        """(router weights [N, k] in the compute dtype, expert ids [N, k])."""
        probs_NxE = jax.nn.softmax(self.gate(x_NxD).astype(jnp.float32), axis=-1)
        weights_Nxk, experts_Nxk = jax.lax.top_k(probs_NxE, self.top_k)
        if self.norm_topk_prob:
            weights_Nxk = weights_Nxk / weights_Nxk.sum(axis=-1, keepdims=True)
        return weights_Nxk.astype(self.dtype), experts_Nxk

    def __call__(self, x_BxTxD):
        b, t, d = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(b * t, d).astype(self.dtype)
        weights_Nxk, experts_Nxk = self.route(x_NxD)
        num_experts = self.gate_proj.shape[0]
        experts_M = experts_Nxk.reshape(-1)
        order_M = jnp.argsort(experts_M, stable=True)  # routed rows grouped by expert
        group_sizes_E = jnp.bincount(experts_M, length=num_experts).astype(jnp.int32)
        xs_MxD = x_NxD[order_M // self.top_k]
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        gate_MxF = jax.lax.ragged_dot(xs_MxD, w(self.gate_proj), group_sizes_E)
        up_MxF = jax.lax.ragged_dot(xs_MxD, w(self.up_proj), group_sizes_E)
        h_MxF = jax.nn.silu(gate_MxF) * up_MxF
        ys_MxD = jax.lax.ragged_dot(h_MxF, w(self.down_proj), group_sizes_E)
        y_MxD = jnp.zeros_like(ys_MxD).at[order_M].set(ys_MxD, unique_indices=True)
        y_NxkxD = y_MxD.reshape(b * t, self.top_k, d)
        y_NxD = jnp.einsum("nkd,nk->nd", y_NxkxD, weights_Nxk)
        return y_NxD.reshape(b, t, d)
