"""Builds an untrained drafter (with its length head) for a target checkpoint directory."""

from __future__ import annotations

import itertools
import json
import os

from flax import nnx

from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.config import ConfigError, TargetConfig

MASK_TOKEN_NAMES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")
# Added special tokens whose names say they are placeholders (Llama 3's
# <|reserved_special_token_N|>, Gemma's <unusedN>, T5's <extra_id_N>).
UNUSED_TOKEN_HINTS = ("reserved", "unused", "extra_id")
NUM_CANDIDATES = 4


def find_mask_token_id(target_dir: str | os.PathLike) -> int | None:
    """The target tokenizer's reserved mask token, if it declares one."""
    tok_path = os.path.join(os.fspath(target_dir), "tokenizer.json")
    if not os.path.isfile(tok_path):
        return None
    cfg_path = os.path.join(os.fspath(target_dir), "tokenizer_config.json")
    names = list(MASK_TOKEN_NAMES)
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            declared = json.load(f).get("mask_token")
        if isinstance(declared, dict):
            declared = declared.get("content")
        if declared:
            names.insert(0, declared)
    with open(tok_path) as f:
        added = json.load(f).get("added_tokens", [])
    by_name = {t["content"]: t["id"] for t in added}
    for name in names:
        if name in by_name:
            return int(by_name[name])
    return None


def mask_token_candidates(target_dir: str | os.PathLike, vocab_size: int) -> str:
    """A few ids that could serve as the mask token, described for an error message: rows
    of the embedding table past every tokenizer id (DFlash's choice), else placeholder
    special tokens, else the table's last rows."""
    tok_path = os.path.join(os.fspath(target_dir), "tokenizer.json")
    if not os.path.isfile(tok_path):
        return "one of the last rows, e.g. " + _ids(range(vocab_size - 1, -1, -1))
    with open(tok_path) as f:
        tok = json.load(f)
    added = tok.get("added_tokens", [])
    vocab = (tok.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    used = max([*ids, *(t["id"] for t in added)], default=-1) + 1
    if used < vocab_size:
        return f"a spare row ({used}..{vocab_size - 1}), e.g. " + _ids(range(used, vocab_size))
    unused = [
        f"{t['id']} {t['content']!r}"
        for t in added
        if t.get("special") and any(h in t["content"].lower() for h in UNUSED_TOKEN_HINTS)
    ]
    if unused:
        return "an unused special token, e.g. " + ", ".join(unused[:NUM_CANDIDATES])
    return "one of the last rows, e.g. " + _ids(range(vocab_size - 1, -1, -1))


def _ids(ids) -> str:
    return ", ".join(str(i) for i in itertools.islice(ids, NUM_CANDIDATES))


def drafter_for_target(
    target_dir: str | os.PathLike,
    *,
    num_layers: int = 5,
    block_size: int = 16,
    num_features: int = 5,
    target_layer_ids: tuple[int, ...] | None = None,
    mask_token_id: int | None = None,
    length_head: bool = True,
    layer_types: tuple[str, ...] | None = None,
    sliding_window: int | None = None,
    seed: int = 0,
) -> Drafter:
    target = TargetConfig.from_pretrained(target_dir)
    if mask_token_id is None:
        mask_token_id = find_mask_token_id(target_dir)
    if mask_token_id is None:
        raise ConfigError(
            f"the tokenizer in {target_dir} declares no mask token: pass --mask-token-id ID "
            f"with {mask_token_candidates(target_dir, target.vocab_size)}"
        )
    cfg = DrafterConfig.for_target(
        target,
        mask_token_id=mask_token_id,
        num_layers=num_layers,
        block_size=block_size,
        num_features=num_features,
        target_layer_ids=target_layer_ids,
        length_head=length_head,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    cfg.validate_against(target)
    return Drafter(cfg, rngs=nnx.Rngs(seed))
