"""Pretrain the embedded target from scratch and export a HuggingFace directory.

python -m experiments.pretrain_target                      # tiny preset into the cache
python -m experiments.pretrain_target --preset small --out /tmp/small
python -m experiments.pretrain_target --out DIR --resume   # continue an interrupted run
"""

from __future__ import annotations

import argparse
import json
import logging
import time


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=("micro", "tiny", "small"))
    p.add_argument("--out", default=None, help="output dir (default: the embedded-target cache)")
    p.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--data", type=int, default=-1, help="mesh data axis (-1: fill)")
    p.add_argument("--fsdp", type=int, default=1, help="mesh fsdp axis (-1: fill)")
    p.add_argument("--tensor", type=int, default=1, help="mesh tensor axis (-1: fill)")
    p.add_argument(
        "--distributed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force jax.distributed.initialize() on/off (default: detect)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("adaflash_jax").setLevel(logging.INFO)

    from adaflash_jax.cli import one_line_errors

    with one_line_errors():  # e.g. a bad mesh, an --out without --resume, a non-finite stop
        return run(args)


def run(args) -> dict:
    from adaflash_jax.train.mesh import make_mesh, maybe_initialize_distributed

    maybe_initialize_distributed(args.distributed)
    t0 = time.perf_counter()
    mesh = make_mesh(args.data, args.fsdp, args.tensor)
    if args.out is None:
        from adaflash_jax.embedded import default_target_dir

        out = default_target_dir(args.preset, steps=args.steps, mesh=mesh)
        with open(f"{out}/metrics.json") as f:
            metrics = json.load(f)
    else:
        from adaflash_jax.train.presets import get_preset
        from adaflash_jax.train.pretrain import run_pretrain

        out = args.out
        metrics = run_pretrain(
            get_preset(args.preset), out, steps=args.steps, resume=args.resume, mesh=mesh
        )
    summary = {
        k: metrics.get(k) for k in ("preset", "status", "step", "num_params", "tokens_per_s")
    }
    summary["eval_loss"] = {d: round(v["loss"], 4) for d, v in metrics.get("eval", {}).items()}
    summary["uniform_loss_ln_v"] = round(metrics["uniform_loss_ln_v"], 4)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    summary["out"] = out
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
