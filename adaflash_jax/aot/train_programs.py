"""The three train steps of a run (stage 1, head init, stage 2) as deviceless programs.

Dimensions: B batch, S sequence, N anchors.

Built exactly as the trainer builds them (`distill/stages.py`): the stage's optimizer
(`stage_optimizer`) and step spec (`step_spec`), `steps.make_step` + `steps.jit_step` with
the state and batch shardings of the run's mesh under TRAIN_RULES, and the TrainState of
`distill.state.new_train_state`, evaluated abstractly (fp32 drafter masters, the frozen
target in the compute dtype as `load_target` gives it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from adaflash_jax.aot import flops
from adaflash_jax.aot.abstract import (
    DTYPES,
    abstract_drafter_params,
    abstract_target,
    struct,
)
from adaflash_jax.aot.program import Program
from adaflash_jax.distill import steps
from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.shapes import run_drafter, run_target
from adaflash_jax.distill.stages import stage_optimizer, step_spec
from adaflash_jax.distill.state import new_train_state, tree_shardings
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.state import abstract_with_shardings

# [B, S] or [B, N] per batch key, as `distill.batches.BatchIterator` yields them
_BATCH = {
    "tokens": ("S", jnp.int32),
    "loss_mask": ("S", jnp.bool_),
    "anchors": ("N", jnp.int32),
    "valid": ("N", jnp.bool_),
}


def anchors_of(cfg: RunConfig, kind: str) -> int:
    """N of a step kind's batch: head init draws its own anchor count (`head_init.num_anchors`)."""
    return cfg.head_init.num_anchors if kind == "head_init" else cfg.num_anchors


def abstract_batch(cfg: RunConfig, shardings: dict, n: int) -> dict:
    if set(steps.BATCH_KEYS) != set(_BATCH):
        raise RuntimeError(
            f"steps.BATCH_KEYS is now {steps.BATCH_KEYS}: teach aot/train_programs.py the new "
            "batch fields"
        )
    length = {"S": cfg.seq_len, "N": n}
    out = {
        k: struct((cfg.batch_size, length[dim]), dtype, shardings[k])
        for k, (dim, dtype) in _BATCH.items()
    }
    out.update({k: struct((), jnp.float32, shardings[k]) for k in steps.KNOB_KEYS})
    return out


def stages_of(cfg: RunConfig) -> tuple[str, ...]:
    """The step kinds a run executes (stage 1 is skipped when it starts from an export)."""
    s2 = cfg.stage2
    runs = {
        "stage1": cfg.draft.init_from is None and cfg.stage1.steps > 0,
        "head_init": cfg.head_init.steps > 0,
        "stage2": bool(s2.methods) and s2.rounds * s2.steps_per_round > 0,
    }
    return tuple(k for k in steps.KINDS if runs[k])


def train_programs(
    cfg: RunConfig, mesh: Mesh, kinds=None, target=None, nonfinite_guard: bool = True
) -> list[Program]:
    """One Program per step kind (default: every kind the run executes); `target` replaces
    the run's target shape (e.g. a dense twin); `nonfinite_guard=False` builds the steps
    without the non-finite guard (only to measure it)."""
    target = target or run_target(cfg)
    dcfg = run_drafter(cfg, target)
    dtype = DTYPES[cfg.compute_dtype]
    t_graph, t_params = abstract_target(target, dtype, mesh, TRAIN_RULES)
    d_graph, d_params = abstract_drafter_params(dcfg, dtype, mesh, TRAIN_RULES, jnp.float32)
    bsh = steps.batch_shardings(mesh, TRAIN_RULES, cfg.batch_size)
    b, s = cfg.batch_size, cfg.seq_len
    out = []
    for kind in kinds or stages_of(cfg):
        n = anchors_of(cfg, kind)
        batch = abstract_batch(cfg, bsh, n)
        groups, clip = stage_optimizer(cfg, kind)
        tx, schedules = steps.make_optimizer(
            groups, clip_norm=clip, nonfinite_guard=nonfinite_guard
        )

        def init(params, frozen, tx=tx):
            return new_train_state(params, frozen, tx, mesh=mesh, rules=TRAIN_RULES, seed=cfg.seed)[
                0
            ]

        abstract = jax.eval_shape(init, d_params, t_params)
        shardings = tree_shardings(abstract, mesh, TRAIN_RULES)
        spec = dataclasses.replace(
            step_spec(cfg, dcfg, kind, mesh=mesh), nonfinite_guard=nonfinite_guard
        )
        fn = steps.jit_step(
            steps.make_step(spec, d_graph, t_graph, tx, schedules),
            state_shardings=shardings,
            batch_shardings_=bsh,
        )
        out.append(
            Program(
                name=kind,
                kind="train",
                fn=fn,
                args=(abstract_with_shardings(abstract, shardings), batch),
                useful_flops=flops.train_step(kind, target, dcfg, b, s, n),
                loop_flops=flops.loop_flops_left_out(
                    kind,
                    target,
                    dcfg,
                    b,
                    s,
                    n,
                    loss_chunk=cfg.loss_chunk,
                    attention=cfg.train_attention,
                    attention_chunk=cfg.attention_chunk,
                ),  # fmt: skip
                tokens=b * s,
                notes=(f"batch {b} x seq {s}, {n} anchors x block {dcfg.block_size}",),
            )
        )
    return out


def target_forward_program(cfg: RunConfig, mesh: Mesh, target=None) -> Program:
    """The frozen target's forward inside a train step, alone: the batch's B × S tokens with
    the drafter's feature layers and no logits, weights and rows laid out as the step has
    them (TRAIN_RULES, `StepSpec.rows`)."""
    target = target or run_target(cfg)
    dcfg = run_drafter(cfg, target)
    dtype = DTYPES[cfg.compute_dtype]
    t_graph, t_params = abstract_target(target, dtype, mesh, TRAIN_RULES)
    b, s = cfg.batch_size, cfg.seq_len
    tokens = struct((b, s), jnp.int32, steps.batch_shardings(mesh, TRAIN_RULES, b)["tokens"])
    spec = step_spec(cfg, dcfg, "stage2", mesh=mesh)

    @jax.jit
    def forward(frozen, tokens_BxS):
        target_lm = nnx.merge(t_graph, frozen)
        out = target_lm(
            tokens_BxS, feature_layers=spec.feature_layers, compute_logits=False, rows=spec.rows
        )
        return out.features_BxTxnD, out.hidden_BxTxD

    return Program(
        name="target forward",
        kind="train",
        fn=forward,
        args=(t_params, tokens),
        useful_flops=flops.target_forward(target, b, s),
        tokens=b * s,
        notes=(f"batch {b} x seq {s}, features of layers {list(spec.feature_layers)}",),
    )
