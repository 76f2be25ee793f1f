"""A run's models and shapes, built abstractly (`eval_shape`) with the shardings a mesh gives
them: what a deviceless compile lowers against. Nothing is allocated.

The shapes themselves are what the run config implies (`distill/shapes.py`); this module
gives them their shardings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from adaflash_jax.distill.state import abstract_drafter, tree_shardings
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.model.config import ConfigError, TargetConfig
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rules import Rules
from adaflash_jax.train.state import abstract_with_shardings

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dense_twin(target: TargetConfig) -> TargetConfig:
    """A hybrid target with every layer gated full attention: the same D, L, heads, MLP and
    norms, K/V caches where the hybrid has recurrent states (what rollback costs against)."""
    if not target.is_hybrid:
        raise ConfigError(f"a dense twin needs a hybrid target, not {target.model_type!r}")
    return dataclasses.replace(target, layer_types=("full_attention",) * target.num_hidden_layers)


def sharded(tree, mesh: Mesh, rules: Rules):
    """ShapeDtypeStructs of `tree` carrying the shardings `rules` give it on `mesh`."""
    return abstract_with_shardings(tree, tree_shardings(tree, mesh, rules))


def abstract_target(target: TargetConfig, dtype, mesh: Mesh, rules: Rules):
    """(graphdef, sharded abstract Params) of the target, as `load_target(dtype=dtype)`."""
    model = nnx.eval_shape(
        lambda: TargetLM(target, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    )
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, sharded(params, mesh, rules)


def abstract_drafter_params(dcfg: DrafterConfig, dtype, mesh: Mesh, rules: Rules, param_dtype):
    """(graphdef, sharded abstract Params) of the drafter in `param_dtype` (training keeps
    float32 masters; a serving engine may hold bf16)."""
    graphdef, params = abstract_drafter(dcfg, dtype)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype), params)
    return graphdef, sharded(params, mesh, rules)


def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of a tree of sharded ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        n = 1
        for d in shape:
            n *= d
        total += n * jnp.dtype(x.dtype).itemsize
    return total


def struct(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
