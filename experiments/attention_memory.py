"""Compiler memory of the drafter's training attention, dense vs block-sparse (no run).

  python -m experiments.attention_memory                       # 8B shapes, v5p:2x2x1, deviceless
  python -m experiments.attention_memory --program context --variants recompute,remat
  python -m experiments.attention_memory --platform cpu --layers 1 --anchors 64

Compiles (never runs) a forward + backward and prints `compiled.memory_analysis()` per chip:
- `drafter`: `Drafter.train_hidden` with a scalar loss on its output, gradients w.r.t. the
  drafter parameters (fp32 masters, bf16 compute, as the trainer holds them); variants
  `dense` (`masks.train_mask` + `attend`) and `sparse` (`train_attention`);
- `context`: the block→context part alone (`prefix_attention`), gradients w.r.t. q/k/v;
  variants `recompute` (custom_vjp) and `remat` (checkpointed scan).
`--platform tpu` compiles for a TPU topology with libtpu and no TPU attached; `cpu` uses the
local CPU backend. Batch is per chip: the global batch is `--batch` × (data · fsdp). Every
figure is a compiler estimate. Exit status 0, or 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

GIB = 2**30


def _devices(platform: str, topology: str):
    import jax

    if platform == "cpu":
        return jax.devices("cpu")
    from jax.experimental import topologies

    # Other processes on this machine may hold libtpu's lock file; a deviceless compile
    # touches no chip, so sharing the library is safe.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kind, _, dims = topology.partition(":")
    bounds = tuple(min(int(d), 2) if i < 2 else 1 for i, d in enumerate(dims.split("x")))
    return topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology,
        chip_config_name="default",
        chips_per_host_bounds=bounds,
        num_slices=1,
    ).devices


def _programs(args, mesh):
    """(variant, chunk) → (jitted function, abstract arguments) for `args.program`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from adaflash_jax.distill.state import abstract_drafter, tree_shardings
    from adaflash_jax.drafter.config import DrafterConfig
    from adaflash_jax.drafter.train_attention import prefix_attention
    from adaflash_jax.model.presets import target_preset
    from adaflash_jax.sharding.rules import TRAIN_RULES

    target = target_preset(args.shape)
    batch = args.batch * mesh.shape["data"] * mesh.shape["fsdp"]
    s, n, k = args.seq, args.anchors, args.block
    bf16 = jnp.bfloat16
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    whole = NamedSharding(mesh, PartitionSpec())

    def arg(shape, dtype, sharding=rows):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    if args.program == "context":
        h, kv, dh = target.num_attention_heads, target.num_key_value_heads, target.head_dim
        inputs = (
            arg((batch, n * k, h, dh), bf16),
            arg((batch, s, kv, dh), bf16),
            arg((batch, s, kv, dh), bf16),
            arg((batch, n * k), jnp.int32),
        )

        def build(variant, chunk):
            def loss(q, ck, cv, limit):
                out, lse = prefix_attention(q, ck, cv, limit, chunk=chunk, remat=variant == "remat")
                return jnp.mean(jnp.square(out.astype(jnp.float32))) + jnp.mean(lse)

            return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), inputs

        return build

    dcfg = DrafterConfig.for_target(
        target, mask_token_id=target.vocab_size - 1, num_layers=args.layers, block_size=k,
        num_features=args.features, length_head=False,
    )  # fmt: skip
    graphdef, abstract = abstract_drafter(dcfg, bf16)
    shardings = tree_shardings(abstract, mesh, TRAIN_RULES)
    params = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings
    )
    inputs = (
        params,
        arg((batch, s, args.features * target.hidden_size), bf16),
        arg((batch, s), jnp.int32),
        arg((batch, n), jnp.int32),
        arg((batch, n), jnp.bool_),
        arg((target.vocab_size, target.hidden_size), bf16, whole),
    )

    def build(variant, chunk):
        def loss(p, feats, tokens, anchors, valid, emb):
            drafter = nnx.merge(graphdef, p)
            hidden = drafter.train_hidden(
                feats, tokens, anchors, valid, emb, attention=variant, attention_chunk=chunk
            )
            return jnp.mean(jnp.square(hidden.astype(jnp.float32)))

        return jax.jit(jax.grad(loss), out_shardings=shardings), inputs

    return build


def _measure(fn, inputs) -> dict:
    import jax

    start = time.perf_counter()
    try:
        compiled = fn.lower(*inputs).compile()
    except jax.errors.JaxRuntimeError as e:  # the compiler refuses a program over HBM
        return {"refused": str(e).splitlines()[0][:300]}
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    return {
        "temp_gib": mem.temp_size_in_bytes / GIB,
        "peak_gib": mem.peak_memory_in_bytes / GIB,
        "args_gib": mem.argument_size_in_bytes / GIB,
        "out_gib": mem.output_size_in_bytes / GIB,
        "tflop": cost.get("flops", float("nan")) / 1e12,
        "compile_s": time.perf_counter() - start,
    }


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
    default_variants = {"drafter": "dense,sparse", "context": "recompute,remat"}
    variants = (args.variants or default_variants[args.program]).split(",")
    allowed = default_variants[args.program].split(",")
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
        mesh_shape = [int(m) for m in args.mesh.split(",")]
    except ValueError:
        p.error("--chunks and --mesh take comma-separated integers")
    if bad := [v for v in variants if v not in allowed]:
        p.error(f"--program {args.program} has variants {allowed}, not {bad}")
    if not re.fullmatch(r"\w+:\d+(x\d+)+", args.topology):
        p.error(f"--topology takes NAME:AxBxC such as v5p:2x2x1, not {args.topology!r}")
    if len(mesh_shape) != 3 or min(chunks) < 1:
        p.error("--mesh takes data,fsdp,tensor and --chunks positive sizes")

    from adaflash_jax.train.mesh import make_mesh

    try:
        mesh = make_mesh(*mesh_shape, devices=_devices(args.platform, args.topology))
    except (ValueError, RuntimeError) as e:  # a bad mesh, or a topology libtpu rejects
        p.error(str(e).splitlines()[0])
    from adaflash_jax.cli import one_line_errors

    with one_line_errors("error", ValueError):  # e.g. an unknown --shape
        build = _programs(args, mesh)
    where = f"{args.topology} (deviceless)" if args.platform == "tpu" else "CPU backend"
    print(
        f"# {args.program}: {where}, mesh {dict(mesh.shape)}, per chip B={args.batch} "
        f"S={args.seq} N={args.anchors} K={args.block}, {args.shape}-wide, "
        f"{args.layers} layer(s); compiler estimates"
    )
    print("| variant | chunk | temporaries GiB | peak GiB | arguments GiB | TFLOP | compile s |")
    print("|---|---|---|---|---|---|---|")
    for variant in variants:
        for chunk in chunks if variant != "dense" else chunks[:1]:
            r = _measure(*build(variant, chunk))
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
