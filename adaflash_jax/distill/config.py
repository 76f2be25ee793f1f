"""The distillation run config: one frozen dataclass tree, its fields checked as it is built.

A config file (`experiments/configs/<name>.py`) defines `get_config() -> RunConfig`
(`distill/config_file.py` loads it, `distill/overrides.py` applies `stage1.steps=10`). Each
spec's `__post_init__` checks ranges and names; what needs the devices and the target is
checked by `distill/checks.py`, and what the config implies for shapes by `distill/shapes.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from adaflash_jax.drafter.config import DEFAULT_ACCEPT_DIM
from adaflash_jax.model.config import ConfigError
from adaflash_jax.train.mesh_shape import check_mesh

# stage1_long: stage 1 run for its steps plus every stage-2 step (the equal-steps baseline)
METHODS = ("stage1", "adaflash", "sft", "fkl", "stage1_long")
# method → (divergence of the clipped KL term, α override; None keeps stage2.alpha)
STAGE2_OBJECTIVE = {"adaflash": ("rkl", None), "sft": ("rkl", 1.0), "fkl": ("fkl", None)}
STAGE2_METHODS = (*STAGE2_OBJECTIVE, "stage1_long")
POOLS = ("fresh", "stage1")
HEAD_FITS = ("all", "fresh")  # stage-2 steps the length head learns from
MAX_BLOCK_SIZE = 32
COLLECTORS = ("replay", "engine")
DTYPES = ("float32", "bfloat16")


def _positive(section: str, obj: Any, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{section}.{name} must be {bound}, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Prompts and regenerated responses. `None` paths mean the embedded corpus."""

    train_prompts: str | None = None  # JSONL (`prompt` / ShareGPT) or plain text
    eval_prompts: str | None = None
    # Stage-2 prompts (stage2.pool = "fresh"). None: the train prompts stage 1 did not use.
    stage2_prompts: str | None = None
    chat_template: bool = False  # wrap each prompt as a user turn with the tokenizer's template
    # Passed to the chat template (Qwen3 / Qwen3.5 templates branch on it). Off, as the AdaFlash
    # reference renders every prompt and z-lab's drafters are trained: a thinking-mode target
    # writes <think> text the drafter then must predict (z-lab/dflash #133: acceptance 25 %
    # with thinking on against 60 % off). Recorded in the export's config.json.
    enable_thinking: bool = False
    # Broken JSONL lines (not JSON, or not a prompt record) a prompt file may have: up to
    # this many are skipped and reported (report.json `data_issues`), more refuse the file.
    max_bad_lines: int = 0
    domains: tuple[str, ...] = ()  # () → every domain the prompts carry
    train_per_domain: int = 64  # prompts regenerated per domain for stage 1 / head init
    eval_per_domain: int = 8
    max_prompt_len: int = 64  # the prompt budget of a training sequence
    # Prompts over max_prompt_len tokens: "truncate" keeps their last tokens, "skip" leaves
    # them out (a domain then has fewer prompts). Either way counted in report.json's
    # data_issues (prompts_truncated / prompts_skipped).
    long_prompts: str = "truncate"
    max_new_tokens: int = 64  # regeneration length (greedy target responses)
    regen_batch: int = 32
    regen_dir: str | None = None  # reusable regenerated datasets (default: <run_dir>/data)

    def __post_init__(self):
        object.__setattr__(self, "domains", tuple(self.domains))
        _positive(
            "data",
            self,
            "train_per_domain",
            "eval_per_domain",
            "max_prompt_len",
            "max_new_tokens",
            "regen_batch",
        )
        _positive("data", self, "max_bad_lines", allow_zero=True)
        if self.long_prompts not in ("truncate", "skip"):
            raise ConfigError(
                f"data.long_prompts must be 'truncate' or 'skip', got {self.long_prompts!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftSpec:
    """Drafter architecture, or `init_from` an existing DFlash/AdaFlash export."""

    layers: int = 5
    block_size: int = 16
    num_features: int = 5
    target_layer_ids: tuple[int, ...] | None = None  # None → docs/design.md §2 defaults
    mask_token_id: int | None = None  # None → the tokenizer's mask token
    init_from: str | None = None  # skips stage 1; a missing length head starts fresh
    # Width of the length head's per-position acceptance network (0: none). With init_from
    # it must equal the import's (an import without one gets a fresh DEFAULT_ACCEPT_DIM one).
    accept_dim: int = DEFAULT_ACCEPT_DIM
    # The drafter's attention (H, Kv, Dh) and MLP width; None: the target's (DFlash shape).
    # The reference's Qwen3.5-9B drafter: heads (32, 8, 128) over the target's (16, 4, 256).
    heads: tuple[int, int, int] | None = None
    intermediate_size: int | None = None

    def __post_init__(self):
        if self.target_layer_ids is not None:
            object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        if self.heads is not None:
            object.__setattr__(self, "heads", tuple(self.heads))
            if len(self.heads) != 3 or min(self.heads) <= 0 or self.heads[0] % self.heads[1]:
                raise ConfigError(
                    f"draft.heads must be (H, Kv, Dh), positive, H a multiple of Kv: {self.heads}"
                )
        if self.intermediate_size is not None:
            _positive("draft", self, "intermediate_size")
        _positive("draft", self, "layers", "num_features")
        _positive("draft", self, "accept_dim", allow_zero=True)
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(
                f"draft.block_size {self.block_size} is not supported: the drafter needs "
                f"2 <= block_size <= {MAX_BLOCK_SIZE}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage1Spec:
    steps: int = 200
    lr: float = 6e-4
    warmup_fraction: float = 0.04
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0

    def __post_init__(self):
        _positive("stage1", self, "steps", "weight_decay", allow_zero=True)
        _positive("stage1", self, "lr", "clip_norm")
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
        _positive("head_init", self, "steps", "weight_decay", allow_zero=True)
        if self.clip_norm is not None:
            _positive("head_init", self, "clip_norm")
        _positive("head_init", self, "lr", "num_anchors")
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
        _positive("stage2", self, "rounds", "steps_per_round", "weight_decay", allow_zero=True)
        _positive("stage2", self, "prompts_per_round", "lr", "head_lr", "clip_norm", "temperature")
        _positive("stage2", self, "collect_slots")
        _positive("stage2", self, "collect_temperature", allow_zero=True)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSpec:
    """τ per domain on held-out prompts; greedy, so "replay" equals the engine exactly.

    Optional extras (distill/evaluation.py, docs/design.md §4.5), off by default:
    `temperatures` also measures τ with sampled decoding at each (the engine's rejection
    sampling, the drafter sampled at the same temperature, seeded by `seed`; 0 is the greedy
    table); `long_new_tokens` > 0 decodes a long-response prompt set (`long_per_domain`
    prompts per domain) greedily to that many tokens and reports τ by the block's position;
    `head_calibration` measures the length head against the blocks it would size.
    """

    backend: str = "replay"
    slots: int = 16
    temperatures: tuple[float, ...] = ()
    long_new_tokens: int = 0  # 0: no τ by position
    long_per_domain: int = 4
    # the length head's predicted vs realised accepted length on the held-out blocks, after
    # head init and after every stage-2 round (distill/calibration.py)
    head_calibration: bool = False

    def __post_init__(self):
        _positive("eval", self, "slots", "long_per_domain")
        _positive("eval", self, "long_new_tokens", allow_zero=True)
        if self.backend not in COLLECTORS:
            raise ConfigError(f"eval.backend must be one of {COLLECTORS}: {self.backend!r}")
        temps = self.temperatures
        temps = tuple(temps) if isinstance(temps, (tuple, list)) else (temps,)
        for t in temps:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
                raise ConfigError(f"eval.temperatures must be finite numbers >= 0, got {t!r}")
        if len(set(temps)) != len(temps):
            raise ConfigError(f"eval.temperatures lists a temperature twice: {temps}")
        object.__setattr__(self, "temperatures", tuple(float(t) for t in temps))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    every: int = 100  # steps between saves; every stage also saves at its end
    keep: int = 2
    async_save: bool = True

    def __post_init__(self):
        _positive("checkpoint", self, "every", "keep")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedSpec:
    """jax.distributed's runtime timeouts on a multi-process run (docs/design.md §4.4): a
    process that stops heartbeating for `heartbeat_timeout_s` is declared lost and every
    other process is ended, instead of hanging in a collective."""

    init_timeout_s: int = 300  # every process must have joined the coordinator by then
    heartbeat_timeout_s: int = 60  # a lost peer ends the job within about this
    shutdown_timeout_s: int = 300  # how long the exit barrier waits for the slowest process

    def __post_init__(self):
        _positive("distributed", self, "init_timeout_s", "heartbeat_timeout_s")
        _positive("distributed", self, "shutdown_timeout_s")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "run"
    target_path: str | None = None  # HF directory; None → the embedded tiny target
    target_shape: str | None = None  # planner preset name when the weights are elsewhere
    embedded_preset: str = "tiny"  # which embedded target/corpus when target_path is None
    run_dir: str | None = None  # None → runs/<name>-<timestamp>
    seed: int = 0
    mesh: tuple[int, int, int] = (-1, 1, 1)  # (data, fsdp, tensor); one -1 fills
    batch_size: int = 8  # global sequences per step
    seq_len: int = 128  # prompt + response tokens per training sequence
    num_anchors: int = 8  # blocks per sequence (stage 1 and stage 2)
    compute_dtype: str = "float32"  # master weights are always float32
    # Blocks per chunk of the loss's full-vocabulary logits (0: all blocks at once); a chunk's
    # logits are rematerialised in the backward pass (losses.position_stats).
    loss_chunk: int = 0
    # Drafter training attention: "sparse" (block→context in chunks of `attention_chunk`
    # context keys + block→own block; memory ~ N·K·chunk) or "dense" (the whole
    # [N·K, S + N·K] score matrix under a mask). Same result (drafter/train_attention.py).
    train_attention: str = "sparse"
    attention_chunk: int = 512
    data: DataSpec = DataSpec()
    draft: DraftSpec = DraftSpec()
    stage1: Stage1Spec = Stage1Spec()
    head_init: HeadInitSpec = HeadInitSpec()
    stage2: Stage2Spec = Stage2Spec()
    eval: EvalSpec = EvalSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    distributed: DistributedSpec = DistributedSpec()
    log_every: int = 10
    # Train steps in a row with a non-finite loss or gradient (each skipped: the weights and
    # optimizer state stay as they were) that stop the run, checked at log points.
    max_nonfinite_steps: int = 10

    def __post_init__(self):
        object.__setattr__(self, "mesh", check_mesh(self.mesh))
        _positive("run", self, "batch_size", "seq_len", "num_anchors", "log_every")
        _positive("run", self, "loss_chunk", allow_zero=True)
        _positive("run", self, "attention_chunk")
        if self.train_attention not in ("sparse", "dense"):
            raise ConfigError(
                f"train_attention must be 'sparse' or 'dense', got {self.train_attention!r}"
            )
        if self.compute_dtype not in DTYPES:
            raise ConfigError(f"compute_dtype must be one of {DTYPES}, got {self.compute_dtype!r}")
        k = self.draft.block_size
        if self.seq_len < k + 2:
            raise ConfigError(f"seq_len {self.seq_len} must exceed draft.block_size {k} + 1")
        if "stage1_long" in self.stage2.methods and self.draft.init_from is not None:
            raise ConfigError(
                "stage2.methods has 'stage1_long', which needs stage 1, but draft.init_from "
                "skips it"
            )
        if 0 < self.eval.long_new_tokens <= self.seq_len:
            raise ConfigError(
                f"eval.long_new_tokens {self.eval.long_new_tokens} must exceed seq_len "
                f"{self.seq_len}: τ by position measures contexts longer than training's"
            )
        if self.data.max_prompt_len + 1 >= self.seq_len:
            raise ConfigError(
                f"data.max_prompt_len {self.data.max_prompt_len} leaves no response room "
                f"in seq_len {self.seq_len}"
            )
