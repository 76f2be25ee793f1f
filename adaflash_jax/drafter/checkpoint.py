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

config.json is `drafter/hf_config.py`'s.
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
    DrafterConfig,
)
from adaflash_jax.drafter.hf_config import ACCEPT_FILE, accept_entry, config_from_hf, config_to_hf
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io import fs
from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file
from adaflash_jax.model.checkpoint import CheckpointError, layer_param_table
from adaflash_jax.model.config import read_json_file

HEAD_PREFIX = "thresh_head_two_model."
HEAD_PARTS = ("down", "res.0", "out")  # LengthHead's down, res and out (docs/design.md §4.3)
ACCEPT_PREFIX = "accept_head."


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
    entry = accept_entry(raw) if head else None
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


PROMPT_FORMAT_KEY = "adaflash_prompt_format"  # config.json: {"chat_template", "enable_thinking"}


def recorded_prompt_format(path: str | os.PathLike) -> dict:
    """How the distillation run behind the export at `path` rendered its prompts: the
    `PROMPT_FORMAT_KEY` entry of its config.json ({"chat_template", "enable_thinking"}, written
    by `distill.export.export_drafter`), or {} where it records none (a published DFlash
    drafter, an export from before the key)."""
    cfg_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(cfg_path):
        return {}
    found = read_json_file(cfg_path).get(PROMPT_FORMAT_KEY)
    return found if isinstance(found, dict) else {}


def thinking_mode(given: bool | None, drafter_dir: str | os.PathLike | None) -> bool:
    """enable_thinking for a chat-templated prompt served with the drafter at `drafter_dir`:
    `given` (--thinking / --no-thinking) when not None, else what the export records (the
    mode it was distilled on, where its acceptance holds), else False."""
    if given is not None:
        return given
    if drafter_dir is None:
        return False
    return bool(recorded_prompt_format(drafter_dir).get("enable_thinking", False))
