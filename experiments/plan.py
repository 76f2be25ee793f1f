"""Per-device memory plan of a distillation run: does it fit, and if not, what to change.

  python -m experiments.plan --config experiments/configs/qwen3_8b_v5p.py --devices 64 --hbm-gib 95
  python -m experiments.plan --target-shape qwen3-32b --devices 32 --chip v6e --batch-size 32
  python -m experiments.plan --config experiments/configs/qwen3_8b_v5p.py --compile v5p-64

The breakdown is a FORMULA estimate (plan/memory_estimate.py). `--compile SLICE` also compiles
the run's stage-2 step and collection engine step for that TPU slice without a TPU
(adaflash_jax.aot; minutes for an 8B model) and decides on the COMPILED peak instead.
Exit status 0 when the plan fits, 1 when it does not, 2 on bad input (adaflash_jax/cli.py).
"""

from __future__ import annotations

import argparse
import sys
import types

from adaflash_jax.aot.chips import CHIP_HBM_GIB
from adaflash_jax.cli import exit_status
from adaflash_jax.distill.config_file import load_config_file
from adaflash_jax.distill.shapes import target_shape
from adaflash_jax.model.presets import target_preset
from adaflash_jax.plan import (
    GIB,
    choose_mesh,
    estimate,
    format_advice,
    format_plan,
    inputs_from_config,
)
from adaflash_jax.plan.advice import slice_table
from adaflash_jax.plan.compiled import compile_request, format_compiled

KNOBS = ("batch_size", "seq_len", "num_anchors", "block_size", "drafter_layers", "num_features",
         "logits_chunk", "collect_slots", "collect_capacity")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="run config file (experiments/configs/<name>.py)")
    p.add_argument("--devices", type=int, help="chips in the slice (required unless --table)")
    p.add_argument("--table", action="store_true", help="markdown mesh table for 8B/32B targets")
    p.add_argument("--hbm-gib", type=float, help="HBM per device in GiB")
    p.add_argument("--chip", choices=sorted(CHIP_HBM_GIB), help="sets --hbm-gib for a TPU chip")
    p.add_argument("--headroom", type=float, default=0.1, help="HBM fraction kept free")
    p.add_argument("--target-shape", help="qwen3-1.7b | qwen3-8b | qwen3-32b")
    p.add_argument("--target-path", help="HF directory whose config.json gives the shape")
    p.add_argument("--mesh", help="data,fsdp,tensor (one may be -1) or 'auto'")
    for knob in KNOBS:
        p.add_argument("--" + knob.replace("_", "-"), type=int)
    p.add_argument("--remat", choices=("none", "full"))
    p.add_argument("--attention", choices=("naive", "fused"))
    p.add_argument("--compile", metavar="SLICE", help="also compile for this slice, e.g. v5p-64")
    return exit_status(plan_and_report, p, p.parse_args(argv))


def plan_and_report(p: argparse.ArgumentParser, args) -> int:
    request = compile_request(args, KNOBS) if args.compile else None  # sets --devices, --chip
    hbm = args.hbm_gib or CHIP_HBM_GIB.get(args.chip)
    if not args.table and (hbm is None or args.devices is None):
        p.error("pass --devices and --hbm-gib (or --chip), or --table")
    defaults = dict(
        target_shape="qwen3-8b", batch_size=args.devices or 1, seq_len=2048, num_anchors=256,
        mesh=(1, -1, 1),
    )  # fmt: skip
    cfg = load_config_file(args.config) if args.config else types.SimpleNamespace(**defaults)
    over = {k: getattr(args, k) for k in (*KNOBS, "remat", "attention") if getattr(args, k)}
    if args.target_shape or args.target_path:
        over["target"] = target_shape(shape=args.target_shape, path=args.target_path)
    if args.table:  # the table sizes mesh and batch per slice itself
        over.update(mesh=(1, 1, 1), batch_size=1, collect_slots=None)
        args.devices = 1
    auto = args.mesh == "auto" or (args.mesh is None and not args.config)
    if args.mesh and not auto and not args.table:
        over["mesh"] = tuple(int(x) for x in args.mesh.split(","))
    inp = inputs_from_config(cfg, devices=args.devices, **over)
    if args.table:
        targets = {n: target_preset(n) for n in ("qwen3-8b", "qwen3-32b")}
        print(slice_table(inp, targets, args.headroom))
        return 0
    if auto:
        plan, _ = choose_mesh(inp, args.devices, hbm * GIB, args.headroom)
        print(f"auto mesh: {plan.inputs.mesh} (data, fsdp, tensor)")
    else:
        plan = estimate(inp)
    print(format_plan(plan, hbm, args.headroom))
    if request is not None:
        phases = request.run()
        print(format_compiled(phases, plan, hbm, args.headroom))
        return 0 if phases.fits(hbm, args.headroom) else 1
    print(format_advice(plan, hbm, args.headroom))
    return 0 if plan.fits(hbm * GIB, args.headroom) else 1


if __name__ == "__main__":
    sys.exit(main())
