"""Qwen3-MoE sparse block: a softmax router over E experts, top-k, per-expert SwiGLU.

Dimensions: N tokens (B·T flattened), D model, E experts, k experts per token
(`num_experts_per_tok`), F expert MLP hidden (`moe_intermediate_size`), M = N·k routed rows.

Matches transformers' Qwen3MoeSparseMoeBlock: router logits in the compute dtype, softmax in
float32 over ALL experts, top-k of the probabilities, renormalised over the k when
`norm_topk_prob`, cast back, and y = Σ_k p_k · expert_k(x). Dropless: every token reaches
its k experts (no capacity factor). The N·k (token, expert) rows are sorted by expert and
run as three grouped matmuls (`jax.lax.ragged_dot`), so each expert multiplies only its own
rows; the rows are then unsorted and summed per token with their router weights.

Routing is per row shard. With the batch's rows split over mesh axes (`RowLayout`: data,
fsdp), a sort over the whole batch would make every chip gather and compute every row (the
compiled 30B-A3B stage-2 step counted 2.3x the useful FLOPs per chip). So the block runs under
`jax.shard_map`, manual over the row axes only: each chip sorts and multiplies its own rows,
against every expert's weights (replicated over the row axes: FSDP gathers them per layer,
as any fsdp-sharded weight; decoding keeps them whole on every chip anyway). The other mesh
axes (tensor: each expert's F) stay with the compiler. Values do not change: a token's output
depends on its own row only.

Qwen3.5-MoE adds a shared expert, a SwiGLU every token takes, scaled by sigmoid(x·w_shared):
y = Σ_k p_k · expert_k(x) + σ(x·w_shared) · shared(x).

Other families differ in a few fixed places, named by `MoEVariant` (the default is Qwen3-MoE):
a router bias, per-expert biases on the three projections, gpt-oss's clamped SwiGLU
(gate clamped to at most `limit`, up to ±`limit`, (up + 1) · gate · σ(alpha · gate)), and
the softmax taken over the k chosen logits instead of over all E.

Expert weights are stacked [E, ...] with logical axes `expert` (E), `embed` (D) and
`expert_mlp` (F), which `sharding/rules.py` places on the mesh.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from adaflash_jax.model.layers import Dense, SwiGLU, normal_init
from adaflash_jax.sharding.rows import RowLayout

ACTIVATIONS = ("swiglu", "clamped_swiglu")


@dataclasses.dataclass(frozen=True)
class MoEVariant:
    """What a family's sparse block changes against Qwen3-MoE (the default, all off)."""

    router_bias: bool = False  # the router Dense's bias `gate.bias` [E]
    expert_bias: bool = False  # gate_proj_bias, up_proj_bias [E, F]; down_proj_bias [E, D]
    activation: str = "swiglu"  # or "clamped_swiglu" (gpt-oss), with alpha and limit
    alpha: float = 1.702
    limit: float = 7.0
    softmax_after_topk: bool = False  # top-k of the logits, then softmax over the k

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation {self.activation!r}: supported: {ACTIVATIONS}")


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
        shared_hidden: int = 0,
        variant: MoEVariant = MoEVariant(),
    ):
        self.top_k, self.norm_topk_prob, self.dtype = top_k, norm_topk_prob, dtype
        self.variant = variant
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.shared_expert = SwiGLU(dim, shared_hidden, **kw) if shared_hidden else None
        self.shared_expert_gate = (
            Dense(dim, 1, logical_axes=("embed", None), **kw) if shared_hidden else None
        )
        self.gate = Dense(
            dim,
            num_experts,
            logical_axes=("embed", None),
            use_bias=variant.router_bias,
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
        if variant.expert_bias:
            zeros = functools.partial(jnp.zeros, dtype=param_dtype)
            self.gate_proj_bias = nnx.Param(zeros((num_experts, hidden)), logical_axes=up_axes[::2])
            self.up_proj_bias = nnx.Param(zeros((num_experts, hidden)), logical_axes=up_axes[::2])
            self.down_proj_bias = nnx.Param(zeros((num_experts, dim)), logical_axes=down_axes[::2])
        else:
            self.gate_proj_bias = self.up_proj_bias = self.down_proj_bias = None

    def __call__(self, x_BxTxD, rows: RowLayout | None = None):
        """y = Σ_k p_k · expert_k(x) per token; per row shard when `rows` splits the batch."""
        b, t, d = x_BxTxD.shape
        weights = {k: p[...].astype(self.dtype) for k, p in self.weights().items()}
        mix = functools.partial(
            mix_tokens,
            top_k=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            variant=self.variant,
            dtype=self.dtype,
        )
        x_NxD = x_BxTxD.reshape(b * t, d).astype(self.dtype)
        if rows is None or b % rows.size:
            y_BxTxD = mix(x_NxD, weights).reshape(b, t, d)
        else:
            split, whole = PartitionSpec(rows.axes), PartitionSpec()
            local = jax.shard_map(
                mix,
                mesh=rows.mesh,
                in_specs=(split, whole),
                out_specs=split,
                axis_names=set(rows.names),
            )
            y_BxTxD = local(x_NxD, weights).reshape(b, t, d)
        if self.shared_expert is None:
            return y_BxTxD
        x = x_BxTxD.astype(self.dtype)
        return y_BxTxD + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def weights(self) -> dict[str, nnx.Param]:
        """The routed parameters by role: router [D, E] (router_bias [E]), gate and up
        [E, D, F], down [E, F, D] (gate_bias, up_bias [E, F], down_bias [E, D])."""
        out = dict(
            router=self.gate.kernel,
            router_bias=self.gate.bias,
            gate=self.gate_proj,
            up=self.up_proj,
            down=self.down_proj,
            gate_bias=self.gate_proj_bias,
            up_bias=self.up_proj_bias,
            down_bias=self.down_proj_bias,
        )
        return {k: v for k, v in out.items() if v is not None}

    def route(self, x_NxD):
        """(router weights [N, k] in float32, expert ids [N, k])."""
        w = {k: p[...].astype(self.dtype) for k, p in self.weights().items()}
        return route(x_NxD.astype(self.dtype), w, self.top_k, self.norm_topk_prob, self.variant)


def route(x_NxD, weights, top_k: int, norm_topk_prob: bool, variant: MoEVariant = MoEVariant()):
    """(router weights [N, k] in float32, expert ids [N, k]). Default: softmax over all E
    experts in float32, top-k, renormalised over the k if asked; `softmax_after_topk`: top-k
    of the logits, softmax over the k."""
    logits_NxE = jnp.dot(x_NxD, weights["router"])
    if "router_bias" in weights:
        logits_NxE = logits_NxE + weights["router_bias"]
    logits_NxE = logits_NxE.astype(jnp.float32)
    if variant.softmax_after_topk:
        top_Nxk, experts_Nxk = jax.lax.top_k(logits_NxE, top_k)
        return jax.nn.softmax(top_Nxk, axis=-1), experts_Nxk
    weights_Nxk, experts_Nxk = jax.lax.top_k(jax.nn.softmax(logits_NxE, axis=-1), top_k)
    if norm_topk_prob:
        weights_Nxk = weights_Nxk / weights_Nxk.sum(axis=-1, keepdims=True)
    return weights_Nxk, experts_Nxk


def expert_mlp(xs_MxD, weights, group_sizes_E, experts_M, variant: MoEVariant):
    """Each routed row through its expert: rows grouped by expert (`group_sizes_E`, ids
    `experts_M` for the biases), three grouped matmuls and the variant's activation."""
    gate_MxF = jax.lax.ragged_dot(xs_MxD, weights["gate"], group_sizes_E)
    up_MxF = jax.lax.ragged_dot(xs_MxD, weights["up"], group_sizes_E)
    if "gate_bias" in weights:
        gate_MxF = gate_MxF + weights["gate_bias"][experts_M]
        up_MxF = up_MxF + weights["up_bias"][experts_M]
    if variant.activation == "clamped_swiglu":
        gate_MxF = jnp.minimum(gate_MxF, variant.limit)
        up_MxF = jnp.clip(up_MxF, -variant.limit, variant.limit)
        h_MxF = (up_MxF + 1) * (gate_MxF * jax.nn.sigmoid(variant.alpha * gate_MxF))
    else:
        h_MxF = jax.nn.silu(gate_MxF) * up_MxF
    ys_MxD = jax.lax.ragged_dot(h_MxF, weights["down"], group_sizes_E)
    if "down_bias" in weights:
        ys_MxD = ys_MxD + weights["down_bias"][experts_M]
    return ys_MxD


def mix_tokens(x_NxD, weights, *, top_k, norm_topk_prob, variant, dtype):
    """The block over N tokens: route, sort by expert, three grouped matmuls, unsort, sum."""
    n, d = x_NxD.shape
    num_experts = weights["router"].shape[1]
    weights_Nxk, experts_Nxk = route(x_NxD, weights, top_k, norm_topk_prob, variant)
    experts_M = experts_Nxk.reshape(-1)
    order_M = jnp.argsort(experts_M, stable=True)  # routed rows grouped by expert
    xs_MxD = x_NxD[order_M // top_k]
    ys_MxD = expert_mlp(
        xs_MxD, weights, group_sizes(experts_M, num_experts), experts_M[order_M], variant
    )
    y_MxD = jnp.zeros_like(ys_MxD).at[order_M].set(ys_MxD, unique_indices=True)
    y_NxkxD = y_MxD.reshape(n, top_k, d)
    return jnp.einsum("nkd,nk->nd", y_NxkxD, weights_Nxk.astype(dtype))


def group_sizes(experts_M, num_experts: int):
    """Rows per expert [E]: how many ids fall below each boundary e = 0..E, differenced.
    (`jnp.bincount` gives the same counts, but its scatter-add makes XLA's TPU cost model
    report a negative step time for the whole program.)"""
    bounds_E1 = jnp.arange(num_experts + 1, dtype=experts_M.dtype)
    below_E1 = jnp.sum(experts_M[None, :] < bounds_E1[:, None], axis=1, dtype=jnp.int32)
    return jnp.diff(below_E1)
