"""Named model shapes for benchmarks with random weights (no checkpoint needed)."""

from __future__ import annotations

from adaflash_jax.model.config import TargetConfig

SHAPES = {
    # Qwen3-8B: 36 layers, D 4096, 32 q heads / 8 kv heads of 128, MLP 12288, vocab 151936.
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
    ),
    "qwen3-32b": dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
    ),
    "qwen3-1.7b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}


def shape_config(name: str) -> TargetConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    return TargetConfig(model_type="qwen3", **SHAPES[name])


def weight_bytes(cfg: TargetConfig, bytes_per_param: int = 2) -> int:
    """Bytes one decode step must read at least once (all weights, tied head counted once)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qo = 2 * d * cfg.num_attention_heads * cfg.head_dim
    kv = 2 * d * cfg.num_key_value_heads * cfg.head_dim
    per_layer = qo + kv + 3 * d * f + 2 * d + 2 * cfg.head_dim
    emb = v * d * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_hidden_layers * per_layer + emb + d) * bytes_per_param
