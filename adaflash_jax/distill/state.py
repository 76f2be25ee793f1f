"""Sharded drafter/target state for distillation: built abstractly, materialised sharded.

The drafter's parameters (length head included) are float32 master weights; the compute
dtype only affects activations. The frozen target rides in `TrainState.frozen` (so the step
is one function of (state, batch)) but is never checkpointed: `checkpointable` strips it,
and restores re-attach the target loaded from its own directory.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from adaflash_jax.drafter.checkpoint import open_export
from adaflash_jax.drafter.config import DEFAULT_ACCEPT_DIM, DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.sharding.rules import Rules, variable_sharding
from adaflash_jax.train.state import TrainState


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def tree_shardings(tree, mesh: Mesh, rules: Rules):
    """Like `train.state.tree_shardings`, but also accepts optimizer states in which
    `optax.multi_transform` left `MaskedNode` placeholders (frozen groups hold no arrays)."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):
        if not _is_variable(x):
            return replicated
        if isinstance(x.get_value(), optax.MaskedNode):
            return x
        return x.replace(value=variable_sharding(x, mesh, rules))

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def _drafter_fn(cfg: DrafterConfig, dtype):
    return lambda rngs: Drafter(cfg, rngs=rngs, dtype=dtype, param_dtype=jnp.float32)


def abstract_drafter(cfg: DrafterConfig, dtype=jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract params): no allocation."""
    model = nnx.eval_shape(lambda: _drafter_fn(cfg, dtype)(nnx.Rngs(0)))
    return nnx.split(model, nnx.Param)


def fresh_drafter(
    cfg: DrafterConfig, *, mesh: Mesh, rules: Rules, seed: int, dtype=jnp.float32
) -> tuple[nnx.GraphDef, nnx.State]:
    """Randomly initialised drafter params, created directly in their sharded layout."""
    graphdef, abstract = abstract_drafter(cfg, dtype)
    shardings = tree_shardings(abstract, mesh, rules)

    def init(key):
        return nnx.state(_drafter_fn(cfg, dtype)(nnx.Rngs(params=key)), nnx.Param)

    return graphdef, jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(seed))


def load_drafter_sharded(
    path: str | os.PathLike,
    *,
    mesh: Mesh,
    rules: Rules,
    seed: int,
    dtype=jnp.float32,
    with_length_head: bool = True,
    accept_dim: int | None = None,
) -> tuple[DrafterConfig, nnx.GraphDef, nnx.State]:
    """An HF DFlash/AdaFlash export → sharded float32 params; each device reads only its
    slice from the memory map. A plain DFlash export gets a freshly initialised head.

    `accept_dim` None loads the export's acceptance part, or gives an export without one a
    fresh `DEFAULT_ACCEPT_DIM`-wide network (the `DraftSpec.accept_dim` default); 0 drops it.
    """
    export = open_export(
        path,
        with_length_head=with_length_head,
        accept_dim=accept_dim,
        fresh_accept_dim=DEFAULT_ACCEPT_DIM,
    )
    cfg = export.config
    graphdef, params = fresh_drafter(cfg, mesh=mesh, rules=rules, seed=seed, dtype=dtype)
    model = nnx.merge(graphdef, params)
    for _, var, view in export.arrays(model):
        sharding = variable_sharding(var, mesh, rules)
        var.set_value(
            jax.make_array_from_callback(
                view.shape, sharding, lambda idx, v=view: np.asarray(v[idx], np.float32)
            )
        )
    return cfg, graphdef, nnx.state(model, nnx.Param)


def new_train_state(
    params: nnx.State,
    frozen,
    tx: optax.GradientTransformation,
    *,
    mesh: Mesh,
    rules: Rules,
    seed: int,
) -> tuple[TrainState, TrainState]:
    """(state, shardings) for a stage starting from `params` (step 0, fresh optimizer).

    The step donates the state, frozen target included: after a stage, take the target from
    the returned state (`state.frozen`), not from the tree passed in here.
    """

    def init(p, f, key):
        # A real copy: the caller keeps `params` (e.g. stage-2 methods share a start) while
        # the step donates the state's buffers. The frozen target is passed through.
        p = jax.tree.map(jnp.copy, p)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p), rng=key, frozen=f
        )

    key = jax.random.PRNGKey(seed)
    abstract = jax.eval_shape(init, params, frozen, key)
    shardings = tree_shardings(abstract, mesh, rules)
    return jax.jit(init, out_shardings=shardings)(params, frozen, key), shardings


def checkpointable(state: TrainState) -> TrainState:
    """The state without the frozen target (restored from the target directory instead)."""
    return state.replace(frozen=None)


def abstract_checkpoint(state_or_abstract: TrainState):
    """Abstract arrays of the checkpointed part (restore target)."""
    return jax.eval_shape(lambda s: s, checkpointable(state_or_abstract))
