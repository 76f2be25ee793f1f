"""Target LLM configuration, read from and written to HuggingFace `config.json`.

Covers the dense Llama and Qwen3 families (docs/design.md §2) and Qwen3-MoE (`qwen3_moe`: per layer
either the dense SwiGLU MLP or a routed mixture of SwiGLU experts, `model/moe.py`). The
config is architecture only; dtypes are chosen when a model is built or loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama")
_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
}


class ConfigError(ValueError):
    """A config.json that this project cannot build a model from."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3.1 style ("llama3") frequency scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetConfig:
    model_type: str = "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Mixture of experts (qwen3_moe only; 0 experts = every layer dense). Layer i is sparse
    # unless it is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self._check_experts()

    def _check_experts(self):
        if self.model_type != "qwen3_moe":
            if self.num_experts:
                raise ConfigError(
                    f"num_experts needs model_type 'qwen3_moe', not {self.model_type!r}"
                )
            return
        if self.num_experts < 0 or self.decoder_sparse_step < 1:
            raise ConfigError(
                f"num_experts ({self.num_experts}) must be >= 0 and decoder_sparse_step "
                f"({self.decoder_sparse_step}) >= 1"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ConfigError(
                f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}"
            )
        if bad := [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]:
            raise ConfigError(
                f"mlp_only_layers {bad} are outside the target's {self.num_hidden_layers} layers"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (HF Qwen3MoeDecoderLayer's rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each query/key head before RoPE; Llama does not."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def default_feature_layers(self, num_features: int) -> tuple[int, ...]:
        """docs/design.md §2: the target layers whose outputs feed the drafter by default."""
        return default_feature_layers(self.num_hidden_layers, num_features)

    # ---- HuggingFace config.json -------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> TargetConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {SUPPORTED_MODEL_TYPES}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ConfigError(f"config.json sets {flag}=true, which is not supported")
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in cfg
        ]
        if missing:
            raise ConfigError(f"config.json is missing required fields: {missing}")
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        if cfg.get("use_sliding_window"):
            raise ConfigError("config.json sets use_sliding_window=true, which is not supported")
        default_theta = 10_000.0 if model_type == "llama" else 1_000_000.0
        rope_theta, rope_scaling = read_rope(cfg, default_theta)
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(eos)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "qwen3")),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            **(_experts_from_hf(cfg) if model_type == "qwen3_moe" else {}),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> TargetConfig:
        cfg_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"target directory does not exist: {path}")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {path}")
        with open(cfg_path) as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
            "use_cache": True,
        }
        if self.model_type == "qwen3_moe":
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            out["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return out


def _experts_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """A qwen3_moe config.json's expert fields (transformers >= 5 writes `num_local_experts`;
    the published checkpoints say `num_experts`). The router's aux loss is training-only."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None or "num_experts_per_tok" not in cfg or "moe_intermediate_size" not in cfg:
        raise ConfigError(
            "a qwen3_moe config.json needs num_experts, num_experts_per_tok and "
            "moe_intermediate_size"
        )
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
    )


def default_feature_layers(n_layers: int, num_features: int) -> tuple[int, ...]:
    """docs/design.md §2's default feature layers of an `n_layers`-layer target: `n == 1 → [L//2]`,
    else `round(1 + j·(L−4)/(n−1))`, clipped to the target's layers."""
    if num_features <= 0:
        raise ConfigError(f"num_features must be positive, got {num_features}")
    if num_features == 1:
        return (n_layers // 2,)
    span = n_layers - 4
    ids = tuple(int(round(1 + j * span / (num_features - 1))) for j in range(num_features))
    return tuple(min(max(i, 0), n_layers - 1) for i in ids)


def read_rope(cfg: dict[str, Any], default_theta: float) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling of a HF config.json (a target's or a drafter's), from the old
    top-level form (`rope_theta`, `rope_scaling`) or the newer `rope_parameters` form."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", scaling.get("rope_theta")))
    theta = float(theta if theta is not None else default_theta)
    spec = scaling if scaling else params
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(f"unsupported rope scaling type {rope_type!r}; supported: llama3")
    try:
        return theta, RopeScaling(
            factor=float(spec["factor"]),
            low_freq_factor=float(spec["low_freq_factor"]),
            high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"llama3 rope scaling is missing field {e}") from None
