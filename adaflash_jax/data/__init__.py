"""The embedded corpus (code, prose, math, dialogue), its tokenizer and the input pipeline."""

from adaflash_jax.data.corpus import (
    CORPUS_VERSION,
    DOMAINS,
    Corpus,
    CorpusConfig,
    CorpusError,
    Document,
    build_corpus,
    read_prompts,
)
from adaflash_jax.data.dialogue import CHAT_TEMPLATE, EOS_TOKEN, MASK_TOKEN, render_chat

__all__ = [
    "CHAT_TEMPLATE",
    "CORPUS_VERSION",
    "DOMAINS",
    "EOS_TOKEN",
    "MASK_TOKEN",
    "Corpus",
    "CorpusConfig",
    "CorpusError",
    "Document",
    "build_corpus",
    "read_prompts",
    "render_chat",
]
