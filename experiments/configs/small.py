"""One GPU: the embedded `small` target (D 768, 12 layers, bf16), a 3-layer K=16 drafter.

Collection and evaluation run the real speculative-decoding engine. Per-batch Nw is ~3.5k
(32 sequences × 32 blocks × Σw≈5.7 at K=16, γ=7 … times the response share), close to the
reference's, so τ keeps the reference value 0.01.
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
        name="small",
        embedded_preset="small",
        mesh=(-1, 1, 1),
        batch_size=32,
        seq_len=512,
        num_anchors=32,
        compute_dtype="bfloat16",
        data=DataSpec(
            train_per_domain=512,
            eval_per_domain=64,
            max_prompt_len=256,
            max_new_tokens=256,
            regen_batch=128,
        ),
        draft=DraftSpec(layers=3, block_size=16, num_features=5),
        stage1=Stage1Spec(steps=3000, lr=6e-4),
        head_init=HeadInitSpec(steps=300, lr=1e-3),
        stage2=Stage2Spec(
            rounds=4,
            steps_per_round=300,
            prompts_per_round=256,
            collector="engine",
            collect_slots=64,
        ),
        eval=EvalSpec(backend="engine", slots=64),
        checkpoint=CheckpointSpec(every=500),
        log_every=50,
    )
