"""The reference AdaFlash recipe for Qwen3-8B on a Cloud TPU v5p slice (docs/design.md §3, §4).

Drafter: 5 Qwen3 layers as wide as the target, block 16 (γ = 7), features from target layers
[1, 9, 17, 25, 33], no acceptance network (not part of the reference; `--set
draft.accept_dim=64` adds one). Stage 1 (DFlash): AdamW lr 6e-4, cosine, 4% warm-up, clip
1.0. Head init (the reference's offline init): lr 5e-5, AdamW β (0.9, 0.999), decay 0.01 on
every parameter, 64 anchors per sequence over the whole sequence, no clip. Stage 2
(AdaFlash): anchors uniform over each response, fresh prompts every round, constant lr 3e-4
(drafter) / 2e-4 (length head), AdamW β (0.9, 0.999), decay 0.01 on every parameter, one clip
1.0 over drafter + head, α 0.8, τ 0.01, T 1. Each round collects 2,560 new prompts and trains
80 steps of 64 sequences on them: 2 epochs per buffer, as the reference (128 samples per
round at a global batch of 4, `TRAIN_BUFFER_EPOCHS=2`); 10 rounds see 25,600 prompts. The
reference run starts stage 2 from a published DFlash drafter: `--init-drafter DIR` (stage 1
is then skipped; the length head starts fresh).

Anchors: 512 per sequence in stages 1 and 2, as the reference. They fit a v5p chip through the
block-sparse training attention (`train_attention="sparse"`, 512 context keys at a time) and
the chunked losses (`loss_chunk=32` blocks: one chunk's [2, 32, 15, V] logits live at once);
the compiled table is in BENCHMARKS.md §5.

The KL clip in nats (losses.py): τ·Nw per sequence, Nw = Σ decay weights of its blocks
(6.63 per full K = 16 block). 512 anchors cap a position's KL at 34 nats in a full sequence
(a response with 185 admissible anchors: 12); `--set num_anchors=64` gives 4.2 nats.

Mesh: weights FSDP-sharded over 8 chips, the rest data parallel (-1 fills: a v5p-64 slice
has 32 chips → (4, 8, 1)). Check a slice with
`python -m experiments.plan --config experiments/configs/qwen3_8b_v5p.py --devices 32`.
`target_path` is where tpu/setup.sh --sync-model puts the HF directory on every worker.
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
        name="qwen3_8b_v5p",
        target_path="~/models/Qwen3-8B",
        target_shape="qwen3-8b",
        mesh=(-1, 8, 1),
        batch_size=64,
        seq_len=2048,
        num_anchors=512,
        loss_chunk=32,
        train_attention="sparse",
        attention_chunk=512,
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
            layers=5,
            block_size=16,
            target_layer_ids=(1, 9, 17, 25, 33),
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
