"""What the memory planner reads: a run's shapes, mesh and knobs, from presets or a run config.

A run config (`experiments/configs/<name>.py`) is read duck-typed, so the planner needs no
import of the training code. The fields it looks for (all optional except as noted):

- target: a `TargetConfig`; or `target_shape` (a preset name below); or `target_path` (an HF
  directory with config.json). One of the three is required.
- mesh: `(data, fsdp, tensor)`, a dict or an object with those attributes; one entry may be
  -1 (filled from the device count).
- batch_size (global sequences per train step), seq_len, num_anchors, block_size.
- drafter: a `DrafterConfig` (layers, block size, feature layers, width, length head are
  taken from it), or the flat fields drafter_layers, num_features / target_layer_ids,
  drafter_intermediate_size, length_head_dim, accept_dim (default 64 with a length head).
- remat (bool, or "none"/"full"), attention ("naive" | "fused"; else a run config's
  train_attention, "sparse" read as "fused"), logits_chunk (anchors per loss chunk; else a
  run config's loss_chunk, 0 meaning all), collect_slots, collect_capacity,
  collect_prompt_len, target_rules, compute_dtype ("bfloat16" | "float32": bytes of
  activations, target weights and caches).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

from adaflash_jax.bench.shapes import shape_config
from adaflash_jax.distill.config import load_config_file  # noqa: F401 - the one loader
from adaflash_jax.drafter.config import DEFAULT_ACCEPT_DIM
from adaflash_jax.model.config import ConfigError, TargetConfig
from adaflash_jax.plan.params import MESH_AXES, DrafterShape

# A run config's training attention as the planner models it: the block-sparse path never
# holds the dense [N·K, S + N·K] scores, which is what "fused" leaves out.
_ATTENTION = {"sparse": "fused", "dense": "naive"}


def qwen3_8b() -> TargetConfig:
    return shape_config("qwen3-8b")


# The named shapes live in one table (adaflash_jax.bench.shapes); the planner plans the
# full-size ones.
TARGET_PRESETS = {
    name: functools.partial(shape_config, name)
    for name in ("qwen3-1.7b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-coder-30b-a3b")
}


def target_preset(name: str) -> TargetConfig:
    try:
        return TARGET_PRESETS[name.lower()]()
    except KeyError:
        raise ConfigError(
            f"unknown target shape {name!r}; presets: {sorted(TARGET_PRESETS)}"
        ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanInputs:
    target: TargetConfig
    drafter: DrafterShape
    mesh: tuple[int, int, int]  # (data, fsdp, tensor)
    batch_size: int  # global sequences per train step
    seq_len: int
    num_anchors: int
    block_size: int = 16
    remat: bool = False  # rematerialise each drafter layer in the backward pass
    attention: str = "naive"  # "naive" materialises scores; "fused" (flash-style) does not
    logits_chunk: int | None = None  # anchors whose logits are live at once (None: all)
    collect_slots: int | None = None  # on-policy rows decoded together (default batch_size)
    collect_capacity: int | None = None  # KV capacity per row (default seq_len)
    collect_prompt_len: int | None = None  # prefill length (default capacity // 2)
    target_rules: str = "train"  # which rule table shards the target's weights
    compute_bytes: int = 2  # bf16 activations and target weights

    def __post_init__(self):
        if len(self.mesh) != 3 or any(int(m) <= 0 for m in self.mesh):
            raise ConfigError(
                f"mesh must be three positive sizes (data, fsdp, tensor): {self.mesh}"
            )
        object.__setattr__(self, "mesh", tuple(int(m) for m in self.mesh))
        for name in ("batch_size", "seq_len", "num_anchors"):
            if getattr(self, name) is None:
                raise ConfigError(f"{name} is required (set it in the config or pass it)")
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be at least 2, got {self.block_size}")
        if self.num_anchors > self.seq_len:
            raise ConfigError(f"num_anchors ({self.num_anchors}) exceeds seq_len ({self.seq_len})")
        if self.batch_size % self.batch_shards:
            raise ConfigError(
                f"batch_size {self.batch_size} is not divisible by data*fsdp = "
                f"{self.batch_shards} (mesh {self.mesh})"
            )
        if self.attention not in ("naive", "fused"):
            raise ConfigError(f"attention must be 'naive' or 'fused', got {self.attention!r}")
        if self.target_rules not in ("train", "decode"):
            raise ConfigError(f"target_rules must be 'train' or 'decode': {self.target_rules!r}")
        if self.logits_chunk is not None and not 0 < self.logits_chunk:
            raise ConfigError(f"logits_chunk must be positive, got {self.logits_chunk}")
        if self.capacity < self.prompt_len:
            raise ConfigError(
                f"collect_prompt_len {self.prompt_len} exceeds collect_capacity {self.capacity}"
            )
        if self.drafter.hidden_size != self.target.hidden_size:
            raise ConfigError(
                f"drafter width {self.drafter.hidden_size} != target width "
                f"{self.target.hidden_size}: the drafter reads the target's embeddings"
            )

    @property
    def devices(self) -> int:
        return math.prod(self.mesh)

    @property
    def batch_shards(self) -> int:
        return self.mesh[0] * self.mesh[1]

    @property
    def collect_shards(self) -> int:
        """Shards the collection rows are split into: none. The engine creates its caches and
        buffers unsharded (`decode.state.init_state`), so the compiler keeps every slot
        on every chip: the compiled 8B engine step at 256 slots on v5p-64 holds all 256
        rows' caches on each chip (BENCHMARKS.md, TPU section). Change this with the engine."""
        return 1

    @property
    def slots(self) -> int:
        return self.collect_slots or self.batch_size

    @property
    def capacity(self) -> int:
        return self.collect_capacity or self.seq_len

    @property
    def prompt_len(self) -> int:
        return self.collect_prompt_len or self.capacity // 2

    def replace(self, **kw) -> PlanInputs:
        return dataclasses.replace(self, **kw)


def resolve_mesh(mesh: Any, devices: int | None) -> tuple[int, int, int]:
    """(data, fsdp, tensor) from a tuple/dict/object; a single -1 is filled from `devices`."""
    if isinstance(mesh, Mapping):
        sizes = [mesh.get(a, 1) for a in MESH_AXES]
    elif hasattr(mesh, "data") and hasattr(mesh, "fsdp"):
        sizes = [getattr(mesh, a, 1) for a in MESH_AXES]
    else:
        sizes = list(mesh)
    if len(sizes) != 3:
        raise ConfigError(f"mesh must have 3 axes (data, fsdp, tensor), got {mesh!r}")
    sizes = [int(s) for s in sizes]
    if sizes.count(-1) > 1:
        raise ConfigError(f"at most one mesh axis may be -1: {mesh!r}")
    if -1 in sizes:
        if devices is None:
            raise ConfigError(f"mesh {mesh!r} has a -1 axis: pass the device count")
        rest = math.prod(s for s in sizes if s != -1)
        if devices % rest:
            raise ConfigError(f"{devices} devices do not divide into mesh {mesh!r}")
        sizes[sizes.index(-1)] = devices // rest
    if devices is not None and math.prod(sizes) != devices:
        raise ConfigError(
            f"mesh {tuple(sizes)} uses {math.prod(sizes)} devices, but {devices} were given"
        )
    return tuple(sizes)


def target_from(cfg: Any) -> TargetConfig:
    """The target shape a config names through `target`, `target_shape` or `target_path`."""
    target = getattr(cfg, "target", None)
    if isinstance(target, TargetConfig):
        return target
    if isinstance(target, str):
        return target_preset(target) if target.lower() in TARGET_PRESETS else _from_dir(target)
    if getattr(cfg, "target_shape", None):
        return target_preset(cfg.target_shape)
    if getattr(cfg, "target_path", None):
        return _from_dir(cfg.target_path)
    if getattr(cfg, "embedded_preset", None):
        return _embedded(cfg.embedded_preset)
    raise ConfigError("the config names no target: set target, target_shape or target_path")


def _embedded(preset: str) -> TargetConfig:
    """The architecture of an embedded target (`RunConfig.embedded_preset`) without building
    it: its vocabulary is the preset's BPE size (special tokens included)."""
    from adaflash_jax.train.presets import get_preset

    try:
        p = get_preset(preset)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return p.target_config(p.vocab_size, None)


def _from_dir(path: str) -> TargetConfig:
    if str(path).startswith("gs://"):
        raise ConfigError(
            f"target {path} is on GCS: the planner needs its shape; set target_shape too"
        )
    return TargetConfig.from_pretrained(path)


def inputs_from_config(cfg: Any, *, devices: int | None = None, **overrides) -> PlanInputs:
    """PlanInputs from a run-config object (see module docstring); `overrides` win."""
    get = lambda name, default=None: overrides.get(name, getattr(cfg, name, default))  # noqa: E731
    target = overrides.get("target") or target_from(cfg)
    dcfg = getattr(cfg, "drafter", None)
    if dcfg is not None and hasattr(dcfg, "target_layer_ids"):
        head = getattr(dcfg, "length_head", None)
        drafter = DrafterShape(
            num_layers=dcfg.num_hidden_layers,
            hidden_size=dcfg.hidden_size,
            intermediate_size=dcfg.intermediate_size,
            num_attention_heads=dcfg.num_attention_heads,
            num_key_value_heads=dcfg.num_key_value_heads,
            head_dim=dcfg.head_dim,
            num_features=len(dcfg.target_layer_ids),
            length_head_dim=head.bottleneck_dim if head is not None else 0,
            accept_dim=head.accept_dim if head is not None else 0,
            block_size=dcfg.block_size,
        )
        block_default = dcfg.block_size
    else:
        layer_ids = get("target_layer_ids")
        drafter = DrafterShape.like_target(
            target,
            num_layers=get("drafter_layers", 5),
            num_features=len(layer_ids) if layer_ids else get("num_features", 5),
            intermediate_size=get("drafter_intermediate_size"),
            length_head_dim=get("length_head_dim", 256),
            accept_dim=get("accept_dim", DEFAULT_ACCEPT_DIM if get("length_head_dim", 256) else 0),
            block_size=get("block_size", 16),
        )
        block_default = 16
    if "drafter_layers" in overrides:
        drafter = dataclasses.replace(drafter, num_layers=overrides["drafter_layers"])
    if "block_size" in overrides:
        drafter = dataclasses.replace(drafter, block_size=overrides["block_size"])
    remat = get("remat", False)
    if isinstance(remat, str):
        remat = remat.lower() not in ("", "none", "off", "false")
    mesh = overrides.get("mesh") or getattr(cfg, "mesh", None)
    if mesh is None:
        raise ConfigError("the config has no mesh; pass one as (data, fsdp, tensor)")
    return PlanInputs(
        target=target,
        drafter=drafter,
        mesh=resolve_mesh(mesh, devices),
        batch_size=get("batch_size"),
        seq_len=get("seq_len"),
        num_anchors=get("num_anchors"),
        block_size=get("block_size", block_default),
        remat=bool(remat),
        attention=get("attention", _ATTENTION.get(get("train_attention"), "naive")),
        logits_chunk=get("logits_chunk", get("loss_chunk") or None),
        collect_slots=get("collect_slots"),
        collect_capacity=get("collect_capacity", engine_capacity(cfg)),
        collect_prompt_len=get("collect_prompt_len", _prompt_len(cfg)),
        target_rules=get("target_rules", "train"),
        compute_bytes={"float32": 4, "bfloat16": 2}.get(str(get("compute_dtype", "bfloat16")), 2),
    )


def engine_capacity(cfg: Any) -> int | None:
    """A run config's collection cache (`distill.collect.engine_collect`: longest prompt + new
    tokens + one block, rounded up to 16); None without a `data` section."""
    data, draft = getattr(cfg, "data", None), getattr(cfg, "draft", None)
    if data is None or draft is None:
        return None
    return -(-(data.max_prompt_len + data.max_new_tokens + draft.block_size) // 16) * 16


def _prompt_len(cfg: Any) -> int | None:
    data = getattr(cfg, "data", None)
    return None if data is None else data.max_prompt_len
