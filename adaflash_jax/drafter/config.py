"""Drafter and length-head configuration (docs/design.md §3, §4.3, §6)."""

from __future__ import annotations

import dataclasses

from adaflash_jax.model.config import ConfigError, RopeScaling, TargetConfig

# Block sizes the decayed-CE schedule is defined for (docs/design.md §4.1); others fall back to K/2.
LOSS_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# Width of the per-position acceptance network a distillation run gives its head by default.
DEFAULT_ACCEPT_DIM = 64
# Drafter layer kinds (HF `layer_types`): a "sliding_attention" layer's block query at position
# p sees only the context keys at positions > p − sliding_window (docs/design.md §3).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthHeadConfig:
    """The reference "two-model" head: mean+last block state → 256 → residual → sigmoid.

    `accept_dim` > 0 adds a separate per-position acceptance network of that width (its own
    trunk, so r is unaffected); 0 means the reference head only.
    """

    bottleneck_dim: int = 256
    accept_dim: int = 0

    def __post_init__(self):
        if self.bottleneck_dim <= 0:
            raise ConfigError(f"length head bottleneck_dim must be positive: {self.bottleneck_dim}")
        if self.accept_dim < 0:
            raise ConfigError(f"length head accept_dim must be >= 0: {self.accept_dim}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int = 5
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    vocab_size: int
    block_size: int = 16
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    length_head: LengthHeadConfig | None = None
    # One entry per drafter layer (None: every layer full attention); the window of the
    # sliding layers (None when there are none).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        layer_types = self.layer_types or (FULL_ATTENTION,) * self.num_hidden_layers
        object.__setattr__(self, "layer_types", tuple(str(t) for t in layer_types))
        if self.block_size < 2:
            raise ConfigError(f"block_size must be at least 2, got {self.block_size}")
        if self.num_hidden_layers < 1:
            raise ConfigError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids must name at least one target layer")
        for i in self.target_layer_ids:
            if not 0 <= i < self.num_target_layers:
                raise ConfigError(
                    f"target layer id {i} is outside the target's {self.num_target_layers} layers"
                )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} is outside the vocab (size {self.vocab_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, the drafter has "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(
                    f"layer_types[{i}] is {kind!r}; supported drafter layers: {list(LAYER_TYPES)}"
                )
        if SLIDING_ATTENTION not in self.layer_types:
            object.__setattr__(self, "sliding_window", None)  # nothing reads it
            return
        w = self.sliding_window
        if not isinstance(w, int) or isinstance(w, bool) or w < self.block_size:
            raise ConfigError(
                f"sliding_window must be an integer >= block_size ({self.block_size}) for the "
                f"sliding_attention layers, got {w!r} (a block's own keys are never windowed)"
            )

    def layer_window(self, layer: int) -> int | None:
        """The attention window of drafter layer `layer` (None: full attention)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def loss_gamma(self) -> float:
        return LOSS_GAMMA.get(self.block_size, self.block_size / 2)

    @classmethod
    def for_target(
        cls,
        target: TargetConfig,
        *,
        mask_token_id: int,
        num_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: tuple[int, ...] | None = None,
        num_features: int = 5,
        length_head: bool = True,
        accept_dim: int = 0,
        layer_types: tuple[str, ...] | None = None,
        sliding_window: int | None = None,
        heads: tuple[int, int, int] | None = None,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """A drafter shaped like its target (DFlash: same width and heads as the target).

        `accept_dim` > 0 gives the length head a per-position acceptance output;
        `layer_types` / `sliding_window` make some layers sliding-window (docs/design.md §3).
        `heads` (H, Kv, Dh) and `intermediate_size` override the target's: the reference's
        Qwen3.5-9B drafter has 32 q / 8 kv heads of 128 where its target has 16 / 4 of 256,
        and a MoE target may have no dense MLP width to copy.
        """
        if accept_dim and not length_head:
            raise ConfigError(f"accept_dim={accept_dim} needs length_head=True")
        if target_layer_ids is None:
            target_layer_ids = target.default_feature_layers(num_features)
        h, kv, dh = heads or (
            target.num_attention_heads,
            target.num_key_value_heads,
            target.head_dim,
        )
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=h,
            num_key_value_heads=kv,
            head_dim=dh,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            vocab_size=target.vocab_size,
            block_size=block_size,
            target_layer_ids=tuple(target_layer_ids),
            num_target_layers=target.num_hidden_layers,
            mask_token_id=mask_token_id,
            length_head=LengthHeadConfig(accept_dim=accept_dim) if length_head else None,
            layer_types=layer_types,
            sliding_window=sliding_window,
        )

    def validate_against(self, target: TargetConfig) -> None:
        """Fails with a message naming the mismatch when this drafter cannot serve `target`."""
        if self.hidden_size != target.hidden_size:
            raise ConfigError(
                f"drafter hidden_size {self.hidden_size} != target hidden_size "
                f"{target.hidden_size}: the drafter reads the target's embeddings and features"
            )
        if self.vocab_size != target.vocab_size:
            raise ConfigError(
                f"drafter vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} is not a row of the target's embedding "
                f"table (vocab {target.vocab_size})"
            )
        if self.num_target_layers != target.num_hidden_layers:
            raise ConfigError(
                f"drafter was built for a {self.num_target_layers}-layer target, "
                f"this target has {target.num_hidden_layers} layers"
            )
        for i in self.target_layer_ids:
            if not 0 <= i < target.num_hidden_layers:
                raise ConfigError(
                    f"target layer id {i} does not exist in the target "
                    f"({target.num_hidden_layers} layers)"
                )
