"""Which programs to compile: those a distillation run executes, or a serving cost table.

`run_programs(cfg, mesh)`: the run's train steps (stage 1, head init, stage 2), the
regeneration program, the speculative engine's prefill of all slots and its step at every
verify width, at the configured slots (collection `stage2.collect_slots`; evaluation
`eval.slots` when it differs), and the drafter's block forward, all on the run's mesh under
TRAIN_RULES as the run shards them.

`serve_programs(...)`: decoding with tensor-parallel weights (DECODE_RULES, mesh
(1, 1, chips)): per row count B the engine's plain step, the drafter forward and the drafted
step at each width — the verify-step table `cost_table` turns into a goodput / projection
cost table (`io/cost_table.py`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import Mesh

from adaflash_jax.aot import decode_programs as dp
from adaflash_jax.aot.abstract import DTYPES
from adaflash_jax.aot.program import Program
from adaflash_jax.aot.report import LABEL, Figures
from adaflash_jax.aot.train_programs import target_forward_program, train_programs
from adaflash_jax.bench.step_cost import table_from_steps
from adaflash_jax.decode.slots import DEFAULT_BUCKETS
from adaflash_jax.decode.state import bucket_set
from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.shapes import engine_capacity, run_drafter, run_target
from adaflash_jax.io.cost_table import VerifyCostTable
from adaflash_jax.sharding.rules import DECODE_RULES, TRAIN_RULES

GROUPS = ("train", "generate", "prefill", "engine", "draft")
# on request only (`--only`): the target's training forward alone, the engine's plain step
EXTRA_GROUPS = ("target", "plain")


def run_programs(
    cfg: RunConfig, mesh: Mesh, groups=GROUPS, widths=None, target=None, nonfinite_guard=True
) -> list[Program]:
    """The programs a run executes (`groups`); the engine step at `widths` (default: all
    buckets); `target` replaces the run's target shape (e.g. `abstract.dense_twin`);
    `nonfinite_guard=False`: train steps without the non-finite guard (to measure it)."""
    out = []
    target = target or run_target(cfg)
    if "train" in groups:
        out += train_programs(cfg, mesh, target=target, nonfinite_guard=nonfinite_guard)
    if "target" in groups:
        out.append(target_forward_program(cfg, mesh, target=target))
    dtype = DTYPES[cfg.compute_dtype]
    # the run's decoders read the training state: fp32 drafter masters, target under TRAIN_RULES
    m = dp.models(
        target, run_drafter(cfg, target), mesh, TRAIN_RULES, dtype=dtype,
        drafter_param_dtype=jnp.float32,
    )  # fmt: skip
    d = cfg.data
    if "generate" in groups:
        out += dp.generate_programs(
            m, batch=d.regen_batch, prompt_len=d.max_prompt_len, max_new=d.max_new_tokens
        )
    cap = engine_capacity(cfg)
    slots = [(cfg.stage2.collect_slots, cfg.stage2.collect_temperature, "collection")]
    if cfg.eval.slots != cfg.stage2.collect_slots:
        slots.append((cfg.eval.slots, 0.0, "evaluation"))
    for n, temperature, use in slots:
        used = cfg.stage2.collector if use == "collection" else cfg.eval.backend
        note = f"{use}: " + ("this run's engine" if used == "engine" else "run uses replay")
        if "prefill" in groups:
            p = dp.prefill_program(m, slots=n, capacity=cap, prompt_len=d.max_prompt_len)
            out.append(_noted(p, note))
        if "plain" in groups:
            out.append(_noted(dp.plain_program(m, slots=n, capacity=cap), note))
        if "engine" in groups:
            for p in dp.engine_programs(
                m, slots=n, capacity=cap, temperature=temperature, widths=widths
            ):
                out.append(_noted(p, note))
        if "draft" in groups:
            out.append(_noted(dp.draft_program(m, slots=n, capacity=cap), note))
    return out


def _noted(p: Program, note: str) -> Program:
    return dataclasses.replace(p, notes=(*p.notes, note))


def serve_programs(
    cfg: RunConfig, mesh: Mesh, *, rows, capacity: int, widths=None, target=None, fills=(),
    trees=(),
) -> list[Program]:  # fmt: skip
    """Per row count: the plain step, the drafter forward, the drafted step per width > 1,
    under packed verify per fill > 1 (`fills`: mean tokens per row of a token bucket), and
    per draft tree (`trees`: `TreeShape`s, every row its whole tree)."""
    target = target or run_target(cfg)
    m = dp.models(
        target, run_drafter(cfg, target), mesh, DECODE_RULES, dtype=jnp.bfloat16,
        drafter_param_dtype=jnp.bfloat16,
    )  # fmt: skip
    k = m.drafter_cfg.block_size
    widths = [w for w in (widths or bucket_set(DEFAULT_BUCKETS, k)) if w > 1]
    out = []
    for b in rows:
        out.append(dp.plain_program(m, slots=b, capacity=capacity))
        out.append(dp.draft_program(m, slots=b, capacity=capacity))
        out += dp.engine_programs(m, slots=b, capacity=capacity, widths=widths)
        fills_b = [f for f in fills if f > 1]
        out += dp.packed_engine_programs(m, slots=b, capacity=capacity, fills=fills_b)
        out += dp.tree_engine_programs(m, slots=b, capacity=capacity, trees=trees)
    return out


def cost_table(figs: list[Figures], *, device: str, model: str) -> VerifyCostTable:
    """The cost table (`io/cost_table.py`) from the serve programs' estimates, decomposed as
    the timed tables are (`bench/step_cost.table_from_steps`): verify[1] is the plain step,
    draft the drafter's block forward, and verify[W] = drafted step at W − draft. (A drafted
    step pinned to W = 1 verifies no draft, so XLA drops its drafter forward: it is not
    compiled here.)"""
    est = {f.program: f.optimal_seconds * 1e3 for f in figs if f.compiled}
    missing = [f.program for f in figs if not f.compiled]
    if missing:
        raise ValueError(f"no estimate for {missing}: the compiler refused them")
    rows = sorted({f.rows for f in figs if f.program.startswith("plain")})
    widths = sorted({f.width for f in figs if f.program.startswith("engine")})
    fills = sorted({f.width for f in figs if f.program.startswith("packed")})
    return table_from_steps(
        rows=rows,
        widths=widths,
        plain_ms=[est[f"plain B={b}"] for b in rows],
        draft_ms=[est[f"draft B={b}"] for b in rows],
        drafted_ms=[[est[f"engine W={w} B={b}"] for w in widths] for b in rows],
        fills=fills,
        packed_ms=[[est[f"packed F={f} B={b}"] for f in fills] for b in rows],
        device=f"{device}: {LABEL}",
        model=model,
    )
