"""Logical-axis → mesh-axis rule tables, in ONE place (docs/design.md §8.2, maxtext rules-as-data).

Parameters name their axes logically (`vocab`, `embed`, `q_heads`, `kv_heads`, `mlp`,
`norm`, `features`, and for a mixture of experts' stacked weights `expert` (E) and
`expert_mlp` (each expert's F), ...). A rule table maps each logical name to a mesh axis, a tuple of
mesh axes, or None (replicated). A mapping is dropped for a dimension it does not divide,
so small models (and kv heads fewer than the tensor axis) still shard correctly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# Training: batch over (data, fsdp); weights fully sharded over fsdp and split over tensor.
TRAIN_RULES: Rules = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "fsdp",  # whole experts per fsdp shard (gathered per layer, as any fsdp weight)
    "expert_mlp": "tensor",
    "linear_qkv": "tensor",  # a Gated DeltaNet's q/k/v channels, value dims, value heads
    "linear_v": "tensor",
    "linear_heads": "tensor",
    "features": "fsdp",
    "norm": None,
    "head_hidden": None,
    "accept_in": None,
    "accept_hidden": None,
    "accept_pos": None,
}

# Decoding: weights split over tensor only (no per-step all-gathers), batch over data. Every
# chip holds a 1/tensor slice of EVERY expert's F (Megatron-style): a step's grouped matmuls
# run locally on the rows routed to each expert and end in one all-reduce, like a dense MLP.
DECODE_RULES: Rules = {
    "batch": "data",
    "vocab": "tensor",
    "embed": None,
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": None,
    "expert_mlp": "tensor",
    "linear_qkv": "tensor",
    "linear_v": "tensor",
    "linear_heads": "tensor",
    "features": None,
    "norm": None,
    "head_hidden": None,
    "accept_in": None,
    "accept_hidden": None,
    "accept_pos": None,
}


def _axis_size(mesh: Mesh, axes: MeshAxes) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    size = 1
    for n in names:
        size *= mesh.shape[n]
    return size


def logical_to_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules
) -> PartitionSpec:
    """PartitionSpec for one array; a mesh axis is used at most once per array."""
    used: set[str] = set()
    out = []
    for name, dim in zip(logical_axes, shape, strict=True):
        axes = rules.get(name) if name is not None else None
        if axes is not None:
            names = (axes,) if isinstance(axes, str) else tuple(axes)
            names = tuple(n for n in names if n in mesh.shape and n not in used)
            axes = names if names else None
            if axes is not None and (dim % _axis_size(mesh, axes) or _axis_size(mesh, axes) == 1):
                axes = None
            if axes is not None:
                used.update(axes)
                axes = axes[0] if len(axes) == 1 else axes
        out.append(axes)
    return PartitionSpec(*out)


def variable_sharding(variable: nnx.Variable, mesh: Mesh, rules: Rules) -> NamedSharding:
    value = variable.get_value()
    axes = variable.get_metadata().get("logical_axes") or (None,) * len(value.shape)
    return NamedSharding(mesh, logical_to_spec(axes, value.shape, mesh, rules))


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules):
    """A pytree of NamedShardings matching `state` (of Variables or abstract Variables)."""
    return jax.tree.map(
        lambda v: variable_sharding(v, mesh, rules),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
