"""Bare `jnp.dot` programs at one decoding row, compiled for a TPU slice without a TPU: what
XLA's cost analysis makes of a chain of weight reads, with no project code in the program.

  python -m experiments.tpu_matmul_chain --topology v5e-8
  python -m experiments.tpu_matmul_chain --topology v5p-8 --dim 4096 --hidden 12288

Programs, bf16, x [1, 1, D] replicated, weights split over all chips as DECODE_RULES split an
MLP's (gate/up [D, F] by columns, down [F, D] by rows): one dot x @ gate; two chained dots
(x @ gate) @ down; a SwiGLU MLP; `--layers` residual SwiGLU MLPs in a row. Each is compiled
twice (`report.compile_program`, `no_msa`): as XLA compiles it, and with memory-space
assignment off. Every figure is a compiler estimate: bytes accessed per chip and step time,
against the weight bytes per chip and the weight-read floor (weight bytes / HBM bandwidth).
"""

from __future__ import annotations

import argparse
import os
import sys


def programs(mesh, dim: int, hidden: int, chips: int, layers: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from adaflash_jax.aot.program import Program

    bf16 = jnp.bfloat16
    cols, rows = NamedSharding(mesh, P(None, "tensor")), NamedSharding(mesh, P("tensor", None))
    gate = jax.ShapeDtypeStruct((dim, hidden), bf16, sharding=cols)
    up = jax.ShapeDtypeStruct((dim, hidden), bf16, sharding=cols)
    down = jax.ShapeDtypeStruct((hidden, dim), bf16, sharding=rows)
    x = jax.ShapeDtypeStruct((1, 1, dim), bf16, sharding=NamedSharding(mesh, P()))
    matrix = dim * hidden * 2 // chips  # bytes per chip of one weight

    def one(x, g, u, d):
        return jnp.dot(x, g)

    def two(x, g, u, d):
        return jnp.dot(jnp.dot(x, g), d)

    def mlp(x, g, u, d):
        return jnp.dot(jax.nn.silu(jnp.dot(x, g)) * jnp.dot(x, u), d)

    def stack(x, ws):
        for g, u, d in ws:
            x = x + mlp(x, g, u, d)
        return x

    out = []
    for name, fn, n in (("one dot", one, 1), ("two dots", two, 2), ("SwiGLU MLP", mlp, 3)):
        out.append(
            Program(
                name=name,
                kind="decode",
                fn=jax.jit(fn),
                args=(x, gate, up, down),
                weight_bytes=n * matrix,
                rows=1,
            )
        )
    out.append(
        Program(
            name=f"{layers} residual SwiGLU MLPs",
            kind="decode",
            fn=jax.jit(stack),
            args=(x, [(gate, up, down)] * layers),
            weight_bytes=3 * layers * matrix,
            rows=1,
        )
    )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--topology", required=True, help="v5e-8 | v5p-8 | ...")
    p.add_argument("--dim", type=int, default=4096, help="D (Qwen3-8B: 4096)")
    p.add_argument("--hidden", type=int, default=12288, help="F (Qwen3-8B: 12288)")
    p.add_argument("--layers", type=int, default=4, help="MLPs in the last program")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from adaflash_jax.cli import exit_status

    return exit_status(compile_chain, args)


def compile_chain(args) -> int:
    from adaflash_jax.aot.report import LABEL, compile_program
    from adaflash_jax.aot.topology import parse_slice, slice_devices
    from adaflash_jax.train.mesh import make_mesh

    sl = parse_slice(args.topology)
    mesh = make_mesh(1, 1, sl.chips, devices=slice_devices(sl))
    print(f"# D {args.dim}, F {args.hidden}, 1 row, bf16, {sl.name}: {LABEL}")
    print("| program | weights MB/chip | bytes accessed / weights | est. / floor | no MSA: bytes "
          "/ weights | no MSA: est. / floor |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for prog in programs(mesh, args.dim, args.hidden, sl.chips, args.layers):
        f = compile_program(prog, sl.chip, sl.chips, no_msa=True)
        if not f.compiled:
            print(f"| {f.program} | refused: {f.error} | | | | |")
            continue
        w = f.weight_bytes
        print(
            f"| {f.program} | {w / 1e6:.1f} | {f.bytes_accessed / w:.2f} | {f.vs_floor:.2f} | "
            f"{f.no_msa_bytes_accessed / w:.2f} | {f.no_msa_vs_floor or float('nan'):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
