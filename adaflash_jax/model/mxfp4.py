"""MXFP4 weights as gpt-oss checkpoints store its experts (`*_blocks` + `*_scales`, the OCP
microscaling format), dequantized at load (docs/design.md §2.3).

Dimensions: E experts, O a weight's output features, I its input features, G = I / 32 scale
groups, 16 bytes per group (two 4-bit values a byte).

A tensor `X` [E, I, O] (transformers' GptOssExperts layout: gate_up_proj [E, D, 2F],
down_proj [E, F, D]) is stored as `X_blocks` uint8 [E, O, G, 16] and `X_scales` uint8
[E, O, G]: input feature 32·g + 2·j of output o is the E2M1 value of byte j's low nibble, 32·g
+ 2·j + 1 that of its high nibble, each times 2^(scale − 127). Every such value is exact in
float32 and bfloat16.
"""

from __future__ import annotations

import numpy as np

# E2M1: sign bit, 2 exponent bits, 1 mantissa bit
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
GROUP = 32  # input features per scale
SCALE_BIAS = 127


def dequantize(blocks_xGx16: np.ndarray, scales_xG: np.ndarray) -> np.ndarray:
    """float32 [..., G·32] of MXFP4 blocks [..., G, 16] and their scales [..., G]."""
    blocks = np.asarray(blocks_xGx16, np.uint8)
    scales = np.asarray(scales_xG, np.uint8).astype(np.int32) - SCALE_BIAS
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match"
        )
    values = np.empty((*blocks.shape[:-1], GROUP), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales[..., None])
    return values.reshape(*blocks.shape[:-2], -1)


class Mxfp4Weight:
    """A stored MXFP4 tensor read lazily as the float32 weight [E, I, O] it encodes: a read
    dequantizes only the experts and output features asked for (every input feature)."""

    def __init__(self, blocks_view, scales_view):
        e, o, g, _ = blocks_view.shape
        self._blocks, self._scales = blocks_view, scales_view
        self.shape = (e, g * GROUP, o)
        self.ndim = 3

    def __getitem__(self, index) -> np.ndarray:
        experts, inner, outer = index
        lo, hi, step = outer.indices(self.shape[2])
        rows = slice(lo, max(hi, lo))  # contiguous, then stepped here
        e_lo, e_hi, e_step = experts.indices(self.shape[0])
        whole = slice(None)
        blocks = np.asarray(self._blocks[slice(e_lo, e_hi), rows, whole, whole])
        scales = np.asarray(self._scales[slice(e_lo, e_hi), rows, whole])
        blocks, scales = blocks[::e_step, ::step], scales[::e_step, ::step]
        return dequantize(blocks, scales)[:, :, inner].transpose(0, 2, 1)
