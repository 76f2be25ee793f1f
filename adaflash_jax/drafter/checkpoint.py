"""HF DFlash / AdaFlash drafter directories (DESIGN §6): config.json + model.safetensors.

Tensor names carry no `model.` prefix, PyTorch [out, in] layout, no embedding and no LM
head. The AdaFlash length head lives under `thresh_head_two_model.*`; loaders that do not
know it ignore those keys, so every export also serves as a plain DFlash drafter.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.drafter.config import DrafterConfig, LengthHeadConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file
from adaflash_jax.model.checkpoint import CheckpointError
from adaflash_jax.model.config import ConfigError, RopeScaling

HEAD_PREFIX = "thresh_head_two_model."


def drafter_param_table(drafter: Drafter) -> dict[str, tuple[nnx.Variable, bool]]:
    """Export name → (Variable, stored transposed as [out, in])."""
    t: dict[str, tuple[nnx.Variable, bool]] = {
        "fc.weight": (drafter.fc.kernel, True),
        "hidden_norm.weight": (drafter.hidden_norm.weight, False),
        "norm.weight": (drafter.norm.weight, False),
    }
    for i, layer in enumerate(drafter.layers):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, False)
        t[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, False)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"{p}self_attn.{name}.weight"] = (getattr(layer.self_attn, name).kernel, True)
        t[p + "self_attn.q_norm.weight"] = (layer.self_attn.q_norm.weight, False)
        t[p + "self_attn.k_norm.weight"] = (layer.self_attn.k_norm.weight, False)
        for name in ("gate_proj", "up_proj", "down_proj"):
            t[f"{p}mlp.{name}.weight"] = (getattr(layer.mlp, name).kernel, True)
    if drafter.length_head is not None:
        t.update(length_head_param_table(drafter))
    return t


def length_head_param_table(drafter: Drafter) -> dict[str, tuple[nnx.Variable, bool]]:
    head = drafter.length_head
    t = {}
    for export, dense in (("down", head.down), ("res.0", head.res), ("out", head.out)):
        t[f"{HEAD_PREFIX}{export}.weight"] = (dense.kernel, True)
        t[f"{HEAD_PREFIX}{export}.bias"] = (dense.bias, False)
    return t


def config_to_hf(cfg: DrafterConfig) -> dict:
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.length_head is not None:
        dflash.update(
            use_thresh_head_two_model=True,
            thresh_head_direct_len=True,
            thresh_head_bottleneck_dim=cfg.length_head.bottleneck_dim,
        )
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {"block_size": cfg.block_size, **dflash},
        "num_target_layers": cfg.num_target_layers,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling.to_hf() if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        # Older vLLM reads HF hidden_states indices (output of layer i is index i + 1).
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
    }
    return out


def config_from_hf(raw: dict, *, with_length_head: bool | None = None) -> DrafterConfig:
    dflash = raw.get("dflash_config") or {}
    try:
        block_size = int(raw.get("block_size", dflash.get("block_size")))
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if layer_ids is None:
            raise KeyError("dflash_config.target_layer_ids")
        if mask_token_id is None:
            raise KeyError("dflash_config.mask_token_id")
        n_heads = raw["num_attention_heads"]
        head = with_length_head
        if head is None:
            head = bool(dflash.get("use_thresh_head_two_model", False))
        scaling = raw.get("rope_scaling") or None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ConfigError(f"unsupported drafter rope scaling {scaling}")
        else:
            scaling = None
        theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 1e6))
        return DrafterConfig(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=raw.get("num_key_value_heads", n_heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            vocab_size=raw["vocab_size"],
            block_size=block_size,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=raw.get("num_target_layers", max(layer_ids) + 1),
            mask_token_id=int(mask_token_id),
            length_head=(
                LengthHeadConfig(bottleneck_dim=dflash.get("thresh_head_bottleneck_dim", 256))
                if head
                else None
            ),
        )
    except (KeyError, TypeError) as e:
        raise ConfigError(f"drafter config.json is missing or has a bad field: {e}") from None


def save_drafter(drafter: Drafter, path: str | os.PathLike, *, dtype=jnp.bfloat16) -> None:
    """Writes the export; weights land before config.json so a torn write is never loadable."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, (var, transpose) in drafter_param_table(drafter).items():
        arr = np.asarray(jax.device_get(var.get_value()))
        if not np.all(np.isfinite(arr.astype(np.float32))):
            raise ValueError(f"refusing to export drafter: tensor {name!r} has NaN or Inf values")
        arr = arr.astype(np.dtype(dtype)) if dtype is not None else arr
        tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg = config_to_hf(drafter.config)
    if dtype is not None:
        cfg["torch_dtype"] = np.dtype(dtype).name
    tmp = os.path.join(path, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, os.path.join(path, "config.json"))


def load_drafter(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    with_length_head: bool | None = None,
    seed: int = 0,
) -> Drafter:
    """Loads an export (ours or a published DFlash drafter).

    `with_length_head=True` on a plain DFlash checkpoint initialises a fresh head.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    st_path = os.path.join(path, "model.safetensors")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"drafter directory does not exist: {path}")
    for p in (cfg_path, st_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"drafter directory {path} has no {os.path.basename(p)}")
    with open(cfg_path) as f:
        raw = json.load(f)
    file = SafetensorsFile(st_path)
    has_head = any(k.startswith(HEAD_PREFIX) for k in file.keys())
    config = config_from_hf(
        raw, with_length_head=with_length_head if with_length_head is not None else None
    )
    if with_length_head is None and has_head and config.length_head is None:
        config = config_from_hf(raw, with_length_head=True)
    param_dtype = param_dtype or dtype
    drafter = Drafter(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)
    table = drafter_param_table(drafter)
    fresh_head = config.length_head is not None and not has_head
    required = {k for k in table if not (fresh_head and k.startswith(HEAD_PREFIX))}
    present = set(file.keys())
    if not has_head or config.length_head is None:
        present = {k for k in present if not k.startswith(HEAD_PREFIX)}
    if missing := sorted(required - present):
        raise CheckpointError(f"drafter {path} is missing tensors: {missing[:8]}")
    if unexpected := sorted(present - set(table)):
        raise CheckpointError(f"drafter {path} has unexpected tensors: {unexpected[:8]}")
    for name in sorted(required):
        var, transpose = table[name]
        arr = np.asarray(file.get(name))
        arr = arr.T if transpose else arr
        want = tuple(var.get_value().shape)
        if arr.shape != want:
            got = list(file.shape(name))
            raise CheckpointError(
                f"drafter tensor {name!r} has shape {got}, config.json implies "
                f"{list(want[::-1] if transpose else want)}"
            )
        var_dtype = jnp.float32 if name.startswith(HEAD_PREFIX) else param_dtype
        var.set_value(jnp.asarray(arr.astype(np.dtype(var_dtype))))
    return drafter
