"""Target LLM configuration, read from and written to HuggingFace `config.json`.

Covers the dense Llama and Qwen3 families (docs/design.md §2), Qwen3-MoE (`qwen3_moe`: per
layer either the dense SwiGLU MLP or a routed mixture of SwiGLU experts, `model/moe.py`) and
the hybrid Qwen3.5 / Qwen3.6 family (docs/design.md §2.1: `qwen3_5_text`, `qwen3_5_moe_text`,
and their multimodal wrappers `qwen3_5`, `qwen3_5_moe`, whose `text_config` is the decoder):
per layer a Gated DeltaNet (`linear_attention`) or a gated full attention layer, the MoE one
with a shared expert on every layer; and gpt-oss (`gpt_oss`, docs/design.md §2.3): every layer
a mixture of biased experts with the clamped SwiGLU, attention with q/k/v/o biases and a sink
logit per head, sliding-window (`sliding_attention`) and full layers alternating, YaRN RoPE.
The config is architecture only; dtypes are chosen when a model is built or loaded.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from adaflash_jax.model.hf_fields import (  # noqa: F401 (ConfigError, RopeScaling, YarnScaling, read_rope: re-exported)
    ARCHITECTURES,
    FAMILY_LAYER_TYPES,
    HYBRID_MODEL_TYPES,
    MULTIMODAL_WRAPPERS,
    REFUSED,
    SUPPORTED_MODEL_TYPES,
    ConfigError,
    RopeScaling,
    YarnScaling,
    default_feature_layers,
    experts_from_hf,
    gpt_oss_from_hf,
    hybrid_from_hf,
    read_json_file,
    read_rope,
)

MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe_text", "gpt_oss")


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
    rope_scaling: RopeScaling | YarnScaling | None = None
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
    shared_expert_intermediate_size: int = 0  # qwen3_5_moe_text: a gated shared expert
    # Hybrid targets (qwen3_5_text, qwen3_5_moe_text): each layer's kind, partial RoPE on the
    # full attention layers, and the Gated DeltaNet's shapes (docs/design.md §2.1).
    layer_types: tuple[str, ...] = ()  # () = every layer full attention
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    # gpt-oss (docs/design.md §2.3): the window of its `sliding_attention` layers (a query at
    # q sees keys p with q − window < p <= q), q/k/v/o biases, the experts' clamped SwiGLU.
    sliding_window: int | None = None
    attention_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
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
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(
                f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} "
                "must give an even number of rotated dims"
            )
        self._check_experts()
        self._check_layer_types()

    def _check_layer_types(self):
        gpt_oss = self.model_type == "gpt_oss"
        if not (self.is_hybrid or gpt_oss):
            if self.layer_types or self.partial_rotary_factor != 1.0:
                raise ConfigError(
                    f"layer_types and partial_rotary_factor need a hybrid model_type "
                    f"{HYBRID_MODEL_TYPES} (or gpt_oss), not {self.model_type!r}"
                )
        if not gpt_oss:
            for name in ("sliding_window", "attention_bias"):
                if getattr(self, name):
                    raise ConfigError(f"{name} needs model_type 'gpt_oss', not {self.model_type!r}")
        if not (self.is_hybrid or gpt_oss):
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        allowed = FAMILY_LAYER_TYPES[self.model_type]
        if unknown := sorted(set(self.layer_types) - set(allowed)):
            raise ConfigError(
                f"unknown layer_types {unknown} for {self.model_type}; supported: {list(allowed)}"
            )
        if gpt_oss:
            if self.partial_rotary_factor != 1.0:
                raise ConfigError("gpt_oss rotates whole heads: partial_rotary_factor must be 1")
            sliding = "sliding_attention" in self.layer_types
            if sliding and (self.sliding_window is None or self.sliding_window < 1):
                raise ConfigError(
                    f"sliding_attention layers need a positive sliding_window, got "
                    f"{self.sliding_window}"
                )
            return
        for name in (
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )

    def _check_experts(self):
        if self.model_type == "qwen3_5_moe_text":
            if self.num_experts <= 0 or self.shared_expert_intermediate_size <= 0:
                raise ConfigError(
                    "a qwen3_5_moe_text config needs num_experts and "
                    "shared_expert_intermediate_size > 0"
                )
        elif self.shared_expert_intermediate_size:
            raise ConfigError("shared_expert_intermediate_size needs model_type 'qwen3_5_moe_text'")
        if self.model_type == "gpt_oss" and self.num_experts <= 0:
            raise ConfigError("a gpt_oss config needs num_experts > 0")
        if self.model_type not in MOE_MODEL_TYPES:
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
        """Qwen3 and Qwen3.5 normalise each query/key head before RoPE; Llama, gpt-oss do not."""
        return self.model_type not in ("llama", "gpt_oss")

    @property
    def attention_sinks(self) -> bool:
        """gpt-oss: a learned logit per query head joins every softmax's denominator."""
        return self.model_type == "gpt_oss"

    def layer_window(self, layer: int) -> int | None:
        """The attention window of decoder layer `layer` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def is_hybrid(self) -> bool:
        """Gated DeltaNet layers among the attention ones (docs/design.md §2.1). Such a model
        also gates its attention output, and its RMSNorms scale by (1 + w)."""
        return self.model_type in HYBRID_MODEL_TYPES

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each attention head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a Gated DeltaNet (else full attention)."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

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
        if model_type in REFUSED:
            raise ConfigError(f"model_type {model_type!r} is not supported: {REFUSED[model_type]}")
        if model_type in MULTIMODAL_WRAPPERS:
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(
                    f"a {model_type!r} config.json needs a text_config (its text decoder)"
                )
            # the wrapper's top-level token ids and tying apply when the text config omits them
            inherited = ("tie_word_embeddings", "bos_token_id", "eos_token_id")
            cfg = {**{k: cfg[k] for k in inherited if k in cfg}, **text}
            cfg["model_type"] = model_type = MULTIMODAL_WRAPPERS[model_type]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {SUPPORTED_MODEL_TYPES + tuple(MULTIMODAL_WRAPPERS)}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag) and not (model_type == "gpt_oss" and flag == "attention_bias"):
                raise ConfigError(f"config.json sets {flag}=true, which is not supported")
        if model_type != "gpt_oss" and cfg.get("quantization_config") is not None:
            raise ConfigError(
                f"config.json has a quantization_config, which {model_type} does not support"
            )
        if model_type == "qwen3_5_moe_text":  # every layer is MoE: no dense MLP width
            cfg = {"intermediate_size": cfg.get("moe_intermediate_size"), **cfg}
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
        default_theta = {"llama": 10_000.0, "gpt_oss": 150_000.0}.get(model_type, 1_000_000.0)
        rope_theta, rope_scaling = read_rope(
            cfg, default_theta, allow_mrope=model_type in HYBRID_MODEL_TYPES
        )
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
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5 if model_type == "gpt_oss" else 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "qwen3")),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            **(experts_from_hf(cfg) if model_type in ("qwen3_moe", "qwen3_5_moe_text") else {}),
            **(hybrid_from_hf(cfg) if model_type in HYBRID_MODEL_TYPES else {}),
            **(gpt_oss_from_hf(cfg) if model_type == "gpt_oss" else {}),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> TargetConfig:
        cfg_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"target directory does not exist: {path}")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {path}")
        return cls.from_hf_dict(read_json_file(cfg_path))

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
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
        if self.is_hybrid:
            out.update(
                layer_types=list(self.layer_types),
                linear_conv_kernel_dim=self.linear_conv_kernel_dim,
                linear_key_head_dim=self.linear_key_head_dim,
                linear_value_head_dim=self.linear_value_head_dim,
                linear_num_key_heads=self.linear_num_key_heads,
                linear_num_value_heads=self.linear_num_value_heads,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor,
                },
            )
            del out["rope_scaling"], out["rope_theta"]
        if self.model_type == "qwen3_5_moe_text":
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            )
        if self.model_type == "qwen3_moe":
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        if self.model_type == "gpt_oss":
            rope = (
                {"rope_type": "default"} if self.rope_scaling is None else self.rope_scaling.to_hf()
            )
            del out["rope_scaling"], out["rope_theta"]
            out.update(
                rope_parameters={**rope, "rope_theta": self.rope_theta},
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                intermediate_size=self.moe_intermediate_size,
                layer_types=list(self.layer_types),
                sliding_window=self.sliding_window,
                attention_bias=self.attention_bias,
                swiglu_alpha=self.swiglu_alpha,
                swiglu_limit=self.swiglu_limit,
            )
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            out["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return out
