"""Pretraining presets for the embedded target: micro (tests), tiny (CPU), small (one GPU).

Embeddings: `micro` and `small` are untied (like Qwen3-8B, the real target, so the drafter's
separate-LM-head path gets exercised); `tiny` ties them (like Qwen3-0.6B): at D=256 and
V=4096 an untied head would add a quarter more parameters and slow a CPU step for no gain
in a 4-minute budget.
"""

from __future__ import annotations

import dataclasses

from adaflash_jax.data.corpus import CorpusConfig
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.presets import target_preset


def _shape(name: str) -> dict:
    """The pretraining fields of the registry's target shape `name` (`model/presets.py`)."""
    t = target_preset(name)
    return dict(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        num_layers=t.num_hidden_layers,
        num_heads=t.num_attention_heads,
        num_kv_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        intermediate_size=t.intermediate_size,
        tie_embeddings=t.tie_word_embeddings,
        rope_theta=t.rope_theta,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    name: str
    corpus: CorpusConfig
    vocab_size: int  # BPE vocabulary incl. special tokens = the model's V
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_embeddings: bool
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 4096
    compute_dtype: str = "float32"  # params and optimizer state are always float32
    seq_len: int
    batch_size: int  # global, in packed rows
    steps: int
    lr: float
    warmup_steps: int
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    save_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    max_nonfinite_steps: int = 10  # skipped (non-finite) steps in a row that stop the run
    eval_rows_per_domain: int = 64  # caps eval cost; rows of seq_len + 1 tokens

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "seq_len", "batch_size", "steps"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"PretrainConfig.{name} must be positive, got {getattr(self, name)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"PretrainConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"PretrainConfig.compute_dtype must be float32 or bfloat16, "
                f"got {self.compute_dtype!r}"
            )
        if self.seq_len + 1 > self.max_position_embeddings:
            raise ValueError(
                f"PretrainConfig.seq_len {self.seq_len} exceeds max_position_embeddings "
                f"{self.max_position_embeddings}"
            )

    def target_config(self, vocab_size: int, eos_token_id: int) -> TargetConfig:
        return TargetConfig(
            model_type="qwen3",
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            eos_token_id=eos_token_id,
        )


def micro() -> PretrainConfig:
    """Seconds on CPU: a corpus slice, V=512, D=64, 2 layers. For tests."""
    return PretrainConfig(
        name="micro",
        corpus=CorpusConfig(
            code_bytes=60_000,
            prose_bytes=150_000,
            reference_docs=False,
            math_problems=200,
            dialogue_math=40,
            min_eval_prompts=0,
        ),
        **_shape("micro"),
        seq_len=32,
        batch_size=8,
        steps=3,
        lr=1e-2,
        warmup_steps=0,
        save_every=2,
        log_every=1,
        eval_rows_per_domain=8,
    )


def tiny() -> PretrainConfig:
    """The CPU default: ~4M parameters, the whole build in under 4 minutes on 2 cores."""
    return PretrainConfig(
        name="tiny",
        corpus=CorpusConfig(),
        **_shape("tiny"),
        seq_len=256,
        batch_size=4,  # more, smaller steps learn faster than fewer big ones at this budget
        steps=300,
        lr=3e-3,
        warmup_steps=30,
        save_every=100,
        log_every=10,
        eval_rows_per_domain=32,
    )


def small() -> PretrainConfig:
    """One GPU, a few minutes: ~80M parameters on every eligible stdlib file (~6.6 MB of
    text, ~2M tokens; 600 steps are ~5 epochs)."""
    return PretrainConfig(
        name="small",
        corpus=CorpusConfig(
            code_bytes=6_000_000, prose_bytes=6_000_000, math_problems=8000, dialogue_math=2000
        ),
        **_shape("small"),
        compute_dtype="bfloat16",
        seq_len=512,
        batch_size=32,
        steps=600,
        lr=1e-3,
        warmup_steps=40,
        save_every=200,
        log_every=50,
        eval_rows_per_domain=128,
    )


PRESETS = {"micro": micro, "tiny": tiny, "small": small}


def get_preset(name: str) -> PretrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name]()
