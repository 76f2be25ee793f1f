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

from adaflash_jax.drafter.checkpoint import (
    HEAD_PREFIX,
    config_from_hf,
    drafter_param_table,
)
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io.safetensors_io import SafetensorsFile
from adaflash_jax.model.checkpoint import CheckpointError
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
) -> tuple[DrafterConfig, nnx.GraphDef, nnx.State]:
    """An HF DFlash/AdaFlash export → sharded float32 params; each device reads only its
    slice from the memory map. A plain DFlash export gets a freshly initialised head."""
    import json

    path = os.fspath(path)
    cfg_path, st_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    for p in (cfg_path, st_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"drafter export {path} has no {os.path.basename(p)}")
    with open(cfg_path) as f:
        cfg = config_from_hf(json.load(f), with_length_head=with_length_head)
    file = SafetensorsFile(st_path)
    has_head = any(k.startswith(HEAD_PREFIX) for k in file.keys())
    graphdef, params = fresh_drafter(cfg, mesh=mesh, rules=rules, seed=seed, dtype=dtype)
    model = nnx.merge(graphdef, params)
    table = drafter_param_table(model)
    present = {k for k in file.keys() if has_head or not k.startswith(HEAD_PREFIX)}
    if cfg.length_head is None:
        present = {k for k in present if not k.startswith(HEAD_PREFIX)}
    required = {k for k in table if has_head or not k.startswith(HEAD_PREFIX)}
    if missing := sorted(required - present):
        raise CheckpointError(f"drafter {path} is missing tensors: {missing[:8]}")
    if unexpected := sorted(present - set(table)):
        raise CheckpointError(f"drafter {path} has unexpected tensors: {unexpected[:8]}")
    for name in sorted(required):
        var, transpose = table[name]
        mm = file.get(name)
        view = mm.T if transpose else mm
        shape = tuple(var.get_value().shape)
        if view.shape != shape:
            raise CheckpointError(f"drafter tensor {name!r} has shape {list(mm.shape)}")
        sharding = variable_sharding(var, mesh, rules)
        var.set_value(
            jax.make_array_from_callback(
                shape, sharding, lambda idx, v=view: np.asarray(v[idx], np.float32)
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
