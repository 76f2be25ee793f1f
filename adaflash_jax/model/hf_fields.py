"""The fields of a HuggingFace `config.json` as `TargetConfig` takes them (`model/config.py`):
the supported model types, RoPE in both its forms (llama3 and YaRN scaling), a MoE's experts,
a hybrid's layer kinds and gpt-oss's fields (sliding layers, biases, sinks, MXFP4 experts),
with transformers' defaults where a file omits one and a `ConfigError` naming what cannot be
honoured. Nothing here knows `TargetConfig`: it builds on this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

SUPPORTED_MODEL_TYPES = (
    "qwen3",
    "qwen3_moe",
    "llama",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "gpt_oss",
)
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
MULTIMODAL_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# the layer kinds (`layer_types`) each family may list
FAMILY_LAYER_TYPES = {
    "qwen3_5_text": ("full_attention", "linear_attention"),
    "qwen3_5_moe_text": ("full_attention", "linear_attention"),
    "gpt_oss": ("full_attention", "sliding_attention"),
}
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
REFUSED = {
    "qwen3_next": "its Gated DeltaNet stores q/k/v/z and b/a interleaved per key-head group "
    "(in_proj_qkvz, in_proj_ba), a weight layout this project does not read yet; "
    "Qwen3.5 / Qwen3.6 checkpoints (qwen3_5, qwen3_5_moe) are supported"
}


class ConfigError(ValueError):
    """A config.json that this project cannot build a model from."""


def read_json_file(path: str) -> Any:
    """A config.json's content; bytes that are not UTF-8 JSON are a `ConfigError` naming
    the file and the place."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3.1 style ("llama3") frequency scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN frequency scaling (gpt-oss): wavelengths longer than the original context's
    `beta_slow` rotations are interpolated by `factor`, shorter than `beta_fast` rotations
    kept, a linear ramp between (its ends rounded outwards when `truncate`); cos and sin are
    scaled by `attention_factor` (`model/rope.py`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "yarn", **dataclasses.asdict(self)}


def experts_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """A qwen3_moe config.json's expert fields (transformers >= 5 writes `num_local_experts`;
    the published checkpoints say `num_experts`). The router's aux loss is training-only.
    qwen3_5_moe_text: every layer routes, always renormalised over the k, plus a shared expert."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None or "num_experts_per_tok" not in cfg or "moe_intermediate_size" not in cfg:
        raise ConfigError(
            f"a {cfg['model_type']} config.json needs num_experts, num_experts_per_tok and "
            "moe_intermediate_size"
        )
    if cfg["model_type"] == "qwen3_5_moe_text":
        if "shared_expert_intermediate_size" not in cfg:
            raise ConfigError(
                "a qwen3_5_moe_text config.json needs shared_expert_intermediate_size"
            )
        return dict(
            num_experts=int(experts),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=True,
            shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
        )
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
    )


def hybrid_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3.5 text config's layer kinds (`layer_types`, else every
    `full_attention_interval`-th layer is full attention), partial RoPE and Gated DeltaNet
    shapes; transformers' defaults where the file omits one."""
    n = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        every = int(cfg.get("full_attention_interval", 4))
        layer_types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
        ]
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return dict(
        layer_types=tuple(layer_types),
        partial_rotary_factor=float(factor),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
    )


def default_feature_layers(n_layers: int, num_features: int) -> tuple[int, ...]:
    """docs/design.md §2's default feature layers of an `n_layers`-layer target: `n == 1 → [L//2]`,
    else `round(1 + j·(L−4)/(n−1))`, clipped to the target's layers."""
    if num_features <= 0:
        raise ConfigError(f"num_features must be positive, got {num_features}")
    if num_features == 1:
        return (n_layers // 2,)
    span = n_layers - 4
    ids = tuple(int(round(1 + j * span / (num_features - 1))) for j in range(num_features))
    return tuple(min(max(i, 0), n_layers - 1) for i in ids)


def read_rope(
    cfg: dict[str, Any], default_theta: float, *, allow_mrope: bool = False
) -> tuple[float, RopeScaling | YarnScaling | None]:
    """RoPE theta and scaling of a HF config.json (a target's or a drafter's), from the old
    top-level form (`rope_theta`, `rope_scaling`) or the newer `rope_parameters` form.
    `allow_mrope` (Qwen3.5): multimodal RoPE (`mrope_section`, `mrope_interleaved`) gives
    text tokens the same position on its three axes, so on text it IS 1-D RoPE and is read
    as such; image/video positions are out of scope."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", scaling.get("rope_theta")))
    theta = float(theta if theta is not None else default_theta)
    spec = scaling if scaling else params
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if allow_mrope and rope_type == "mrope":
        rope_type = "default"
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "yarn":
        return theta, read_yarn(spec, cfg)
    if rope_type != "llama3":
        raise ConfigError(f"unsupported rope scaling type {rope_type!r}; supported: llama3, yarn")
    try:
        return theta, RopeScaling(
            factor=float(spec["factor"]),
            low_freq_factor=float(spec["low_freq_factor"]),
            high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"llama3 rope scaling is missing field {e}") from None


YARN_FIELDS = (
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
)


def read_yarn(spec: dict[str, Any], cfg: dict[str, Any]) -> YarnScaling:
    """A YaRN spec as transformers' `_compute_yarn_parameters` reads it: `factor` defaults to
    max_position_embeddings / original_max_position_embeddings, beta_fast 32, beta_slow 1,
    `truncate` true; the attention factor is `attention_factor`, else 0.1·ln(factor) + 1
    (1 for factor <= 1), with `mscale` / `mscale_all_dim` their ratio of that form."""
    if unknown := sorted(set(spec) - set(YARN_FIELDS) - {"partial_rotary_factor"}):
        raise ConfigError(f"yarn rope scaling has fields this project does not honour: {unknown}")
    if spec.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("yarn rope scaling with partial_rotary_factor != 1 is not supported")
    if "original_max_position_embeddings" not in spec:
        raise ConfigError("yarn rope scaling is missing field 'original_max_position_embeddings'")
    original = int(spec["original_max_position_embeddings"])
    factor = spec.get("factor")
    if factor is None:
        if "max_position_embeddings" not in cfg:
            raise ConfigError("yarn rope scaling without factor needs max_position_embeddings")
        factor = cfg["max_position_embeddings"] / original
    factor = float(factor)
    attention = spec.get("attention_factor")
    if attention is None:
        mscale, mscale_all = spec.get("mscale"), spec.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention = yarn_mscale(factor)
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(spec.get("beta_fast") or 32.0),
        beta_slow=float(spec.get("beta_slow") or 1.0),
        truncate=bool(spec.get("truncate", True)),
        attention_factor=float(attention),
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1·mscale·ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def gpt_oss_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """A gpt-oss config.json's own fields: every layer a mixture of `num_local_experts`
    experts of width `intermediate_size` (top-k of the biased router logits, softmax over the
    k, the clamped SwiGLU with `swiglu_alpha` / `swiglu_limit`), `layer_types` alternating
    sliding (`sliding_window`) and full attention (transformers' default: even layers slide),
    q/k/v/o biases (`attention_bias`), a sink logit per head; MXFP4 experts
    (`quantization_config.quant_method` "mxfp4") are dequantized at load."""
    n = cfg["num_hidden_layers"]
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts is None or "num_experts_per_tok" not in cfg:
        raise ConfigError("a gpt_oss config.json needs num_local_experts and num_experts_per_tok")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"gpt_oss hidden_act {cfg['hidden_act']!r} is not supported: silu")
    quant = cfg.get("quantization_config")
    if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"gpt_oss quantization_config {method!r} is not supported: mxfp4")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    window = cfg.get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise ConfigError("gpt_oss config.json has sliding_attention layers but no sliding_window")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["intermediate_size"]),
        layer_types=tuple(layer_types),
        sliding_window=int(window) if "sliding_attention" in layer_types else None,
        attention_bias=bool(cfg.get("attention_bias", True)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
