"""One registry of target shapes: name → `TargetConfig` factory.

The unit tests' model (`test`), the embedded pretraining targets (`micro`, `tiny`, `small`:
their vocabulary is the preset's BPE size; `train/presets.py` reads the rest of the shape
here) and the real targets whose shapes the benchmarks (random weights), the planner and the
TPU compiles use (`qwen3-1.7b`, `qwen3-8b`, `qwen3-32b`). Names are CLI names (`--shape`,
`target_shape`): keep them stable. Add a shape by adding an entry.
"""

from __future__ import annotations

from collections.abc import Callable

from adaflash_jax.model.config import ConfigError, TargetConfig


def test() -> TargetConfig:
    """The unit tests' target (D 32, 2 layers): seconds to compile on a CPU."""
    return TargetConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )


def micro() -> TargetConfig:
    """The `micro` pretraining preset's target; also the random CPU benchmark model."""
    return TargetConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


def tiny() -> TargetConfig:
    """The `tiny` pretraining preset's target (~4M parameters, tied embeddings)."""
    return TargetConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    )


def small() -> TargetConfig:
    """The `small` pretraining preset's target (~80M parameters, one GPU)."""
    return TargetConfig(
        vocab_size=4096,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    )


def _qwen3(*, hidden, mlp, layers, heads, tied=False) -> TargetConfig:
    """Qwen3 dense: V 151936, kv heads 8 of 128, 40960 positions."""
    return TargetConfig(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=tied,
    )


PRESETS: dict[str, Callable[[], TargetConfig]] = {
    "test": test,
    "micro": micro,
    "tiny": tiny,
    "small": small,
    "qwen3-1.7b": lambda: _qwen3(hidden=2048, mlp=6144, layers=28, heads=16, tied=True),
    "qwen3-8b": lambda: _qwen3(hidden=4096, mlp=12288, layers=36, heads=32),
    "qwen3-32b": lambda: _qwen3(hidden=5120, mlp=25600, layers=64, heads=64),
}


def target_preset(name: str) -> TargetConfig:
    """The named shape (case-insensitive)."""
    try:
        return PRESETS[name.lower()]()
    except KeyError:
        raise ConfigError(f"unknown target shape {name!r}; presets: {sorted(PRESETS)}") from None
