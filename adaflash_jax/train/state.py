"""A sharded train state, initialised abstractly and materialised directly on its devices.

`TrainState` is a plain pytree: trainable `params` (an `nnx.State` of Variables that carry
`logical_axes`), the optax state (whose moment trees mirror the params, Variables and
metadata included), a step counter, an rng key, and an optional `frozen` tree of
non-trainable arrays (e.g. a distillation teacher's weights).

Shardings come from ONE place: each Variable's `logical_axes` through a rule table
(`adaflash_jax.sharding.rules`); anything without axes (counters, keys, scalars) is
replicated. `create_train_state` runs the init function under `jax.eval_shape` first, then
jits it with those output shardings, so no full-size array ever exists on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from adaflash_jax.sharding.rules import Rules, logical_to_spec, variable_sharding


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: Any  # nnx.State of trainable Variables
    opt_state: Any
    rng: jax.Array  # uint32[2] raw key (checkpoint-friendly), split once per step
    frozen: Any = None  # non-trainable arrays the loss reads (not updated)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def tree_shardings(tree, mesh: Mesh, rules: Rules):
    """Shardings with the full structure of `tree`: Variables by their logical axes (the
    Variable wrapper kept, holding a NamedSharding), every other leaf replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):
        if _is_variable(x):
            return x.replace(value=variable_sharding(x, mesh, rules))
        return replicated

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def abstract_with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs carrying shardings: the restore target for a checkpoint."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings
    )


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2, batch_size: int = 0) -> NamedSharding:
    """Leading dim over the rules' `batch` mesh axes, the rest replicated."""
    axes = ("batch",) + (None,) * (ndim - 1)
    shape = (batch_size or _mesh_batch_size(mesh, rules),) + (1,) * (ndim - 1)
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def _mesh_batch_size(mesh: Mesh, rules: Rules) -> int:
    names = rules.get("batch") or ()
    names = (names,) if isinstance(names, str) else names
    size = 1
    for n in names:
        size *= mesh.shape.get(n, 1)
    return size


def split_model(model_fn: Callable[[nnx.Rngs], nnx.Module]):
    """(graphdef, abstract params) of a model, without allocating anything."""
    model = nnx.eval_shape(lambda: model_fn(nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def create_train_state(
    model_fn: Callable[[nnx.Rngs], nnx.Module],
    tx: optax.GradientTransformation,
    *,
    mesh: Mesh,
    rules: Rules,
    seed: int,
    frozen_fn: Callable[[], Any] | None = None,
) -> tuple[TrainState, TrainState, Any]:
    """(state, state shardings, graphdef). `model_fn(rngs)` builds the model whose Params
    are trained; `frozen_fn()` (optional, pure) builds the frozen tree."""

    def init(key):
        params_key, state_key = jax.random.split(key)
        model = model_fn(nnx.Rngs(params=params_key))
        params = nnx.state(model, nnx.Param)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=state_key,
            frozen=frozen_fn() if frozen_fn is not None else None,
        )

    key = jax.random.PRNGKey(seed)
    abstract = jax.eval_shape(init, key)
    shardings = tree_shardings(abstract, mesh, rules)
    state = jax.jit(init, out_shardings=shardings)(key)
    graphdef, _ = split_model(model_fn)
    return state, shardings, graphdef
