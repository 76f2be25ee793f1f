"""What the memory planner reads: a run's shapes, mesh and knobs, from presets or a config.

A `RunConfig` is read as the run reads it: its target, drafter, mesh and slot capacity come
from `distill/shapes.py`. Any other object (the plan CLI's defaults, a test's namespace) is read
by attribute; the fields it may carry (all optional except as noted):

- target: a `TargetConfig`, a preset name or an HF directory; or `target_shape` (a preset
  name); or `target_path` (an HF directory with config.json). One of them is required.
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
import math
from collections.abc import Mapping
from typing import Any

from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.shapes import engine_capacity, run_drafter, run_target, target_shape
from adaflash_jax.drafter.config import DEFAULT_ACCEPT_DIM
from adaflash_jax.model.config import ConfigError, TargetConfig
from adaflash_jax.model.presets import PRESETS as TARGET_PRESETS  # noqa: F401 - re-exported
from adaflash_jax.model.presets import target_preset  # noqa: F401 - re-exported
from adaflash_jax.plan.params import DrafterShape
from adaflash_jax.train.mesh_shape import AXES, fill_mesh

# A run config's training attention as the planner models it: the block-sparse path never
# holds the dense [N·K, S + N·K] scores, which is what "fused" leaves out.
_ATTENTION = {"sparse": "fused", "dense": "naive"}


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
        """Shards the collection rows are split into: the run's batch axes (data · fsdp) when
        they divide the slots (`sharding.rows.RowLayout`), else none (every chip holds all)."""
        return self.batch_shards if self.slots % self.batch_shards == 0 else 1

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
        sizes = [mesh.get(a, 1) for a in AXES]
    elif hasattr(mesh, "data") and hasattr(mesh, "fsdp"):
        sizes = [getattr(mesh, a, 1) for a in AXES]
    else:
        sizes = list(mesh)
    return fill_mesh(sizes, devices)


def target_from(cfg: Any) -> TargetConfig:
    """The target shape a config names: a `RunConfig` as the run reads it; any other object
    through `target`, `target_shape` or `target_path` (see the module docstring)."""
    if isinstance(cfg, RunConfig):
        return run_target(cfg)
    target = getattr(cfg, "target", None)
    if isinstance(target, TargetConfig):
        return target
    if isinstance(target, str):
        if target.lower() in TARGET_PRESETS:
            return target_shape(shape=target)
        return target_shape(path=target)
    return target_shape(
        shape=getattr(cfg, "target_shape", None),
        path=getattr(cfg, "target_path", None),
        embedded=getattr(cfg, "embedded_preset", None),
    )


def _run_knobs(cfg: RunConfig, target: TargetConfig) -> dict[str, Any]:
    """A run config's fields under the planner's flat names; its drafter is the one the run
    trains (`distill.shapes.run_drafter`: heads, MLP width and length head included)."""
    d = cfg.draft
    return dict(
        drafter=run_drafter(cfg, target),
        mesh=cfg.mesh,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        num_anchors=cfg.num_anchors,
        block_size=d.block_size,
        drafter_layers=d.layers,
        target_layer_ids=d.target_layer_ids,
        num_features=len(d.target_layer_ids or ()) or d.num_features,
        train_attention=cfg.train_attention,
        loss_chunk=cfg.loss_chunk,
        collect_slots=cfg.stage2.collect_slots,
        collect_capacity=engine_capacity(cfg),
        collect_prompt_len=cfg.data.max_prompt_len,
        compute_dtype=cfg.compute_dtype,
    )


def _knob(cfg: Any, knobs: dict[str, Any] | None, name: str, default: Any = None) -> Any:
    if knobs is not None:
        return knobs.get(name, default)
    return getattr(cfg, name, default)


def inputs_from_config(cfg: Any, *, devices: int | None = None, **overrides) -> PlanInputs:
    """PlanInputs from a run-config object (see module docstring); `overrides` win."""
    target = overrides.get("target") or target_from(cfg)
    knobs = _run_knobs(cfg, target) if isinstance(cfg, RunConfig) else None
    get = lambda name, default=None: overrides.get(name, _knob(cfg, knobs, name, default))  # noqa: E731
    dcfg = _knob(cfg, knobs, "drafter")
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
    if "num_features" in overrides:
        drafter = dataclasses.replace(drafter, num_features=overrides["num_features"])
    remat = get("remat", False)
    if isinstance(remat, str):
        remat = remat.lower() not in ("", "none", "off", "false")
    mesh = overrides.get("mesh") or _knob(cfg, knobs, "mesh")
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
        collect_capacity=get("collect_capacity"),
        collect_prompt_len=get("collect_prompt_len"),
        target_rules=get("target_rules", "train"),
        compute_bytes={"float32": 4, "bfloat16": 2}.get(str(get("compute_dtype", "bfloat16")), 2),
    )
