"""The AdaFlash recipe for Qwen3.6-35B-A3B (a hybrid Gated-DeltaNet mixture of experts) on a
Cloud TPU v5p slice: `qwen3_8b_v5p.py` with this target and z-lab's DFlash drafter shape for it.

Target (docs/design.md §2.1): 40 layers, D 2048, every 4th layer gated full attention (16 q /
2 kv heads of 256, partial RoPE 0.25), the other 30 Gated DeltaNets (16 key / 32 value heads
of 128), every layer 256 experts of F 512 with 8 per token plus a gated shared expert of
F 512, V 248320, rope theta 1e7. Drafter: z-lab/Qwen3.6-35B-A3B-DFlash's shape (its
config.json at revision 42d3b34, as quoted by third-party parsers and docs of that checkpoint;
the file itself was not read here): 8 Qwen3 layers, hidden 2048, MLP 6144, 32 q / 4 kv heads
of 128 (`draft.heads`: the target has 16 / 2 of 256), block 16, features from target layers
[1, 10, 19, 28, 37] (docs/design.md §2 defaults), mask token 248070. That is also the
reference's Coder-30B drafter shape (`qwen3_coder_30b_a3b_v5p.py`). The AdaFlash reference
ships no recipe for this target: the two-model length head (bottleneck 256), optimisers, α,
τ, T, the stage-2 schedule and the training layout (512 anchors per sequence, K = 16, seq
2048, sparse drafter attention, loss chunks of 32) are the 8B recipe's.

Mesh: weights FSDP-sharded over 8 chips (whole experts per chip: 32 of the 256), the rest
data parallel. Compile-check it without a TPU: `python -m experiments.tpu_compile --config
experiments/configs/qwen3_6_35b_a3b_v5p.py --topology v5p-64` (BENCHMARKS.md §10; compiler
estimates).
"""

import dataclasses

from adaflash_jax.distill.config import RunConfig
from experiments.configs import qwen3_8b_v5p


def get_config() -> RunConfig:
    base = qwen3_8b_v5p.get_config()
    return dataclasses.replace(
        base,
        name="qwen3_6_35b_a3b_v5p",
        target_path="~/models/Qwen3.6-35B-A3B",
        target_shape="qwen3.6-35b-a3b",
        draft=dataclasses.replace(
            base.draft,
            layers=8,
            target_layer_ids=(1, 10, 19, 28, 37),
            mask_token_id=248070,
            heads=(32, 4, 128),
            intermediate_size=6144,
        ),
    )
