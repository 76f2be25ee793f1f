"""Checkpoint → HF DFlash/AdaFlash drafter export (config.json + model.safetensors).

python -m experiments.export runs/tiny-XXXX                    # its stage2_adaflash ckpt
python -m experiments.export runs/tiny-XXXX/ckpt/stage1 --out drafters/stage1 --step 200
"""

from __future__ import annotations

import argparse
import os
import sys

PREFERRED = ("stage2_adaflash", "stage2_sft", "stage2_fkl", "head_init", "stage1")


def resolve(path: str) -> tuple[str, str]:
    """(checkpoint dir, run dir) from a run directory or a stage checkpoint directory."""
    ckpt_root = os.path.join(path, "ckpt")
    if os.path.isdir(ckpt_root):
        for stage in PREFERRED:
            if os.path.isdir(os.path.join(ckpt_root, stage)):
                return os.path.join(ckpt_root, stage), path
        raise FileNotFoundError(f"{ckpt_root} holds no stage checkpoints")
    return path, os.path.dirname(os.path.dirname(os.path.abspath(path)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("path", help="a run directory or <run>/ckpt/<stage>")
    p.add_argument("--out", help="export directory (default <run>/export/<stage>-step<N>)")
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    args = p.parse_args(argv)
    from adaflash_jax.distill.export import export_checkpoint, latest_step

    try:
        ckpt, run_dir = resolve(args.path)
        step = args.step if args.step is not None else latest_step(ckpt)
        out = args.out or os.path.join(run_dir, "export", f"{os.path.basename(ckpt)}-step{step}")
        export_checkpoint(ckpt, out, run_dir=run_dir, step=step)
    except (FileNotFoundError, ValueError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
