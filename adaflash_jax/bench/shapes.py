"""Weight bytes of a model shape (the named shapes: `model/presets.py`)."""

from __future__ import annotations

from adaflash_jax.model.config import TargetConfig


def weight_bytes(cfg: TargetConfig, bytes_per_param: int = 2) -> int:
    """Bytes one decode step must read at least once (all weights, tied head counted once)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qo = 2 * d * cfg.num_attention_heads * cfg.head_dim
    kv = 2 * d * cfg.num_key_value_heads * cfg.head_dim
    per_layer = qo + kv + 3 * d * f + 2 * d + 2 * cfg.head_dim
    emb = v * d * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_hidden_layers * per_layer + emb + d) * bytes_per_param
