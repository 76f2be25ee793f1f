"""Byte-level BPE tokenizer trained on the corpus, saved in HuggingFace form.

Writes `tokenizer.json` (loadable by `tokenizers` and `PreTrainedTokenizerFast`) and
`tokenizer_config.json` (eos/mask/pad tokens and the chat template), so the output directory
loads with `AutoTokenizer.from_pretrained(dir)` offline. Byte-level means every string
round-trips exactly: there is no unknown token and no normalisation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from adaflash_jax.data.dialogue import CHAT_TEMPLATE, EOS_TOKEN, MASK_TOKEN, SPECIAL_TOKENS

TOKENIZER_FILE = "tokenizer.json"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """A `tokenizers.Tokenizer` with SPECIAL_TOKENS at ids 0..len-1 (EOS is id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size {vocab_size} is below the 256 byte symbols + {len(SPECIAL_TOKENS)} "
            "special tokens a byte-level BPE needs"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Registered before training so role tokens inside dialogue text are never split or merged.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, directory: str | os.PathLike, *, model_max_length: int = 4096) -> None:
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, TOKENIZER_FILE))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": [
            t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, MASK_TOKEN)
        ],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    special_map = {k: config[k] for k in ("eos_token", "pad_token", "mask_token")}
    special_map["additional_special_tokens"] = config["additional_special_tokens"]
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump(special_map, f, indent=2)


def load_tokenizer(directory: str | os.PathLike):
    from tokenizers import Tokenizer

    path = os.path.join(os.fspath(directory), TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}")
    return Tokenizer.from_file(path)


def special_token_ids(tok) -> dict[str, int]:
    """{token string: id} for every reserved token; raises if one is missing."""
    ids = {}
    for t in SPECIAL_TOKENS:
        i = tok.token_to_id(t)
        if i is None:
            raise ValueError(f"tokenizer lacks the special token {t!r}")
        ids[t] = i
    return ids


def write_generation_config(directory: str | os.PathLike, eos_token_id: int) -> None:
    cfg = {"eos_token_id": eos_token_id, "pad_token_id": eos_token_id, "do_sample": False}
    with open(os.path.join(os.fspath(directory), "generation_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
