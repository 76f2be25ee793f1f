"""Weight bytes of a model shape (the named shapes: `model/presets.py`)."""

from __future__ import annotations

from adaflash_jax.model.config import TargetConfig


def weight_bytes(cfg: TargetConfig, bytes_per_param: int = 2) -> int:
    """Bytes one decode step must read at least once (all weights, tied head counted once)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qo = 2 * d * cfg.num_attention_heads * cfg.head_dim
    kv = 2 * d * cfg.num_key_value_heads * cfg.head_dim
    attn = qo + kv + 2 * d + 2 * cfg.head_dim
    moe = cfg.num_experts * 3 * d * cfg.moe_intermediate_size + d * cfg.num_experts
    mlps = sum(moe if cfg.is_moe_layer(i) else 3 * d * f for i in range(cfg.num_hidden_layers))
    emb = v * d * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_hidden_layers * attn + mlps + emb + d) * bytes_per_param
