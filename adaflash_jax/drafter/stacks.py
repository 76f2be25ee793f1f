"""The export each serving stack loads, and what each one does differently (docs/serving.md).

Two layouts (docs/design.md §6):
- "adaflash" (also "sglang"): the AdaFlash directory, length head in `model.safetensors`,
  optional acceptance part in `adaflash_extra/`. SGLang skips tensor names it does not know;
  its AdaFlash pull request reads the head.
- "vllm", "tpu-inference", "sglang-jax": a plain DFlash directory, no head tensors and no head
  keys. vLLM's and tpu-inference's loaders map every tensor of the file and fail on the head's
  names (tpu-inference: "thresh_head_two_model.down.bias is not a valid param path").

The warnings name what a stack would serve differently from our engine, as read in each
stack's source at the versions docs/serving.md lists; the wheels the suite runs are pinned here
(tpu-inference `TPU_INFERENCE`, vLLM `VLLM`, SGLang `SGLANG`).
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from adaflash_jax.drafter.checkpoint import save_drafter
from adaflash_jax.drafter.config import SLIDING_ATTENTION, DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.config import ConfigError

# The tpu-inference wheel whose DFlash model and loader tests/test_tpu_inference_export.py runs.
TPU_INFERENCE = "0.32.0"
# The vLLM and SGLang wheels whose DFlash config paths and loaders tests/test_vllm_export.py
# and tests/test_sglang_export.py run on CPU.
VLLM = "0.34.0"
SGLANG = "0.5.23"
# RoPE θ tpu-inference's DFlash model falls back to when the config object has no attribute.
TPU_INFERENCE_THETA = 1_000_000.0
ROPE_PATCH = "docs/patches/tpu_inference_dflash_rope.patch"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingStack:
    name: str
    length_head: bool  # the head's tensors stay in model.safetensors
    rope_from_config: bool  # False: θ and scaling do not come from config.json
    rope_scaling: bool  # applies Llama-3.1 (llama3) frequency scaling from config.json
    sliding_window: bool  # honours sliding_attention layers
    last_layer: str | None  # how it treats target layer L−1 (None: post-norm, as ours)


STACKS = {
    s.name: s
    for s in (
        ServingStack(
            name="adaflash",
            length_head=True,
            rope_from_config=True,
            rope_scaling=True,
            sliding_window=True,
            last_layer=None,
        ),
        ServingStack(
            name="sglang",
            length_head=True,
            rope_from_config=True,
            rope_scaling=True,
            sliding_window=True,  # SGLang pull request 27469 (merged)
            last_layer=None,
        ),
        ServingStack(
            name="vllm",
            length_head=False,
            rope_from_config=True,
            rope_scaling=True,
            sliding_window=True,  # run: VLLM's qwen3_dflash takes layer_types and sliding_window
            last_layer=None,
        ),
        ServingStack(
            name="tpu-inference",
            length_head=False,
            rope_from_config=False,
            rope_scaling=False,
            sliding_window=False,
            last_layer="feeds the un-normed output of that layer",
        ),
        ServingStack(
            name="sglang-jax",
            length_head=False,
            rope_from_config=True,
            rope_scaling=False,
            sliding_window=False,
            last_layer="never captures that layer",
        ),
    )
}


def stack(name: str) -> ServingStack:
    if name not in STACKS:
        raise ConfigError(f"unknown serving stack {name!r}; choose one of {sorted(STACKS)}")
    return STACKS[name]


def last_layer_warning(cfg: DrafterConfig) -> str | None:
    """The warning for drafters reading the target's last layer, whose feature differs
    between stacks; None when `target_layer_ids` does not contain L − 1."""
    last = cfg.num_target_layers - 1
    if last not in cfg.target_layer_ids:
        return None
    others = "; ".join(f"{s.name} {s.last_layer}" for s in STACKS.values() if s.last_layer)
    return (
        f"target_layer_ids {list(cfg.target_layer_ids)} include the target's last layer {last}, "
        f"whose feature here is the final-normed output (HF hidden_states[{last + 1}]); {others}, "
        f"so drafts there differ: prefer layers below {last}"
    )


def stack_warnings(cfg: DrafterConfig, name: str) -> list[str]:
    """What `name` serves differently from our engine for a drafter of config `cfg`."""
    s = stack(name)
    out = []
    if s.last_layer and (w := last_layer_warning(cfg)):
        out.append(w)
    if not s.rope_from_config:
        out.append(
            f"tpu-inference {TPU_INFERENCE} under transformers 5 drafts with RoPE theta "
            f"{TPU_INFERENCE_THETA:g} and llama3 scaling at its default parameters whatever "
            f"config.json says (this drafter: theta {cfg.rope_theta:g}, scaling "
            f"{'llama3' if cfg.rope_scaling else 'none'}): drafts differ from ours, more so on "
            f"long contexts; {ROPE_PATCH} fixes it (docs/serving.md §4)"
        )
    elif cfg.rope_scaling is not None and not s.rope_scaling:
        out.append(
            f"{name} ignores rope_scaling: this drafter's llama3 scaling is not applied there, "
            "so its drafts drift from ours on long contexts"
        )
    if SLIDING_ATTENTION in cfg.layer_types and not s.sliding_window:
        out.append(
            f"{name} runs the sliding_attention layers (window {cfg.sliding_window}) as full "
            "attention: drafts differ from ours once a context is longer than the window"
        )
    return out


def save_for_stack(
    drafter: Drafter, path: str | os.PathLike, name: str, *, dtype=jnp.bfloat16, meta=None
) -> list[str]:
    """Writes the layout `name` loads to `path`; returns the warnings: what that stack serves
    differently from our engine. `meta`: extra top-level config.json keys (loaders ignore
    them)."""
    s = stack(name)
    notes = stack_warnings(drafter.config, name)
    if s.name in ("adaflash", "sglang") and (w := last_layer_warning(drafter.config)):
        notes.append(w)
    save_drafter(drafter, path, dtype=dtype, length_head=s.length_head, meta=meta)
    return notes
