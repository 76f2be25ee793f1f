"""The distillation run config: one frozen dataclass tree, its fields checked as it is built.

A config file (`experiments/configs/<name>.py`) defines `get_config() -> RunConfig`
(`distill/config_file.py` loads it, `distill/overrides.py` applies `stage1.steps=10`). Each
spec's `__post_init__` checks ranges and names; what needs the devices and the target is
checked by `distill/checks.py`, and what the config implies for shapes by `distill/shapes.py`.
The training stages' specs (stage 1, head init, stage 2 and its methods) are in
`distill/stage_config.py`.
"""

from __future__ import annotations

import dataclasses
import math

from adaflash_jax.distill.stage_config import (
    COLLECTORS,
    HeadInitSpec,
    Stage1Spec,
    Stage2Spec,
    positive,
)
from adaflash_jax.drafter.config import DEFAULT_ACCEPT_DIM
from adaflash_jax.model.config import ConfigError
from adaflash_jax.train.mesh_shape import check_mesh

MAX_BLOCK_SIZE = 32
DTYPES = ("float32", "bfloat16")


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
        positive(
            "data",
            self,
            "train_per_domain",
            "eval_per_domain",
            "max_prompt_len",
            "max_new_tokens",
            "regen_batch",
        )
        positive("data", self, "max_bad_lines", allow_zero=True)
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
            positive("draft", self, "intermediate_size")
        positive("draft", self, "layers", "num_features")
        positive("draft", self, "accept_dim", allow_zero=True)
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(
                f"draft.block_size {self.block_size} is not supported: the drafter needs "
                f"2 <= block_size <= {MAX_BLOCK_SIZE}"
            )


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
        positive("eval", self, "slots", "long_per_domain")
        positive("eval", self, "long_new_tokens", allow_zero=True)
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
        positive("checkpoint", self, "every", "keep")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedSpec:
    """jax.distributed's runtime timeouts on a multi-process run (docs/design.md §4.4): a
    process that stops heartbeating for `heartbeat_timeout_s` is declared lost and every
    other process is ended, instead of hanging in a collective."""

    init_timeout_s: int = 300  # every process must have joined the coordinator by then
    heartbeat_timeout_s: int = 60  # a lost peer ends the job within about this
    shutdown_timeout_s: int = 300  # how long the exit barrier waits for the slowest process

    def __post_init__(self):
        positive("distributed", self, "init_timeout_s", "heartbeat_timeout_s")
        positive("distributed", self, "shutdown_timeout_s")


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
        positive("run", self, "batch_size", "seq_len", "num_anchors", "log_every")
        positive("run", self, "loss_chunk", allow_zero=True)
        positive("run", self, "attention_chunk")
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
