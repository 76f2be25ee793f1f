"""The reference AdaFlash recipe for Qwen3-Coder-30B-A3B (a mixture of experts) on a Cloud TPU
v5p slice: `qwen3_8b_v5p.py` with the reference's drafter for this target.

Target: 48 layers, D 2048, 32 q / 4 kv heads of 128, every layer 128 experts of F 768 with 8
per token (3.3e9 active of 30.5e9 parameters), rope theta 1e7. Drafter (the reference's
configs/qwen3-coder-30b-dflash-thresh-head.json): 8 Qwen3 layers, hidden 2048, MLP 6144
(the target's dense intermediate_size), 32 q / 4 kv heads of 128, block 16, features from
target layers [1, 12, 23, 34, 45] (docs/design.md §2 defaults for 48 layers), mask token 151669,
two-model length head (bottleneck 256). Optimisers, α, τ, T and the stage-2 schedule are the
8B recipe's (the reference runs the same pipeline script for both targets).

Mesh: weights FSDP-sharded over 8 chips (whole experts per chip: 16 of the 128), the rest
data parallel. Compile-check it without a TPU:
`python -m experiments.tpu_compile --config experiments/configs/qwen3_coder_30b_a3b_v5p.py
--topology v5p-64` (BENCHMARKS.md §6.2).
"""

from adaflash_jax.distill.config import (
    CheckpointSpec,
    DataSpec,
    DraftSpec,
    EvalSpec,
    HeadInitSpec,
    RunConfig,
    Stage1Spec,
    Stage2Spec,
)


def get_config() -> RunConfig:
    return RunConfig(
        name="qwen3_coder_30b_a3b_v5p",
        target_path="~/models/Qwen3-Coder-30B-A3B-Instruct",
        target_shape="qwen3-coder-30b-a3b",
        mesh=(-1, 8, 1),
        batch_size=64,
        seq_len=2048,
        num_anchors=64,
        compute_dtype="bfloat16",
        data=DataSpec(
            train_prompts="data/prompts_train.jsonl",
            eval_prompts="data/prompts_eval.jsonl",
            chat_template=True,
            train_per_domain=20_000,
            eval_per_domain=128,
            max_prompt_len=1024,
            max_new_tokens=1024,
            regen_batch=256,
        ),
        draft=DraftSpec(
            layers=8,
            block_size=16,
            target_layer_ids=(1, 12, 23, 34, 45),
            mask_token_id=151669,  # first spare row of Qwen3's padded 151936-row table
            accept_dim=0,
        ),
        stage1=Stage1Spec(steps=20_000, lr=6e-4, warmup_fraction=0.04, weight_decay=0.01),
        head_init=HeadInitSpec(steps=1000, lr=5e-5, num_anchors=64, anchors="sequence"),
        stage2=Stage2Spec(
            rounds=10,
            steps_per_round=80,
            prompts_per_round=2560,
            lr=3e-4,
            head_lr=2e-4,
            alpha=0.8,
            tau=0.01,
            temperature=1.0,
            collector="engine",
            collect_slots=256,
        ),
        eval=EvalSpec(backend="engine", slots=128),
        checkpoint=CheckpointSpec(every=500, keep=3),
        log_every=20,
    )
