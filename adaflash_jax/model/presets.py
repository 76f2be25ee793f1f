"""One registry of target shapes: name → `TargetConfig` factory.

The unit tests' model (`test`), the embedded pretraining targets (`micro`, `tiny`, `small`:
their vocabulary is the preset's BPE size; `train/presets.py` reads the rest of the shape
here) and the real targets whose shapes the benchmarks (random weights), the planner and the
TPU compiles use (`qwen3-1.7b`, `qwen3-8b`, `qwen3-32b`, and the mixture-of-experts
`qwen3-30b-a3b`, `qwen3-coder-30b-a3b`, and the hybrid Gated-DeltaNet `qwen3.5-9b` and
`qwen3.6-35b-a3b`; `test-hybrid` is the unit tests' hybrid). Names are CLI names (`--shape`,
`target_shape`): keep them stable. Add a shape by adding an entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from adaflash_jax.model.config import ConfigError, TargetConfig


def _dense(v, d, f, layers, heads, kv, dh, *, tied=False, **kw) -> TargetConfig:
    """V, D, F, L, H, Kv, Dh of a dense Llama/Qwen3 target."""
    return TargetConfig(
        vocab_size=v,
        hidden_size=d,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=dh,
        tie_word_embeddings=tied,
        **kw,
    )


def _qwen3(d, f, layers, heads, *, tied=False) -> TargetConfig:
    """Qwen3 dense: V 151936, 8 kv heads of 128, 40960 positions."""
    return _dense(151936, d, f, layers, heads, 8, 128, tied=tied, max_position_embeddings=40960)


def _qwen3_moe(**kw) -> TargetConfig:
    """Qwen3-30B-A3B (HF config.json): 48 layers, D 2048, 32 q / 4 kv heads of 128, every
    layer a mixture of 128 experts of F 768, 8 per token, renormalised; the dense F 6144 is
    unused by the target but sizes a DFlash drafter."""
    base = _dense(151936, 2048, 6144, 48, 32, 4, 128, max_position_embeddings=40960)
    return dataclasses.replace(base, **_MOE_30B, **kw)


_MOE_30B = dict(
    model_type="qwen3_moe",
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
)
PRETRAIN_ROPE = 10_000.0  # the embedded targets' RoPE base


def _hybrid(v, d, f, layers, heads, kv, dh, *, every, linear, **kw) -> TargetConfig:
    """A Qwen3.5 hybrid: every `every`-th layer gated full attention (partial RoPE 0.25),
    the others Gated DeltaNets of `linear` = (Jk, Dk, J, Dv, taps)."""
    jk, dk, j, dv, taps = linear
    kinds = tuple(
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
    )
    return _dense(
        v,
        d,
        f,
        layers,
        heads,
        kv,
        dh,
        model_type=kw.pop("model_type", "qwen3_5_text"),
        layer_types=kinds,
        partial_rotary_factor=0.25,
        linear_num_key_heads=jk,
        linear_key_head_dim=dk,
        linear_num_value_heads=j,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=taps,
        **kw,
    )


# Qwen3.5 / Qwen3.6 (transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults, which
# are the 9B's and the 35B-A3B's): V 248320, head_dim 256, θ 1e7, 262144 positions
_QWEN35 = dict(rope_theta=10_000_000.0, max_position_embeddings=262144)
_QWEN35_LINEAR = (16, 128, 32, 128, 4)

PRESETS: dict[str, Callable[[], TargetConfig]] = {
    # the unit tests' target (D 32, 2 layers): seconds to compile on a CPU
    "test": lambda: _dense(128, 32, 64, 2, 4, 2, 8),
    # the pretraining presets' targets (`train/presets.py`); micro is also the random CPU
    # benchmark model, tiny (~4M parameters) ties its embeddings, small is ~80M
    "micro": lambda: _dense(512, 64, 128, 2, 4, 2, 16, rope_theta=PRETRAIN_ROPE),
    "tiny": lambda: _dense(4096, 256, 768, 4, 4, 2, 64, tied=True, rope_theta=PRETRAIN_ROPE),
    "small": lambda: _dense(4096, 768, 2048, 12, 12, 4, 64, rope_theta=PRETRAIN_ROPE),
    "qwen3-1.7b": lambda: _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-8b": lambda: _qwen3(4096, 12288, 36, 32),
    "qwen3-32b": lambda: _qwen3(5120, 25600, 64, 64),
    "qwen3-30b-a3b": _qwen3_moe,
    # the hybrid tests' target: linear, full, linear (an attention layer every second; the
    # parity tests build odd shapes of their own)
    "test-hybrid": lambda: _hybrid(128, 32, 64, 3, 4, 2, 16, every=2, linear=(2, 8, 4, 8, 4)),
    # micro as a hybrid (DeltaNet then gated attention; DeltaNet 2 key / 4 value heads of 16):
    # the CPU hybrid benchmark, against micro as its dense twin (same D, L, MLP, V)
    "micro-hybrid": lambda: _hybrid(
        512, 64, 128, 2, 4, 2, 16, every=2, linear=(2, 16, 4, 16, 4), rope_theta=PRETRAIN_ROPE
    ),
    "qwen3.5-9b": lambda: _hybrid(
        248320, 4096, 12288, 32, 16, 4, 256, every=4, linear=_QWEN35_LINEAR, **_QWEN35
    ),
    "qwen3.6-35b-a3b": lambda: _hybrid(
        248320,
        2048,
        512,
        40,
        16,
        2,
        256,
        every=4,
        linear=_QWEN35_LINEAR,
        model_type="qwen3_5_moe_text",
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        norm_topk_prob=True,
        shared_expert_intermediate_size=512,
        **_QWEN35,
    ),
    "qwen3-coder-30b-a3b": lambda: _qwen3_moe(
        rope_theta=10_000_000.0, max_position_embeddings=262144
    ),
    # micro as a mixture of 8 experts of F 64, 2 per token: micro's active MLP weights per
    # token (plus a 64 x 8 router), 4x its MLP weights in all (the CPU MoE benchmark)
    "micro-moe": lambda: dataclasses.replace(
        PRESETS["micro"](),
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),  # fmt: skip
}


def target_preset(name: str, **overrides) -> TargetConfig:
    """The named shape (case-insensitive), with `overrides` of its fields (e.g. the test
    shape with another vocabulary)."""
    try:
        cfg = PRESETS[name.lower()]()
    except KeyError:
        raise ConfigError(f"unknown target shape {name!r}; presets: {sorted(PRESETS)}") from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
