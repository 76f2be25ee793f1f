"""The run config's training stages: stage 1 (`Stage1Spec`), head init (`HeadInitSpec`) and
the stage-2 rounds with their methods (`Stage2Spec`, `STAGE2_OBJECTIVE`); `distill/config.py`
holds the rest of the tree (`RunConfig`). Each spec checks its ranges and names as it is
built (`positive`, shared by every spec of the tree)."""

from __future__ import annotations

import dataclasses
from typing import Any

from adaflash_jax.model.config import ConfigError

# stage1_long: stage 1 run for its steps plus every stage-2 step (the equal-steps baseline)
METHODS = ("stage1", "adaflash", "sft", "fkl", "stage1_long")
# method → (divergence of the clipped KL term, α override; None keeps stage2.alpha)
STAGE2_OBJECTIVE = {"adaflash": ("rkl", None), "sft": ("rkl", 1.0), "fkl": ("fkl", None)}
STAGE2_METHODS = (*STAGE2_OBJECTIVE, "stage1_long")
POOLS = ("fresh", "stage1")
HEAD_FITS = ("all", "fresh")  # stage-2 steps the length head learns from
COLLECTORS = ("replay", "engine")  # stage 2's collectors, also eval.backend's choices


def positive(section: str, obj: Any, *names: str, allow_zero: bool = False) -> None:
    """`section.name` of `obj` must be > 0 (>= 0 with `allow_zero`), else a ConfigError."""
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{section}.{name} must be {bound}, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage1Spec:
    steps: int = 200
    lr: float = 6e-4
    warmup_fraction: float = 0.04
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0

    def __post_init__(self):
        positive("stage1", self, "steps", "weight_decay", allow_zero=True)
        positive("stage1", self, "lr", "clip_norm")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"stage1.warmup_fraction must be in [0, 1): {self.warmup_fraction}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadInitSpec:
    """Fit the length head with the drafter frozen (reference: offline init, AdamW lr 5e-5 with
    torch's defaults β (0.9, 0.999), weight decay 0.01 on every parameter, 64 anchors per
    sequence drawn over the whole sequence: the "sequence" anchor rule)."""

    steps: int = 100
    lr: float = 5e-5
    num_anchors: int = 64
    anchors: str = "sequence"  # "sequence" (reference) or "response" (distill.anchors)
    weight_decay: float = 0.01
    b2: float = 0.999
    decay_all: bool = True  # decay norms and biases too, as torch's AdamW
    clip_norm: float | None = None  # the reference's offline init clips nothing

    def __post_init__(self):
        positive("head_init", self, "steps", "weight_decay", allow_zero=True)
        if self.clip_norm is not None:
            positive("head_init", self, "clip_norm")
        positive("head_init", self, "lr", "num_anchors")
        if self.anchors not in ("response", "sequence"):
            raise ConfigError(
                f"head_init.anchors must be 'sequence' (reference) or 'response': {self.anchors!r}"
            )
        if not 0.0 < self.b2 < 1.0:
            raise ConfigError(f"head_init.b2 must be in (0, 1), got {self.b2}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage2Spec:
    """On-policy rounds (docs/design.md §4.2): each round takes `prompts_per_round` NEW prompts from
    the stage-2 pool, collects them with the current drafter, trains `steps_per_round` on
    that buffer (about steps·batch/prompts epochs), then drops it.

    Reference values: anchors "response" (uniform over the response, resampled every
    forward), pool "fresh" (prompts disjoint from stage 1's), AdamW β (0.9, 0.999) with
    weight decay 0.01 on every parameter, constant lr 3e-4 / 2e-4 (head), one clip 1.0 over
    drafter + thresh head (the optional acceptance network is clipped on its own).
    """

    rounds: int = 2
    steps_per_round: int = 50
    prompts_per_round: int = 64  # NEW prompts collected per round
    lr: float = 3e-4
    head_lr: float = 2e-4
    weight_decay: float = 0.01
    b2: float = 0.999
    decay_all: bool = True  # decay norms and biases too, as torch's AdamW
    clip_norm: float = 1.0
    alpha: float = 0.8
    tau: float = 0.01  # clips KL/Nw per sequence: a cap of τ·Nw nats (see losses.py)
    temperature: float = 1.0  # the loss's KL temperature T; collection's is the next field
    # 0: greedy collection (lossless → the target's own text); > 0 (engine collector): the
    # engine samples at it, as a deployment would (docs/design.md §4.2)
    collect_temperature: float = 0.0
    collect_slots: int = 16  # engine collector: rows decoded together
    methods: tuple[str, ...] = ("adaflash", "sft")  # each runs its own rounds, same compute
    # "response": uniform over the response (reference); "visited": only the block starts
    # the drafter visited while collecting (an ablation).
    anchors: str = "response"
    # "fresh": new prompts every round (reference); "stage1": replay stage 1's sequences.
    pool: str = "fresh"
    # "replay": exact greedy replay of the pool's target responses (regenerated once; cheap;
    # temperature 0 only; greedy speculative decoding is lossless, so its text and
    # acceptances equal the engine's); "engine": the serving engine on the prompts.
    collector: str = "replay"
    # Which of a round's steps the length head learns from. "all" (the reference): every
    # step, so from the second pass over the buffer on its labels are the acceptance of
    # blocks the drafter has just trained on, and it learns to over-predict. "fresh": the
    # first pass only (floor(buffer / batch) steps), blocks the drafter has not trained on.
    head_fit: str = "all"
    # After a method's rounds, fit the head again as head init does (drafter frozen, the
    # head_init recipe on the stage-1 data) to the drafter stage 2 left: the fix for the
    # drift above (docs/design.md §4.2; the reference re-fits nothing).
    head_refit: bool = True

    def __post_init__(self):
        object.__setattr__(self, "methods", tuple(self.methods))
        positive("stage2", self, "rounds", "steps_per_round", "weight_decay", allow_zero=True)
        positive("stage2", self, "prompts_per_round", "lr", "head_lr", "clip_norm", "temperature")
        positive("stage2", self, "collect_slots")
        positive("stage2", self, "collect_temperature", allow_zero=True)
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"stage2.alpha must be in [0, 1], got {self.alpha}")
        if not 0.0 < self.b2 < 1.0:
            raise ConfigError(f"stage2.b2 must be in (0, 1), got {self.b2}")
        if not self.tau > 0:
            raise ConfigError(f"stage2.tau must be positive, got {self.tau}")
        if self.collector not in COLLECTORS:
            raise ConfigError(f"stage2.collector must be one of {COLLECTORS}: {self.collector!r}")
        if self.anchors not in ("response", "visited"):
            raise ConfigError(
                f"stage2.anchors must be 'response' (reference) or 'visited': {self.anchors!r}"
            )
        if self.pool not in POOLS:
            raise ConfigError(f"stage2.pool must be one of {POOLS}: {self.pool!r}")
        if self.head_fit not in HEAD_FITS:
            raise ConfigError(f"stage2.head_fit must be one of {HEAD_FITS}: {self.head_fit!r}")
        if self.collector == "replay" and self.collect_temperature > 0:
            raise ConfigError(
                "stage2.collector 'replay' is exact for greedy collection only; use "
                "stage2.collector='engine' with stage2.collect_temperature > 0"
            )
        for m in self.methods:
            if m not in STAGE2_METHODS:
                raise ConfigError(f"stage2.methods has {m!r}; choose from {STAGE2_METHODS}")
