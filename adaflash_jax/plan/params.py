"""Parameter inventories of the target and the drafter, computed from their configs alone.

Each model is described as a list of `ParamSpec(name, shape, logical_axes)` that mirrors the
modules in `adaflash_jax.model.target` and `adaflash_jax.drafter.model` one array at a time,
so byte totals are exact (the tests compare them with `jax.eval_shape` of the real modules)
and per-device shard sizes follow the real rule tables in `adaflash_jax.sharding.rules`,
without building a mesh or touching a device.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence

from adaflash_jax.model.config import ConfigError, TargetConfig
from adaflash_jax.sharding.rules import Rules, logical_to_spec
from adaflash_jax.train.mesh_shape import AXES


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterShape:
    """What the planner needs of a drafter: DFlash makes it as wide as its target."""

    num_layers: int = 5
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_features: int = 5
    length_head_dim: int = 256  # 0: no length head
    accept_dim: int = 0  # the head's per-position acceptance network (0: none)
    block_size: int = 16  # sizes the acceptance network's per-position bias (K−1)

    def __post_init__(self):
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_features",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"drafter {name} must be positive, got {getattr(self, name)}")
        if self.length_head_dim < 0:
            raise ConfigError(f"length_head_dim must be >= 0, got {self.length_head_dim}")
        if self.accept_dim < 0 or (self.accept_dim and not self.length_head_dim):
            raise ConfigError(f"accept_dim must be >= 0 and needs a length head: {self.accept_dim}")
        if self.block_size < 2:
            raise ConfigError(f"drafter block_size must be >= 2, got {self.block_size}")

    @classmethod
    def like_target(
        cls,
        target: TargetConfig,
        *,
        num_layers: int = 5,
        num_features: int = 5,
        intermediate_size: int | None = None,
        length_head_dim: int = 256,
        accept_dim: int = 0,
        block_size: int = 16,
    ) -> DrafterShape:
        return cls(
            num_layers=num_layers,
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            num_features=num_features,
            length_head_dim=length_head_dim,
            accept_dim=accept_dim,
            block_size=block_size,
        )


def _decoder_layer(
    prefix: str, d: int, f: int, h: int, kv: int, dh: int, qk_norm: bool
) -> list[ParamSpec]:
    p = [
        ParamSpec(prefix + "input_layernorm", (d,), ("norm",)),
        ParamSpec(prefix + "q_proj", (d, h * dh), ("embed", "q_heads")),
        ParamSpec(prefix + "k_proj", (d, kv * dh), ("embed", "kv_heads")),
        ParamSpec(prefix + "v_proj", (d, kv * dh), ("embed", "kv_heads")),
        ParamSpec(prefix + "o_proj", (h * dh, d), ("q_heads", "embed")),
        ParamSpec(prefix + "post_attention_layernorm", (d,), ("norm",)),
        ParamSpec(prefix + "gate_proj", (d, f), ("embed", "mlp")),
        ParamSpec(prefix + "up_proj", (d, f), ("embed", "mlp")),
        ParamSpec(prefix + "down_proj", (f, d), ("mlp", "embed")),
    ]
    if qk_norm:
        p += [
            ParamSpec(prefix + "q_norm", (dh,), ("norm",)),
            ParamSpec(prefix + "k_norm", (dh,), ("norm",)),
        ]
    return p


def target_params(cfg: TargetConfig) -> list[ParamSpec]:
    """Every parameter array of `TargetLM(cfg)`."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [ParamSpec("embed_tokens", (v, d), ("vocab", "embed"))]
    for i in range(cfg.num_hidden_layers):
        out += _target_layer(cfg, i, f"layers.{i}.")
    out.append(ParamSpec("norm", (d,), ("norm",)))
    if not cfg.tie_word_embeddings:
        out.append(ParamSpec("lm_head", (d, v), ("embed", "vocab")))
    return out


def target_layer_params(cfg: TargetConfig) -> list[ParamSpec]:
    """The largest decoder layer (a mixture-of-experts one if the target has any; on a hybrid
    the larger of a Gated DeltaNet and a gated attention layer): what an FSDP forward
    gathers at a time."""
    layers = [_target_layer(cfg, i, "") for i in range(cfg.num_hidden_layers)]
    return max(layers, key=lambda p: sum(s.size for s in p))


def _target_layer(cfg: TargetConfig, layer: int, prefix: str) -> list[ParamSpec]:
    """Target layer `layer`: a Qwen3/Llama layer, its MLP swapped for the router and the
    stacked experts (`model/moe.py`, plus a shared expert on Qwen3.5-MoE) when the layer is
    sparse, its attention for a Gated DeltaNet on a hybrid's linear layers, and a gated q_proj
    (2·H·Dh wide) on a hybrid's full attention ones."""
    d, moe = cfg.hidden_size, cfg.is_moe_layer(layer)
    p = _decoder_layer(
        prefix,
        d,
        0 if moe else cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.qk_norm,
    )
    if cfg.is_linear_layer(layer):
        p = [s for s in p if s.name.endswith(_MLP_AND_NORMS)] + _gated_deltanet(cfg, prefix)
    elif cfg.is_hybrid:
        q = ParamSpec(
            prefix + "q_proj", (d, 2 * cfg.num_attention_heads * cfg.head_dim), ("embed", "q_heads")
        )
        p = [q if s.name == q.name else s for s in p]
    if not moe:
        return p
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    p = [s for s in p if not s.name.endswith(("gate_proj", "up_proj", "down_proj"))]
    p += [
        ParamSpec(prefix + "gate", (d, e), ("embed", None)),
        ParamSpec(prefix + "experts.gate_proj", (e, d, f), ("expert", "embed", "expert_mlp")),
        ParamSpec(prefix + "experts.up_proj", (e, d, f), ("expert", "embed", "expert_mlp")),
        ParamSpec(prefix + "experts.down_proj", (e, f, d), ("expert", "expert_mlp", "embed")),
    ]
    if fs := cfg.shared_expert_intermediate_size:
        p += [
            ParamSpec(prefix + "shared.gate_proj", (d, fs), ("embed", "mlp")),
            ParamSpec(prefix + "shared.up_proj", (d, fs), ("embed", "mlp")),
            ParamSpec(prefix + "shared.down_proj", (fs, d), ("mlp", "embed")),
            ParamSpec(prefix + "shared_expert_gate", (d, 1), ("embed", None)),
        ]
    return p


_MLP_AND_NORMS = ("layernorm", "gate_proj", "up_proj", "down_proj")


def _gated_deltanet(cfg: TargetConfig, prefix: str) -> list[ParamSpec]:
    """A Gated DeltaNet's arrays (`model/gated_deltanet.py`)."""
    d, j, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    x = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + j * dv
    return [
        ParamSpec(prefix + "in_proj_qkv", (d, x), ("embed", "linear_qkv")),
        ParamSpec(prefix + "in_proj_z", (d, j * dv), ("embed", "linear_v")),
        ParamSpec(prefix + "in_proj_b", (d, j), ("embed", "linear_heads")),
        ParamSpec(prefix + "in_proj_a", (d, j), ("embed", "linear_heads")),
        ParamSpec(
            prefix + "conv1d", (x, 1, cfg.linear_conv_kernel_dim), ("linear_qkv", None, None)
        ),
        ParamSpec(prefix + "A_log", (j,), ("linear_heads",)),
        ParamSpec(prefix + "dt_bias", (j,), ("linear_heads",)),
        ParamSpec(prefix + "linear_norm", (dv,), ("norm",)),
        ParamSpec(prefix + "out_proj", (j * dv, d), ("linear_v", "embed")),
    ]


def drafter_params(shape: DrafterShape) -> list[ParamSpec]:
    """Every parameter array of `Drafter(cfg)` (fc, norms, Qwen3 layers, length head and its
    acceptance network)."""
    d = shape.hidden_size
    out = [
        ParamSpec("fc", (shape.num_features * d, d), ("features", "embed")),
        ParamSpec("hidden_norm", (d,), ("norm",)),
    ]
    for i in range(shape.num_layers):
        out += _decoder_layer(
            f"layers.{i}.",
            d,
            shape.intermediate_size,
            shape.num_attention_heads,
            shape.num_key_value_heads,
            shape.head_dim,
            True,
        )
    out.append(ParamSpec("norm", (d,), ("norm",)))
    r = shape.length_head_dim
    if r:
        out += [
            ParamSpec("length_head.down.kernel", (2 * d, r), ("head_in", "head_hidden")),
            ParamSpec("length_head.down.bias", (r,), ("head_hidden",)),
            ParamSpec("length_head.res.kernel", (r, r), ("head_hidden", "head_hidden")),
            ParamSpec("length_head.res.bias", (r,), ("head_hidden",)),
            ParamSpec("length_head.out.kernel", (r, 1), ("head_hidden", None)),
            ParamSpec("length_head.out.bias", (1,), (None,)),
        ]
    a = shape.accept_dim
    if r and a:
        out += [
            ParamSpec(
                "length_head.accept.proj_in.kernel", (d + 2, a), ("accept_in", "accept_hidden")
            ),
            ParamSpec("length_head.accept.proj_in.bias", (a,), ("accept_hidden",)),
            ParamSpec("length_head.accept.proj_out.kernel", (a, 1), ("accept_hidden", None)),
            ParamSpec("length_head.accept.proj_out.bias", (1,), (None,)),
            ParamSpec("length_head.accept.position_bias", (shape.block_size - 1,), ("accept_pos",)),
        ]
    return out


def mesh_like(mesh: Sequence[int] | Mapping[str, int]):
    """A stand-in with the `.shape` mapping `logical_to_spec` reads; no devices involved."""
    shape = dict(mesh) if isinstance(mesh, Mapping) else dict(zip(AXES, mesh, strict=True))
    return types.SimpleNamespace(shape=shape)


def shard_size(spec: ParamSpec, mesh: Sequence[int] | Mapping[str, int], rules: Rules) -> int:
    """Elements of `spec` held by one device under `rules` (mappings that do not divide a
    dimension are dropped, exactly as in `logical_to_spec`)."""
    fake = mesh_like(mesh)
    pspec = logical_to_spec(spec.logical_axes, spec.shape, fake, rules)
    n = 1
    for dim, axes in zip(spec.shape, pspec, strict=True):
        names = () if axes is None else ((axes,) if isinstance(axes, str) else axes)
        n *= dim // math.prod(fake.shape[a] for a in names)
    return n


def total_bytes(specs: Sequence[ParamSpec], bytes_per_elem: int) -> int:
    return sum(s.size for s in specs) * bytes_per_elem


def per_device_bytes(specs: Sequence[ParamSpec], bytes_per_elem: int, mesh, rules: Rules) -> int:
    return sum(shard_size(s, mesh, rules) for s in specs) * bytes_per_elem
