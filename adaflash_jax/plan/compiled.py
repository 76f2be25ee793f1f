"""The planner's phases measured by the compiler: a deviceless TPU compile of the run's own
stage-2 step and collection engine step (`adaflash_jax.aot`), per chip.

  train    the compiled stage-2 step: arguments (frozen target, fp32 drafter masters, AdamW
           moments, batch) + outputs not aliased to the donated state + temporaries
           (gradients, activations, logits) + generated code;
  collect  the larger of the compiled engine step at the full block and the engine's prefill
           of all `stage2.collect_slots` slots (target and drafter weights, the engine's
           caches and outputs, temporaries, code) + the AdamW moments, which stay in HBM
           while the run collects.
peak = max(train, collect): the phases alternate and share only what both count.
"""

from __future__ import annotations

import dataclasses
import os

from adaflash_jax.aot import programs as P
from adaflash_jax.aot.abstract import per_chip_bytes
from adaflash_jax.aot.report import Figures, compile_program
from adaflash_jax.aot.topology import Slice, parse_slice, slice_devices
from adaflash_jax.aot.train_programs import train_programs
from adaflash_jax.distill.checks import check_runtime
from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.config_file import load_config
from adaflash_jax.distill.overrides import override
from adaflash_jax.distill.shapes import run_drafter, run_target
from adaflash_jax.model.config import ConfigError
from adaflash_jax.plan.memory_estimate import MemoryPlan

GIB = 1 << 30
# planner flags → the run-config field a compile changes instead
RUN_FIELDS = {
    "batch_size": "batch_size",
    "seq_len": "seq_len",
    "num_anchors": "num_anchors",
    "block_size": "draft.block_size",
    "drafter_layers": "draft.layers",
    "num_features": "draft.num_features",
    "collect_slots": "stage2.collect_slots",
}


@dataclasses.dataclass(frozen=True)
class CompiledPhases:
    slice: Slice
    train: Figures  # the stage-2 step
    collect: tuple[Figures, ...]  # the engine step at W = K, the engine's prefill
    moments_bytes: int  # AdamW moments per chip (in HBM during collection too)

    @property
    def train_bytes(self) -> int:
        return self.train.total_bytes

    @property
    def collect_bytes(self) -> int:
        return max(f.total_bytes for f in self.collect) + self.moments_bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.train_bytes, self.collect_bytes)

    @property
    def refused(self) -> list[str]:
        return [f"{f.program}: {f.error}" for f in (self.train, *self.collect) if not f.compiled]

    def fits(self, hbm_gib: float, headroom: float) -> bool:
        return not self.refused and self.peak_bytes <= hbm_gib * GIB * (1 - headroom)


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """A run config and the slice to compile it for, checked before any compile."""

    cfg: RunConfig
    slice: Slice

    def run(self) -> CompiledPhases:
        return compile_phases(self.cfg, self.slice)


def compile_request(args, knobs) -> CompileRequest:
    """From `experiments.plan`'s arguments: the slice sets --devices (and --chip unless
    --hbm-gib is given); planner knobs become run-config overrides where the run has them."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling needs no device backend
    sl = parse_slice(args.compile)
    if args.devices not in (None, sl.chips):
        raise ConfigError(f"--devices {args.devices} but {sl.name} has {sl.chips} chips")
    if not args.config or args.table:
        raise ConfigError("--compile compiles a run's own programs: pass --config (no --table)")
    sets = {RUN_FIELDS[k]: getattr(args, k) for k in RUN_FIELDS if getattr(args, k)}
    other = [k for k in (*knobs, "remat", "attention", "target_shape", "target_path") if
             k not in RUN_FIELDS and getattr(args, k)]  # fmt: skip
    if other or args.mesh == "auto":
        bad = other or ["mesh auto"]
        raise ConfigError(f"--compile compiles the run's own code; it has no {bad} option")
    if args.mesh:
        sets["mesh"] = f"({args.mesh})"
    args.devices = sl.chips
    args.chip = args.chip or (None if args.hbm_gib else sl.chip.name)
    return CompileRequest(override(load_config(args.config), sets), sl)


def compile_phases(cfg: RunConfig, sl: Slice) -> CompiledPhases:
    from adaflash_jax.train.mesh import make_mesh

    target = run_target(cfg)
    shape = check_runtime(
        cfg,
        num_devices=sl.chips,
        target=target,
        mask_token_id=run_drafter(cfg, target).mask_token_id,
    )
    mesh = make_mesh(*shape, devices=slice_devices(sl))
    (stage2,) = train_programs(cfg, mesh, kinds=("stage2",))
    mine = [p for p in P.run_programs(cfg, mesh, groups=("prefill", "engine")) if
            p.rows == cfg.stage2.collect_slots]  # fmt: skip
    full = max((p for p in mine if p.width), key=lambda p: p.width)
    (prefill,) = [p for p in mine if p.name.startswith("prefill")]
    return CompiledPhases(
        slice=sl,
        train=compile_program(stage2, sl.chip, sl.chips),
        collect=tuple(compile_program(p, sl.chip, sl.chips) for p in (full, prefill)),
        moments_bytes=per_chip_bytes(stage2.args[0].opt_state),
    )


def _pct(compiled: int, formula: int) -> str:
    return f"{(formula - compiled) / compiled:+.0%}" if compiled else "n/a"


def format_compiled(c: CompiledPhases, plan: MemoryPlan, hbm_gib: float, headroom: float) -> str:
    """The compiled phases next to the formula's, and the verdict on the compiled peak."""
    gib = GIB
    p = plan.phase_bytes
    formula = {"train": p("persistent") + p("train"), "collect": p("persistent") + p("collect")}
    lines = [
        f"compiled for {c.slice.topology} (deviceless XLA compile; compiler figures, GiB/chip):",
        f"  train    {c.train.program} step               "
        f"{c.train_bytes / gib:8.2f}   formula {formula['train'] / gib:8.2f} "
        f"({_pct(c.train_bytes, formula['train'])})",
        f"  collect  max({', '.join(f.program for f in c.collect)}) + AdamW moments "
        + (
            f"{c.collect_bytes / gib:8.2f}   formula {formula['collect'] / gib:8.2f} "
            f"({_pct(c.collect_bytes, formula['collect'])})"
            if all(f.compiled for f in c.collect)
            else f"refused   formula {formula['collect'] / gib:8.2f}"
        ),
    ]
    lines += [f"  the compiler refused {r}" for r in c.refused]
    budget = hbm_gib * (1 - headroom)
    verdict = "FITS" if c.fits(hbm_gib, headroom) else "DOES NOT FIT"
    lines.append(
        f"peak (COMPILED; the verdict uses it, not the formula's) = {c.peak_bytes / gib:.2f} "
        f"GiB; budget {budget:.2f} GiB ({hbm_gib:g} GiB HBM, {headroom:.0%} headroom): {verdict}"
    )
    return "\n".join(lines)
