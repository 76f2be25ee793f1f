"""Checkpoint → HF DFlash/AdaFlash drafter export (config.json + model.safetensors).

python -m experiments.export runs/tiny-XXXX                    # its stage2_adaflash ckpt
python -m experiments.export runs/tiny-XXXX/ckpt/stage1 --out drafters/stage1 --step 200
"""

from __future__ import annotations

import argparse
import sys

from adaflash_jax.cli import one_line_errors

PREFERRED = ("stage2_adaflash", "stage2_sft", "stage2_fkl", "head_init", "stage1")


def resolve(path: str) -> tuple[str, str]:
    """(checkpoint dir, run dir) from a run directory or a stage checkpoint directory; local
    or gs://."""
    from adaflash_jax.io import fs

    path = fs.absolute(path)
    ckpt_root = fs.join(path, "ckpt")
    if fs.isdir(ckpt_root):
        for stage in PREFERRED:
            if fs.isdir(fs.join(ckpt_root, stage)):
                return fs.join(ckpt_root, stage), path
        raise FileNotFoundError(f"{ckpt_root} holds no stage checkpoints")
    return path, path.rsplit("/", 2)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("path", help="a run directory or <run>/ckpt/<stage> (local or gs://)")
    p.add_argument("--out", help="export directory (default <run>/export/<stage>-step<N>)")
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    args = p.parse_args(argv)
    from adaflash_jax.distill.export import checkpoint_step, export_checkpoint

    with one_line_errors("export failed"):
        ckpt, run_dir = resolve(args.path)
        step = checkpoint_step(ckpt, args.step)
        stage = ckpt.rsplit("/", 1)[1]
        out = args.out or f"{run_dir}/export/{stage}-step{step}"
        export_checkpoint(ckpt, out, run_dir=run_dir, step=step)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
