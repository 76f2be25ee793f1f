"""Target LLM configuration, read from and written to HuggingFace `config.json`.

Covers the dense Llama and Qwen3 families (docs/design.md §2). The config is architecture only;
dtypes are chosen when a model is built or loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")


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

    def __post_init__(self):
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

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each query/key head before RoPE; Llama does not."""
        return self.model_type == "qwen3"

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
        default_theta = 1_000_000.0 if model_type == "qwen3" else 10_000.0
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type != "llama")),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
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
        arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[self.model_type]
        out: dict[str, Any] = {
            "architectures": [arch],
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
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            out["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return out


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
