"""The reference AdaFlash recipe for Qwen3.5-9B (a hybrid Gated-DeltaNet target) on a Cloud TPU
v5p slice: `qwen3_8b_v5p.py` with this target and the reference's drafter for it.

Target (docs/design.md §2.1): 32 layers, D 4096, every 4th layer gated full attention (16 q /
4 kv heads of 256, partial RoPE 0.25), the other 24 Gated DeltaNets (16 key / 32 value heads
of 128, conv 4 taps), dense MLP F 12288, V 248320, rope theta 1e7. Drafter (the reference's
configs/qwen3.5-9b-dflash-thresh-head.json): 5 Qwen3 layers, hidden 4096, 32 q / 8 kv heads
of 128 (not the target's 16 / 4 of 256: `draft.heads`), MLP 12288, block 16, features from
target layers [1, 8, 15, 22, 29] (docs/design.md §2 defaults), mask token 248070, rope
theta 1e7 (the target's), two-model length head (bottleneck 256). Optimisers, α, τ, T, the
stage-2 schedule and the training layout (512 anchors per sequence, K = 16, seq 2048, sparse
drafter attention, loss chunks of 32) are the 8B recipe's: this file is
`qwen3_8b_v5p.get_config()` with the target and the drafter replaced.

Mesh: weights FSDP-sharded over 8 chips, the rest data parallel. Compile-check it without a
TPU: `python -m experiments.tpu_compile --config experiments/configs/qwen3_5_9b_v5p.py
--topology v5p-64` (BENCHMARKS.md §10; compiler estimates).
"""

import dataclasses

from adaflash_jax.distill.config import RunConfig
from experiments.configs import qwen3_8b_v5p


def get_config() -> RunConfig:
    base = qwen3_8b_v5p.get_config()
    return dataclasses.replace(
        base,
        name="qwen3_5_9b_v5p",
        target_path="~/models/Qwen3.5-9B",
        target_shape="qwen3.5-9b",
        draft=dataclasses.replace(
            base.draft,
            layers=5,
            target_layer_ids=(1, 8, 15, 22, 29),
            mask_token_id=248070,
            heads=(32, 8, 128),
            intermediate_size=12288,
        ),
    )
