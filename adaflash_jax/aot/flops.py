"""Useful model FLOPs of one train step: the numerator of model FLOPs utilisation (MFU).

Dimensions: B sequences per step, S sequence length, N anchors per sequence, K block size,
P = K − 1 label positions per block, D width, F MLP width, H query heads, Kv kv heads,
Dh head dim, V vocab, L target layers, Ld drafter layers, nD concatenated features.

Useful (a multiply-add is 2 FLOPs): the target's forward over all B·S tokens (active
weights only, causal attention, no LM head), the teacher logits at the B·N·P label positions
(stage 2), the drafter's forward and its logits; the backward counts 2× the forward of what
is trained and 1× the logits. Masked-out work the code still computes is not useful. Every
term: docs/design.md §7e.
"""

from __future__ import annotations

from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.train_attention import flops_left_out
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.delta_rule import DEFAULT_CHUNK


def _layer_matmul(d: int, f: int, h: int, kv: int, dh: int) -> int:
    """Matmul weights of one Qwen3/Llama decoder layer (q, k, v, o, gate, up, down)."""
    return 2 * d * h * dh + 2 * d * kv * dh + 3 * d * f


def _mixer_active(t: TargetConfig, layer: int) -> int:
    """Matmul weights of layer `layer`'s token mixer: attention (q_proj twice as wide when it
    carries the hybrids' output gate) or a Gated DeltaNet's projections."""
    d = t.hidden_size
    if t.is_linear_layer(layer):
        j, dv = t.linear_num_value_heads, t.linear_value_head_dim
        x = 2 * t.linear_num_key_heads * t.linear_key_head_dim + j * dv
        return d * x + d * j * dv + 2 * d * j + j * dv * d
    h, kv, dh = t.num_attention_heads, t.num_key_value_heads, t.head_dim
    gate = d * h * dh if t.is_hybrid else 0
    return _layer_matmul(d, 0, h, kv, dh) + gate


def target_layer_active(t: TargetConfig, layer: int) -> int:
    """Matmul weights one token multiplies in target layer `layer` (active parameters)."""
    d = t.hidden_size
    if not t.is_moe_layer(layer):
        return _mixer_active(t, layer) + 3 * d * t.intermediate_size
    routed = t.num_experts_per_tok * 3 * d * t.moe_intermediate_size
    shared = (
        3 * d * t.shared_expert_intermediate_size + d if t.shared_expert_intermediate_size else 0
    )
    return _mixer_active(t, layer) + d * t.num_experts + routed + shared


def delta_rule_token(dk: int, dv: int, tokens: int, chunk: int = DEFAULT_CHUNK) -> float:
    """FLOPs of the chunked gated delta rule per token and value head over `tokens` tokens
    (`model/delta_rule.chunked_form`, Tc = min(chunk, tokens)): the state reads by w and q
    and the state write (3 × 2·Dk·Dv), and per causal in-chunk pair (Tc + 1)/2 on average
    the k·k and q·k products (2·Dk each), the triangular solve over Dk + Dv right-hand
    columns (2·(Dk + Dv)) and the q·k-weighted values (2·Dv)."""
    tc = min(chunk, tokens)
    return 6.0 * dk * dv + (tc + 1) / 2 * (6 * dk + 4 * dv)


def target_forward(t: TargetConfig, b: int, s: int, chunk: int = DEFAULT_CHUNK) -> float:
    """The target's forward over B sequences of S tokens (DeltaNet chunks of `chunk`)."""
    layers = range(t.num_hidden_layers)
    active = sum(target_layer_active(t, i) for i in layers)
    linear = sum(t.is_linear_layer(i) for i in layers)
    attention = 4.0 * t.num_attention_heads * t.head_dim * b * s * (s + 1) / 2
    out = 2.0 * active * b * s + (t.num_hidden_layers - linear) * attention
    if linear:
        j, dk, dv = t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
        x = 2 * t.linear_num_key_heads * dk + j * dv
        per_token = j * delta_rule_token(dk, dv, s, chunk) + 2.0 * t.linear_conv_kernel_dim * x
        out += linear * per_token * b * s
    return out


def drafter_forward(dc: DrafterConfig, b: int, s: int, n: int) -> float:
    d, k = dc.hidden_size, dc.block_size
    h, kv, dh = dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim
    q = b * n * k  # block tokens
    fc = 2.0 * dc.num_features * d * d * b * s
    per_layer = (
        2.0 * d * 2 * kv * dh * b * s  # context keys/values
        + 2.0 * _layer_matmul(d, dc.intermediate_size, h, kv, dh) * q
        + 4.0 * h * dh * q * (s / 2 + k)  # visible context (S/2 on average) + own block
    )
    return fc + dc.num_hidden_layers * per_layer


def logits(d: int, v: int, positions: int) -> float:
    return 2.0 * d * v * positions


def train_step(kind: str, t: TargetConfig, dc: DrafterConfig, b: int, s: int, n: int) -> float:
    """Useful FLOPs of one step of `kind` (stage1 | head_init | stage2) over the whole batch."""
    labels = b * n * (dc.block_size - 1)
    lm = logits(t.hidden_size, t.vocab_size, labels)
    total = target_forward(t, b, s)
    if kind == "stage1":
        return total + 3 * drafter_forward(dc, b, s, n) + 2 * lm
    if kind == "head_init":  # the drafter's forward and logits, no teacher logits
        return total + drafter_forward(dc, b, s, n) + lm
    if kind == "stage2":
        return total + lm + 3 * drafter_forward(dc, b, s, n) + 2 * lm
    raise ValueError(f"unknown step kind {kind!r}")


# FLOPs per label position of one loss chunk (`losses.position_stats`, logits 2·D·V each):
# stage 1 computes the student's logits, recomputes them in the backward (jax.checkpoint)
# and back-propagates to the hidden state: 3 × 2DV; stage 2 adds the teacher's logits to the
# forward and to the recomputation: 5 × 2DV; head init runs it forward only: 1 × 2DV.
_LOSS_CHUNK_LOGITS = {"stage1": 3, "stage2": 5, "head_init": 1}


def loop_flops_left_out(
    kind: str, t: TargetConfig, dc: DrafterConfig, b: int, s: int, n: int, *,
    loss_chunk: int, attention: str, attention_chunk: int,
) -> float:  # fmt: skip
    """FLOPs of one train step (whole batch) that XLA's cost analysis does not count.

    The cost analysis counts a loop's body once. Two loops of the step repeat real work: the
    loss over `loss_chunk` blocks at a time (`lax.map`: ⌈N / chunk⌉ iterations) and, with
    the sparse training attention, each drafter layer's block → context attention over
    `attention_chunk` keys at a time (`train_attention.flops_left_out`). This returns every
    iteration but the counted one, so the compiler's FLOPs plus this is the step's matmul work.
    """
    if kind not in _LOSS_CHUNK_LOGITS:
        raise ValueError(f"unknown step kind {kind!r}")
    out = 0.0
    if 0 < loss_chunk < n:
        iterations = -(-n // loss_chunk)
        per_chunk = logits(t.hidden_size, t.vocab_size, b * loss_chunk * (dc.block_size - 1))
        out += (iterations - 1) * _LOSS_CHUNK_LOGITS[kind] * per_chunk
    if attention == "sparse":
        per_layer = flops_left_out(
            b, n * dc.block_size, s, dc.num_attention_heads, dc.head_dim, attention_chunk,
            backward=kind != "head_init",
        )  # fmt: skip
        out += dc.num_hidden_layers * per_layer
    return float(out)
