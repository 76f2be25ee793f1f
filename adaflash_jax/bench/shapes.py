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
    # Qwen3-30B-A3B (HF config.json): 48 layers, D 2048, 32 q / 4 kv heads of 128, every
    # layer a mixture of 128 experts of F 768, 8 per token, renormalised; the dense
    # intermediate_size (6144) is unused by the target but sizes a DFlash drafter.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
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


# Qwen3-Coder-30B-A3B: the same network with a longer context (rope theta 1e7, 256k positions).
SHAPES["qwen3-coder-30b-a3b"] = dict(
    SHAPES["qwen3-30b-a3b"], rope_theta=10_000_000.0, max_position_embeddings=262144
)

# "tiny" as a mixture of 8 experts of F 64, 2 per token: the same active MLP weights per
# token as tiny's dense F 128 (plus a 64 x 8 router), 4x the MLP weights in all.
SHAPES["tiny-moe"] = dict(
    SHAPES["tiny"],
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
)


def shape_config(name: str) -> TargetConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    return TargetConfig(**{"model_type": "qwen3", **SHAPES[name]})


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
