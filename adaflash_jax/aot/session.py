"""One deviceless compile session: a run config and a TPU slice → compiled figures + report.

`compile_run` compiles the programs a distillation run executes on its own mesh;
`compile_serve` the tensor-parallel decoding table. Both print one progress line per program
(compiles of an 8B model take minutes on a small CPU) and return (figures, report dict).
"""

from __future__ import annotations

import dataclasses
import sys

import jax

from adaflash_jax.aot import programs as P
from adaflash_jax.aot import report as R
from adaflash_jax.aot.abstract import dense_twin
from adaflash_jax.aot.topology import Slice, slice_devices
from adaflash_jax.distill.checks import check_runtime
from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.shapes import run_drafter, run_target
from adaflash_jax.model.config import ConfigError


def _mesh(sl: Slice, shape):
    from adaflash_jax.train.mesh import make_mesh

    return make_mesh(*shape, devices=slice_devices(sl))


def _compile_all(progs, sl: Slice, log=None, no_msa: bool = False) -> list[R.Figures]:
    log = sys.stderr if log is None else log  # looked up now: a stream swapped in later counts
    figs = []
    for i, p in enumerate(progs, 1):
        f = R.compile_program(p, sl.chip, sl.chips, no_msa=no_msa)
        jax.clear_caches()  # a 30-program 8B session reached 12 GB RSS without this
        state = "compiled" if f.compiled else f"refused: {f.error}"
        print(f"[{i}/{len(progs)}] {p.name}: {state} in {f.compile_s:.0f} s", file=log, flush=True)
        figs.append(f)
    return figs


def _meta(cfg: RunConfig, sl: Slice, mesh_shape, mode: str, overrides: dict) -> dict:
    return dict(
        mode=mode,
        slice=sl.name,
        topology=sl.topology,
        chips=sl.chips,
        chip=dataclasses.asdict(sl.chip),
        mesh=dict(zip(("data", "fsdp", "tensor"), mesh_shape)),
        config=cfg.name,
        overrides=overrides,
    )


def _target(cfg: RunConfig, twin: bool):
    target = run_target(cfg)
    return dense_twin(target) if twin else target


def compile_run(
    cfg: RunConfig, sl: Slice, *, groups=P.GROUPS, widths=None, overrides=None, log=None,
    twin: bool = False, no_msa: bool = False, nonfinite_guard: bool = True,
):  # fmt: skip
    """`twin`: the target's dense twin (`abstract.dense_twin`) instead of the hybrid;
    `no_msa`: decode programs also without memory-space assignment (`report.compile_program`);
    `nonfinite_guard=False`: train steps without the non-finite guard (to measure it)."""
    target = _target(cfg, twin)
    dcfg = run_drafter(cfg, target)
    shape = check_runtime(
        cfg, num_devices=sl.chips, target=target, mask_token_id=dcfg.mask_token_id
    )
    progs = P.run_programs(
        cfg, _mesh(sl, shape), groups=groups, widths=widths, target=target,
        nonfinite_guard=nonfinite_guard,
    )  # fmt: skip
    figs = _compile_all(progs, sl, log, no_msa)
    meta = _meta(cfg, sl, shape, "run", overrides or {})
    meta.update(dense_twin=twin, no_msa=no_msa, nonfinite_guard=nonfinite_guard)
    return figs, R.to_json(figs, **meta)


def compile_serve(
    cfg: RunConfig, sl: Slice, *, rows, capacity: int, widths=None, overrides=None,
    log=None, twin: bool = False, fills=(), no_msa: bool = False, trees=(),
):  # fmt: skip
    """Decoding with the weights split over all chips (mesh (1, 1, chips), DECODE_RULES:
    a dimension the tensor axis does not divide stays whole), bf16 target and drafter.
    `no_msa`: each also without memory-space assignment (`report.compile_program`)."""
    target = _target(cfg, twin)
    if capacity > target.max_position_embeddings:
        raise ConfigError(
            f"capacity {capacity} exceeds max_position_embeddings {target.max_position_embeddings}"
        )
    shape = (1, 1, sl.chips)
    progs = P.serve_programs(
        cfg, _mesh(sl, shape), rows=rows, capacity=capacity, widths=widths, target=target,
        fills=fills, trees=trees,
    )  # fmt: skip
    figs = _compile_all(progs, sl, log, no_msa)
    meta = _meta(cfg, sl, shape, "serve", overrides or {})
    meta.update(
        capacity=capacity, rules="DECODE_RULES", dtype="bfloat16", dense_twin=twin, no_msa=no_msa
    )
    return figs, R.to_json(figs, **meta)
