"""A drafter's config.json in the HF DFlash / AdaFlash form (docs/design.md §6.1), both ways.

config.json carries every key a serving stack reads, even where it has a default of its own:
`block_size` at the top level and in `dflash_config`, `mask_token_id` and
`target_layer_ids` in both places too, `num_target_layers`, the layers' attention
(`layer_types`, `use_sliding_window`, `sliding_window`, `max_window_layers`), RoPE in both
forms (`rope_theta` / `rope_scaling`, read by transformers 4; `rope_parameters`, read by
transformers 5), and the weights' dtype both as `dtype` (what transformers ≥ 4.56 reads and
writes) and as `torch_dtype` (what older readers look up).

A published config this drafter cannot reproduce is refused with the key named
(`config_from_hf`): a causal or other-architecture drafter, sliding layers that transformers
would run as full attention, unknown layer kinds.
"""

from __future__ import annotations

import os

from adaflash_jax.drafter.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DrafterConfig,
    LengthHeadConfig,
)
from adaflash_jax.drafter.length_head import ACCEPT_FEATURES
from adaflash_jax.model.config import ConfigError, default_feature_layers, read_rope

ACCEPT_FILE = "adaflash_extra/accept_head.safetensors"  # relative to the export directory
ACCEPT_KEY = "adaflash_accept_head"  # in config.json's dflash_config


def config_to_hf(cfg: DrafterConfig) -> dict:
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.length_head is not None:
        dflash.update(
            use_thresh_head_two_model=True,
            thresh_head_direct_len=True,
            thresh_head_bottleneck_dim=cfg.length_head.bottleneck_dim,
        )
        if cfg.length_head.accept_dim > 0:
            dflash[ACCEPT_KEY] = {
                "file": ACCEPT_FILE,
                "accept_dim": cfg.length_head.accept_dim,
                "positions": cfg.block_size - 1,
                "features": list(ACCEPT_FEATURES),
            }
    n_layers = cfg.num_hidden_layers
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update(cfg.rope_scaling.to_hf(), rope_theta=cfg.rope_theta)
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {"block_size": cfg.block_size, **dflash},
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_target_layers": cfg.num_target_layers,
        "num_hidden_layers": n_layers,
        "layer_types": list(cfg.layer_types),
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": n_layers,  # transformers' rule when layer_types is absent
        "is_causal": False,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling.to_hf() if cfg.rope_scaling else None,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        # Older vLLM reads HF hidden_states indices (output of layer i is index i + 1).
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
    }
    return out


def accept_entry(raw: dict) -> dict | None:
    """config.json's description of the acceptance part, validated; None when absent."""
    entry = (raw.get("dflash_config") or {}).get(ACCEPT_KEY)
    if entry is None:
        return None
    where = f"dflash_config.{ACCEPT_KEY}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be an object, got {entry!r}")
    file, dim = entry.get("file"), entry.get("accept_dim")
    if not isinstance(file, str) or os.path.isabs(file) or ".." in file.split("/"):
        raise ConfigError(f"{where}.file must be a path inside the export, got {file!r}")
    if not isinstance(dim, int) or dim <= 0:
        raise ConfigError(f"{where}.accept_dim must be a positive integer, got {dim!r}")
    if list(entry.get("features", ())) != list(ACCEPT_FEATURES):
        raise ConfigError(
            f"{where}.features {entry.get('features')!r} is not the feature set this loader "
            f"computes ({list(ACCEPT_FEATURES)})"
        )
    block_size = raw.get("block_size", (raw.get("dflash_config") or {}).get("block_size"))
    positions = entry.get("positions")
    if block_size is not None and positions != int(block_size) - 1:
        raise ConfigError(f"{where}.positions {positions!r} != block_size − 1 ({block_size} − 1)")
    return entry


def _refuse_unsupported(raw: dict) -> None:
    """Published drafter configs this drafter would load as something else: one ConfigError
    naming the key."""
    dflash = raw.get("dflash_config") or {}
    archs = raw.get("architectures") or ["DFlashDraftModel"]
    if "DFlashDraftModel" not in archs:
        raise ConfigError(
            f"drafter config.json architectures {archs} is not a DFlash drafter "
            "(DFlashDraftModel); other drafter architectures are not supported"
        )
    if raw.get("is_causal") or dflash.get("causal"):
        key = "is_causal" if raw.get("is_causal") else "dflash_config.causal"
        raise ConfigError(f"drafter config.json sets {key}=true: causal drafters are not supported")
    if dflash.get("use_swa"):  # a window on every layer in another key form
        raise ConfigError(
            "drafter config.json sets dflash_config.use_swa: give the window as layer_types "
            "(sliding_attention) + sliding_window + use_sliding_window=true instead"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"drafter config.json hidden_act {raw['hidden_act']!r} is not 'silu'")
    if raw.get("attention_bias"):
        raise ConfigError("drafter config.json sets attention_bias=true, which is not supported")


def _layer_attention(raw: dict, n_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) as transformers' Qwen3Config resolves them: the window
    counts only with `use_sliding_window`; without `layer_types`, layers from
    `max_window_layers` (default 28) on are sliding."""
    layer_types = raw.get("layer_types")
    if not raw.get("use_sliding_window"):
        if layer_types and SLIDING_ATTENTION in layer_types:
            raise ConfigError(
                "drafter config.json has sliding_attention layer_types but "
                "use_sliding_window=false, so transformers runs them as full attention: set "
                "use_sliding_window=true (or make them full_attention)"
            )
        return tuple(layer_types or (FULL_ATTENTION,) * n_layers), None
    window = raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ConfigError(
            f"drafter config.json sets use_sliding_window=true with sliding_window={window!r}"
        )
    if layer_types is None:
        first = int(raw.get("max_window_layers", 28))
        layer_types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n_layers)]
    return tuple(layer_types), window


def config_from_hf(
    raw: dict, *, with_length_head: bool | None = None, accept_dim: int | None = None
) -> DrafterConfig:
    """`accept_dim` None takes the acceptance width from `dflash_config.adaflash_accept_head`
    (0 when absent); it only applies when the config has a length head."""
    dflash = raw.get("dflash_config") or {}
    _refuse_unsupported(raw)
    try:
        block_size = int(raw.get("block_size", dflash.get("block_size")))
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if layer_ids is None:  # the format's default: one target layer per drafter layer
            if raw.get("num_target_layers") is None:
                raise KeyError("dflash_config.target_layer_ids (or num_target_layers)")
            layer_ids = default_feature_layers(
                int(raw["num_target_layers"]), int(raw["num_hidden_layers"])
            )
        if mask_token_id is None:
            raise KeyError("dflash_config.mask_token_id")
        n_heads = raw["num_attention_heads"]
        head = with_length_head
        if head is None:
            head = bool(dflash.get("use_thresh_head_two_model", False))
        theta, scaling = read_rope(raw, default_theta=1e6)
        if head and accept_dim is None:
            entry = accept_entry(raw)
            accept_dim = entry["accept_dim"] if entry else 0
        if accept_dim and not head:
            raise ConfigError(f"accept_dim={accept_dim} needs the length head")
        layer_types, sliding_window = _layer_attention(raw, int(raw["num_hidden_layers"]))
        return DrafterConfig(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=raw.get("num_key_value_heads", n_heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            vocab_size=raw["vocab_size"],
            block_size=block_size,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=raw.get("num_target_layers", max(layer_ids) + 1),
            mask_token_id=int(mask_token_id),
            length_head=(
                LengthHeadConfig(
                    bottleneck_dim=dflash.get("thresh_head_bottleneck_dim", 256),
                    accept_dim=accept_dim or 0,
                )
                if head
                else None
            ),
            layer_types=layer_types,
            sliding_window=sliding_window,
        )
    except (KeyError, TypeError) as e:
        raise ConfigError(f"drafter config.json is missing or has a bad field: {e}") from None
