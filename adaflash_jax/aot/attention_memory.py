"""Compiler memory of the drafter's training attention, dense against block-sparse (no run).

Compiles (never runs) a forward + backward and reads `compiled.memory_analysis()` per chip:
- "drafter": `Drafter.train_hidden` with a scalar loss on its output, gradients w.r.t. the
  drafter parameters (fp32 masters sharded as the trainer holds them, bf16 compute);
  variants "dense" (`masks.train_mask` + `attend`) and "sparse" (`train_attention`);
- "context": the block→context part alone (`prefix_attention`), gradients w.r.t. q/k/v;
  variants "recompute" (custom_vjp) and "remat" (checkpointed scan).
The TPU devices are aot's abstract ones (`aot/topology.py`). Every figure is a compiler
estimate; `python -m experiments.attention_memory` prints them as a table.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from adaflash_jax.aot.chips import GIB
from adaflash_jax.aot.topology import parse_slice, slice_devices
from adaflash_jax.distill.state import abstract_drafter, tree_shardings
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.train_attention import prefix_attention
from adaflash_jax.model.presets import target_preset
from adaflash_jax.sharding.rules import TRAIN_RULES

VARIANTS = {"drafter": ("dense", "sparse"), "context": ("recompute", "remat")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionShapes:
    program: str = "drafter"  # a key of VARIANTS
    shape: str = "qwen3-8b"  # the target preset the drafter is as wide as
    layers: int = 5  # drafter layers
    features: int = 5  # target layers fed to the drafter
    batch: int = 2  # sequences per chip (global: × data · fsdp)
    seq: int = 2048
    anchors: int = 512
    block: int = 16

    def __post_init__(self):
        if self.program not in VARIANTS:
            raise ValueError(f"program must be one of {sorted(VARIANTS)}: {self.program!r}")


def devices(platform: str, topology: str) -> tuple:
    """The local CPU devices, or a TPU topology's abstract devices (no TPU attached)."""
    if platform == "cpu":
        return tuple(jax.devices("cpu"))
    return slice_devices(parse_slice(topology))


def _arg(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _context_loss(q, ck, cv, limit, *, chunk: int, remat: bool):
    out, lse = prefix_attention(q, ck, cv, limit, chunk=chunk, remat=remat)
    return jnp.mean(jnp.square(out.astype(jnp.float32))) + jnp.mean(lse)


def _drafter_loss(p, feats, tokens, anchors, valid, emb, *, graphdef, variant, chunk):
    drafter = nnx.merge(graphdef, p)
    hidden = drafter.train_hidden(
        feats, tokens, anchors, valid, emb, attention=variant, attention_chunk=chunk
    )
    return jnp.mean(jnp.square(hidden.astype(jnp.float32)))


def program(s: AttentionShapes, mesh: Mesh, variant: str, chunk: int) -> tuple:
    """(jitted gradient function, its abstract sharded arguments) of one variant."""
    if variant not in VARIANTS[s.program]:
        raise ValueError(f"program {s.program} has variants {VARIANTS[s.program]}: {variant!r}")
    target = target_preset(s.shape)
    batch = s.batch * mesh.shape["data"] * mesh.shape["fsdp"]
    n_k = s.anchors * s.block
    bf16 = jnp.bfloat16
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    if s.program == "context":
        h, kv, dh = target.num_attention_heads, target.num_key_value_heads, target.head_dim
        inputs = (
            _arg((batch, n_k, h, dh), bf16, rows),
            _arg((batch, s.seq, kv, dh), bf16, rows),
            _arg((batch, s.seq, kv, dh), bf16, rows),
            _arg((batch, n_k), jnp.int32, rows),
        )
        loss = functools.partial(_context_loss, chunk=chunk, remat=variant == "remat")
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), inputs
    dcfg = DrafterConfig.for_target(
        target, mask_token_id=target.vocab_size - 1, num_layers=s.layers, block_size=s.block,
        num_features=s.features, length_head=False,
    )  # fmt: skip
    graphdef, abstract = abstract_drafter(dcfg, bf16)
    shardings = tree_shardings(abstract, mesh, TRAIN_RULES)
    params = jax.tree.map(lambda a, sh: _arg(a.shape, a.dtype, sh), abstract, shardings)
    inputs = (
        params,
        _arg((batch, s.seq, s.features * target.hidden_size), bf16, rows),
        _arg((batch, s.seq), jnp.int32, rows),
        _arg((batch, s.anchors), jnp.int32, rows),
        _arg((batch, s.anchors), jnp.bool_, rows),
        _arg((target.vocab_size, target.hidden_size), bf16, NamedSharding(mesh, PartitionSpec())),
    )
    loss = functools.partial(_drafter_loss, graphdef=graphdef, variant=variant, chunk=chunk)
    return jax.jit(jax.grad(loss), out_shardings=shardings), inputs


def compile_memory(fn, inputs) -> dict:
    """Per-chip GiB of temporaries, peak, arguments and outputs, the counted TFLOP and the
    compile seconds; {"refused": message} when the compiler refuses the program."""
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


def measure(s: AttentionShapes, mesh: Mesh, variants, chunks):
    """(variant, chunk, figures) of every variant at every chunk (dense: the first only)."""
    for variant in variants:
        for chunk in chunks if variant != "dense" else chunks[:1]:
            yield variant, chunk, compile_memory(*program(s, mesh, variant, chunk))
