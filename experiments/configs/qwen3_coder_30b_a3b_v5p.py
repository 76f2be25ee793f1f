"""The reference AdaFlash recipe for Qwen3-Coder-30B-A3B (a mixture of experts) on a Cloud TPU
v5p slice: `qwen3_8b_v5p.py` with the reference's drafter for this target.

Target: 48 layers, D 2048, 32 q / 4 kv heads of 128, every layer 128 experts of F 768 with 8
per token (3.3e9 active of 30.5e9 parameters), rope theta 1e7. Drafter (the reference's
configs/qwen3-coder-30b-dflash-thresh-head.json): 8 Qwen3 layers, hidden 2048, MLP 6144
(the target's dense intermediate_size), 32 q / 4 kv heads of 128, block 16, features from
target layers [1, 12, 23, 34, 45] (docs/design.md §2 defaults for 48 layers), mask token 151669,
two-model length head (bottleneck 256). Optimisers, α, τ, T, the stage-2 schedule and the
training layout (512 anchors per sequence as the reference trains, sparse drafter attention,
loss chunks of 32) are the 8B recipe's (the reference runs the same pipeline script for both
targets): this file is `qwen3_8b_v5p.get_config()` with the target and the drafter replaced.

Mesh: weights FSDP-sharded over 8 chips (whole experts per chip: 16 of the 128), the rest
data parallel; each chip routes its own rows' tokens (`model/moe.py`). Compile-check it
without a TPU: `python -m experiments.tpu_compile --config
experiments/configs/qwen3_coder_30b_a3b_v5p.py --topology v5p-64` (BENCHMARKS.md §6.2).
"""

import dataclasses

from adaflash_jax.distill.config import RunConfig
from experiments.configs import qwen3_8b_v5p


def get_config() -> RunConfig:
    base = qwen3_8b_v5p.get_config()
    return dataclasses.replace(
        base,
        name="qwen3_coder_30b_a3b_v5p",
        target_path="~/models/Qwen3-Coder-30B-A3B-Instruct",
        target_shape="qwen3-coder-30b-a3b",
        draft=dataclasses.replace(base.draft, layers=8, target_layer_ids=(1, 12, 23, 34, 45)),
    )
