"""A run's training state built abstractly (`jax.eval_shape`): shapes and bytes, no memory.

Used to check a recipe such as `experiments/configs/qwen3_8b_v5p.py` on a laptop: the
stage-2 state (drafter + head, fp32 masters, AdamW moments for both groups, the frozen
target) exactly as the trainer builds it, with the shardings the mesh would give it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.distill import steps
from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.shapes import run_drafter_config
from adaflash_jax.distill.state import abstract_drafter
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.target import TargetLM
from adaflash_jax.train.optimizer import OptimizerConfig
from adaflash_jax.train.state import TrainState


def abstract_stage2_state(cfg: RunConfig, target: TargetConfig) -> TrainState:
    """ShapeDtypeStructs of the stage-2 TrainState of `cfg` for `target` (nothing allocated)."""
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[cfg.compute_dtype]
    dcfg = run_drafter_config(cfg, target)
    dcfg.validate_against(target)
    model = nnx.eval_shape(
        lambda: TargetLM(target, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    )
    _, t_params = nnx.split(model, nnx.Param)
    _, d_params = abstract_drafter(dcfg, dtype)
    s2 = cfg.stage2
    tx, _ = steps.make_optimizer(
        {
            "drafter": OptimizerConfig(lr=s2.lr, schedule="constant"),
            "head": OptimizerConfig(lr=s2.head_lr, schedule="constant"),
        },
        clip_norm=s2.clip_norm,
    )

    def init(p, f):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=p,
            opt_state=tx.init(p),
            rng=jax.random.PRNGKey(0),
            frozen=f,
        )

    return jax.eval_shape(init, d_params, t_params)


def nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))
