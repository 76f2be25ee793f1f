"""Compiler memory of the drafter's training attention, dense vs block-sparse (no run).

  python -m experiments.attention_memory                       # 8B shapes, v5p:2x2x1, deviceless
  python -m experiments.attention_memory --program context --variants recompute,remat
  python -m experiments.attention_memory --platform cpu --layers 1 --anchors 64

Compiles (never runs) a forward + backward and prints `compiled.memory_analysis()` per chip
(the programs: `adaflash_jax/aot/attention_memory.py`). `--platform tpu` compiles for a TPU
topology with libtpu and no TPU attached; `cpu` uses the local CPU backend. Batch is per
chip: the global batch is `--batch` × (data · fsdp). Every figure is a compiler estimate.
Exit status 0, or 2 on bad input (adaflash_jax/cli.py).
"""

from __future__ import annotations

import argparse
import sys

from adaflash_jax.aot.attention_memory import VARIANTS, AttentionShapes, devices, measure
from adaflash_jax.cli import one_line_errors
from adaflash_jax.train.mesh import make_mesh


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--program", choices=("drafter", "context"), default="drafter")
    p.add_argument("--variants", help="drafter: dense,sparse; context: recompute,remat")
    p.add_argument("--chunks", default="512", help="context chunk sizes, comma-separated")
    p.add_argument("--platform", choices=("tpu", "cpu"), default="tpu")
    p.add_argument("--topology", default="v5p:2x2x1", help="TPU topology (deviceless)")
    p.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor (one may be -1)")
    p.add_argument("--shape", default="qwen3-8b", help="target shape the drafter is as wide as")
    p.add_argument("--layers", type=int, default=5, help="drafter layers")
    p.add_argument("--features", type=int, default=5, help="target layers fed to the drafter")
    p.add_argument("--batch", type=int, default=2, help="sequences per chip")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    args = p.parse_args(argv)
    allowed = VARIANTS[args.program]
    variants = args.variants.split(",") if args.variants else list(allowed)
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
        mesh_shape = [int(m) for m in args.mesh.split(",")]
    except ValueError:
        p.error("--chunks and --mesh take comma-separated integers")
    if bad := [v for v in variants if v not in allowed]:
        p.error(f"--program {args.program} has variants {list(allowed)}, not {bad}")
    if len(mesh_shape) != 3 or min(chunks) < 1:
        p.error("--mesh takes data,fsdp,tensor and --chunks positive sizes")
    try:
        mesh = make_mesh(*mesh_shape, devices=devices(args.platform, args.topology))
    except (ValueError, RuntimeError) as e:  # a bad mesh or slice, or one libtpu rejects
        p.error(str(e).splitlines()[0])
    shapes = AttentionShapes(
        program=args.program, shape=args.shape, layers=args.layers, features=args.features,
        batch=args.batch, seq=args.seq, anchors=args.anchors, block=args.block,
    )  # fmt: skip
    where = f"{args.topology} (deviceless)" if args.platform == "tpu" else "CPU backend"
    print(
        f"# {args.program}: {where}, mesh {dict(mesh.shape)}, per chip B={args.batch} "
        f"S={args.seq} N={args.anchors} K={args.block}, {args.shape}-wide, "
        f"{args.layers} layer(s); compiler estimates"
    )
    print("| variant | chunk | temporaries GiB | peak GiB | arguments GiB | TFLOP | compile s |")
    print("|---|---|---|---|---|---|---|")
    with one_line_errors():  # e.g. an unknown --shape
        for variant, chunk, r in measure(shapes, mesh, variants, chunks):
            c = "-" if variant == "dense" else chunk
            if "refused" in r:
                print(f"| {variant} | {c} | refused: {r['refused']} | | | | |")
            else:
                print(
                    f"| {variant} | {c} | {r['temp_gib']:.2f} | {r['peak_gib']:.2f} | "
                    f"{r['args_gib']:.2f} | {r['tflop']:.2f} | {r['compile_s']:.0f} |"
                )
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
