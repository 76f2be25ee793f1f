"""Checkpoint or export → the HF drafter directory a serving stack loads (docs/serving.md).

python -m experiments.export runs/tiny-XXXX       # its adaflash drafter (re-fitted head)
python -m experiments.export runs/tiny-XXXX/ckpt/stage1 --out drafters/stage1 --step 200
python -m experiments.export runs/tiny-XXXX --for vllm         # plain DFlash layout
python -m experiments.export runs/tiny-XXXX/export/adaflash --for tpu-inference --out DIR

--for adaflash (default) and sglang write the AdaFlash layout (length head in
model.safetensors); vllm, tpu-inference and sglang-jax a plain DFlash drafter, and say first
that they leave the length head out. What the chosen stack serves differently from our engine
is printed as `warning:` lines. Each export directory gets a README.md: the stack, the version
checked, its launch command, what it leaves out, the τ of the run's report.json
(adaflash_jax/drafter/serving.py holds these facts; docs/serving.md quotes them).
"""

from __future__ import annotations

import argparse
import sys

from adaflash_jax.cli import one_line_errors

# a method's head re-fit (stage2.head_refit) holds its final drafter, else its stage 2
PREFERRED = tuple(f"{s}_{m}" for m in ("adaflash", "sft", "fkl") for s in ("head_refit", "stage2"))
PREFERRED += ("head_init", "stage1")
STACK_CHOICES = ("adaflash", "sglang", "vllm", "tpu-inference", "sglang-jax")


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
    p.add_argument(
        "path", help="a run directory, <run>/ckpt/<stage> (local or gs://), or an export directory"
    )
    p.add_argument("--out", help="export directory (default <run>/export/<stage>-step<N>[-STACK])")
    p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    p.add_argument("--for", dest="stack", choices=STACK_CHOICES, default="adaflash")
    args = p.parse_args(argv)
    from adaflash_jax.distill.export import (
        checkpoint_step,
        convert_export,
        export_checkpoint,
        is_export_dir,
    )
    from adaflash_jax.model.config import ConfigError

    suffix = "" if args.stack == "adaflash" else f"-{args.stack}"
    with one_line_errors("export failed"):
        if is_export_dir(args.path):
            out = args.out or args.path.rstrip("/") + suffix
            if out.rstrip("/") == args.path.rstrip("/"):
                raise ConfigError(f"--out must differ from the export it converts ({args.path})")
            notes = convert_export(args.path, out, stack=args.stack)
        else:
            ckpt, run_dir = resolve(args.path)
            step = checkpoint_step(ckpt, args.step)
            stage = ckpt.rsplit("/", 1)[1]
            out = args.out or f"{run_dir}/export/{stage}-step{step}{suffix}"
            notes = export_checkpoint(ckpt, out, run_dir=run_dir, step=step, stack=args.stack)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
