"""HF DFlash / AdaFlash drafter directories (docs/design.md §6): config.json + model.safetensors.

Tensor names carry no `model.` prefix, PyTorch [out, in] layout, no embedding and no LM
head. The AdaFlash length head lives under `thresh_head_two_model.*`; loaders that do not
know it ignore those keys, so every export also serves as a plain DFlash drafter.

The length head's optional per-position acceptance network is an optional part in a
subdirectory, `adaflash_extra/accept_head.safetensors` (float32, `accept_head.*`), so serving
stacks that glob the top-level `*.safetensors` never see it. `dflash_config.adaflash_accept_head`
names the part (file, width, positions, feature order); unknown dflash_config keys are
ignored by serving stacks. Without that key an export is a DFlash(+r) drafter; with the key
but without the file (e.g. re-saved by transformers' `save_pretrained`, which copies the
config but not the extra file) it loads as one too, with a warning: only what reads the
acceptance output (goodput's `head` estimator) refuses it.

config.json carries every key a serving stack reads, even where it has a default of its own
(docs/design.md §6.1): `block_size` at the top level and in `dflash_config`, `mask_token_id`
and `target_layer_ids` in both places too, `num_target_layers`, the layers' attention
(`layer_types`, `use_sliding_window`, `sliding_window`, `max_window_layers`), RoPE in both
forms (`rope_theta` / `rope_scaling`, read by transformers 4; `rope_parameters`, read by
transformers 5), and the weights' dtype both as `dtype` (what transformers ≥ 4.56 reads and
writes) and as `torch_dtype` (what older readers look up).

A published config this drafter cannot reproduce is refused with the key named
(`config_from_hf`): a causal or other-architecture drafter, sliding layers that transformers
would run as full attention, unknown layer kinds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.drafter.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DrafterConfig,
    LengthHeadConfig,
)
from adaflash_jax.drafter.length_head import ACCEPT_FEATURES
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io import fs
from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file
from adaflash_jax.model.checkpoint import CheckpointError, layer_param_table
from adaflash_jax.model.config import (
    ConfigError,
    default_feature_layers,
    read_json_file,
    read_rope,
)

HEAD_PREFIX = "thresh_head_two_model."
HEAD_PARTS = ("down", "res.0", "out")  # LengthHead's down, res and out (docs/design.md §4.3)
ACCEPT_PREFIX = "accept_head."
ACCEPT_FILE = "adaflash_extra/accept_head.safetensors"  # relative to the export directory
ACCEPT_KEY = "adaflash_accept_head"  # in config.json's dflash_config


def drafter_param_table(drafter: Drafter) -> dict[str, tuple[nnx.Variable, bool]]:
    """Export name → (Variable, stored transposed as [out, in])."""
    t: dict[str, tuple[nnx.Variable, bool]] = {
        "fc.weight": (drafter.fc.kernel, True),
        "hidden_norm.weight": (drafter.hidden_norm.weight, False),
        "norm.weight": (drafter.norm.weight, False),
    }
    for i, layer in enumerate(drafter.layers):
        t.update(layer_param_table(layer, f"layers.{i}."))
    if drafter.length_head is not None:
        t.update(length_head_param_table(drafter))
    return t


def length_head_param_table(drafter: Drafter) -> dict[str, tuple[nnx.Variable, bool]]:
    head = drafter.length_head
    t = {}
    for export, dense in zip(HEAD_PARTS, (head.down, head.res, head.out), strict=True):
        t[f"{HEAD_PREFIX}{export}.weight"] = (dense.kernel, True)
        t[f"{HEAD_PREFIX}{export}.bias"] = (dense.bias, False)
    return t


def accept_param_table(drafter: Drafter) -> dict[str, tuple[nnx.Variable, bool]]:
    """The acceptance part's names (its own file) → (Variable, stored as [out, in])."""
    net = drafter.length_head.accept
    return {
        ACCEPT_PREFIX + "in.weight": (net.proj_in.kernel, True),  # [A, D+2]
        ACCEPT_PREFIX + "in.bias": (net.proj_in.bias, False),
        ACCEPT_PREFIX + "out.weight": (net.proj_out.kernel, True),  # [1, A]
        ACCEPT_PREFIX + "out.bias": (net.proj_out.bias, False),
        ACCEPT_PREFIX + "position_bias": (net.position_bias, False),  # [K−1]
    }


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


def _accept_entry(raw: dict) -> dict | None:
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
            entry = _accept_entry(raw)
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


def _host_tensors(table, dtype) -> dict[str, np.ndarray]:
    """Export name → host array in [out, in] layout; refuses NaN/Inf."""
    out = {}
    for name, (var, transpose) in table.items():
        arr = np.asarray(jax.device_get(var.get_value()))
        if not np.all(np.isfinite(arr.astype(np.float32))):
            raise ValueError(f"refusing to export drafter: tensor {name!r} has NaN or Inf values")
        arr = arr.astype(np.dtype(dtype)) if dtype is not None else arr
        out[name] = np.ascontiguousarray(arr.T if transpose else arr)
    return out


def save_drafter(
    drafter: Drafter,
    path: str | os.PathLike,
    *,
    dtype=jnp.bfloat16,
    length_head: bool = True,
    meta: dict | None = None,
) -> None:
    """Writes the export to a local directory or a `gs://` URL; every weight file lands before
    config.json (the completion marker), so a torn write is never loadable. The acceptance
    part, if any, is float32. `length_head=False` writes a plain DFlash drafter: no head
    tensors, no acceptance part, no head keys in config.json (what vLLM's loader needs)."""
    path = fs.absolute(path)
    table = drafter_param_table(drafter)
    head = drafter.length_head if length_head else None
    if head is None:
        table = {k: v for k, v in table.items() if not k.startswith(HEAD_PREFIX)}
    tensors = _host_tensors(table, dtype)
    extra = None
    if head is not None and head.has_accept_output:
        extra = _host_tensors(accept_param_table(drafter), np.float32)
    cfg_file = fs.join(path, "config.json")
    fs.remove(cfg_file)  # overwriting an export: it is incomplete until we finish
    save_file(tensors, fs.join(path, "model.safetensors"))
    part = fs.join(path, ACCEPT_FILE)
    if extra is not None:
        save_file(extra, part)
    else:  # a stale part from an earlier export into this directory
        fs.remove(part)
    config = (
        drafter.config
        if head is not None
        else dataclasses.replace(drafter.config, length_head=None)
    )
    cfg = config_to_hf(config)
    cfg["dtype"] = cfg["torch_dtype"] = tensors["fc.weight"].dtype.name
    fs.write_text(cfg_file, json.dumps({**cfg, **(meta or {})}, indent=2))


@dataclasses.dataclass(frozen=True)
class DrafterExport:
    """An opened export: its resolved config, the main file and the optional acceptance part
    (memory-mapped, nothing read yet). Shared by `load_drafter` and the sharded loader."""

    path: str
    config: DrafterConfig
    main: SafetensorsFile
    accept_part: SafetensorsFile | None  # None: no acceptance network, or a fresh one
    fresh_head: bool  # the reference head is requested but the export has none
    fresh_accept: bool  # the acceptance network is requested but the export has none

    def arrays(self, drafter: Drafter) -> list[tuple[str, nnx.Variable, np.ndarray]]:
        """(name, variable, memory-mapped view in the variable's layout) for every tensor the
        export supplies to `drafter` (built from `self.config`); fresh parts are left out.

        Every file is checked (missing, unexpected, shapes) before anything is returned.
        """
        main_table = drafter_param_table(drafter)
        present = set(self.main.keys())
        if self.config.length_head is None:  # a head nobody asked for is ignored
            present = {k for k in present if not k.startswith(HEAD_PREFIX)}
        required = {k for k in main_table if not (self.fresh_head and k.startswith(HEAD_PREFIX))}
        parts = [(self.main, main_table, required, present)]
        if self.accept_part is not None:
            table = accept_param_table(drafter)
            parts.append((self.accept_part, table, set(table), set(self.accept_part.keys())))
        out = []
        for file, table, required, present in parts:
            if missing := sorted(required - present):
                raise CheckpointError(f"drafter {file.path} is missing tensors: {missing[:8]}")
            if unexpected := sorted(present - set(table)):
                raise CheckpointError(
                    f"drafter {file.path} has unexpected tensors: {unexpected[:8]}"
                )
            for name in sorted(required):
                var, transpose = table[name]
                mm = file.get(name)
                view = mm.T if transpose else mm
                want = tuple(var.get_value().shape)
                if view.shape != want:
                    raise CheckpointError(
                        f"drafter tensor {name!r} in {file.path} has shape {list(mm.shape)}, "
                        f"config.json implies {list(want[::-1] if transpose else want)}"
                    )
                out.append((name, var, view))
        return out


def open_export(
    path: str | os.PathLike,
    *,
    with_length_head: bool | None = None,
    accept_dim: int | None = None,
    fresh_accept_dim: int = 0,
) -> DrafterExport:
    """Opens an export directory (ours or a published DFlash drafter) and resolves its config.

    `with_length_head`: None follows the export; True adds a fresh head when it has none;
    False ignores its head. `accept_dim`: None follows the export (its acceptance part, or a
    fresh `fresh_accept_dim`-wide network when it has none); 0 ignores the part; > 0 asks for
    that width (fresh when the export has no part). The acceptance network needs the head.

    A config that declares the reference head (`use_thresh_head_two_model`) without its
    tensors is refused; a head is only ever fresh for an export that declares none. A part
    the config names but the directory lacks counts as absent, with one warning.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"drafter directory does not exist: {path}")
    cfg_path = os.path.join(path, "config.json")
    st_path = os.path.join(path, "model.safetensors")
    for p in (cfg_path, st_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"drafter directory {path} has no {os.path.basename(p)}")
    raw = read_json_file(cfg_path)
    main = SafetensorsFile(st_path)
    has_head = any(k.startswith(HEAD_PREFIX) for k in main.keys())
    dflash = raw.get("dflash_config") or {}
    declared = bool(dflash.get("use_thresh_head_two_model", False))
    head = with_length_head
    if head is None:
        head = has_head or declared
    if head and declared and not has_head:  # a stripped or torn export: never a random head
        names = [f"{HEAD_PREFIX}{p}.{w}" for p in HEAD_PARTS for w in ("weight", "bias")]
        raise CheckpointError(
            f"drafter {path}: config.json declares a length head "
            f"(dflash_config.use_thresh_head_two_model), but model.safetensors lacks its "
            f"tensors {names}; re-export it, or drop that key to load it as a plain DFlash "
            "drafter"
        )
    entry = _accept_entry(raw) if head else None
    part_gone = entry is not None and not os.path.isfile(os.path.join(path, entry["file"]))
    if part_gone and accept_dim != 0:
        warnings.warn(
            f"drafter {path}: config.json names the optional acceptance-head part "
            f"{entry['file']!r}, which is missing (a transformers save_pretrained copies the "
            "config but not that file); loading without it. Only goodput's 'head' estimator "
            "needs it: re-attach it with `python -m experiments.export RUN --out DIR` from "
            "the run's checkpoint",
            UserWarning,
            stacklevel=2,
        )
        entry = None
    if head and accept_dim is None and entry is None:
        accept_dim = fresh_accept_dim
    config = config_from_hf(raw, with_length_head=head, accept_dim=accept_dim)
    want_accept = config.length_head is not None and config.length_head.accept_dim > 0
    part = None
    if want_accept and entry is not None:
        part = SafetensorsFile(os.path.join(path, entry["file"]))
    return DrafterExport(
        path=path,
        config=config,
        main=main,
        accept_part=part,
        fresh_head=config.length_head is not None and not has_head,
        fresh_accept=want_accept and part is None,
    )


def load_drafter(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    with_length_head: bool | None = None,
    accept_dim: int | None = None,
    seed: int = 0,
) -> Drafter:
    """Loads an export (ours or a published DFlash drafter).

    `with_length_head=True` on a plain DFlash checkpoint initialises a fresh head; a fresh
    acceptance network only comes with an explicit `accept_dim` > 0 (see `open_export`).
    The head's parameters stay float32 whatever `param_dtype` is.
    """
    export = open_export(path, with_length_head=with_length_head, accept_dim=accept_dim)
    param_dtype = param_dtype or dtype
    drafter = Drafter(export.config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)
    for _, var, view in export.arrays(drafter):
        var.set_value(jnp.asarray(np.asarray(view).astype(var.get_value().dtype)))
    return drafter
