"""Per-device HBM estimate of an AdaFlash distillation run: one train step and one on-policy
collection phase, which alternate in one SPMD program and so never hold their temporaries
at the same time. `estimate` computes exactly the formulas of docs/design.md §7c; peak =
persistent + max(train, collect), and a plan fits when peak <= HBM · (1 − headroom).
"""

from __future__ import annotations

import dataclasses

from adaflash_jax.plan.inputs import PlanInputs
from adaflash_jax.plan.params import (
    drafter_params,
    per_device_bytes,
    target_layer_params,
    target_params,
)
from adaflash_jax.sharding.rules import DECODE_RULES, TRAIN_RULES

GIB = 1 << 30
PHASES = ("persistent", "train", "collect")


@dataclasses.dataclass(frozen=True)
class Term:
    phase: str
    name: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    terms: tuple[Term, ...]

    def phase_bytes(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if t.phase == phase)

    def term(self, name: str, phase: str | None = None) -> int:
        return sum(t.bytes for t in self.terms if t.name == name and phase in (None, t.phase))

    @property
    def peak_bytes(self) -> int:
        p = self.phase_bytes
        return p("persistent") + max(p("train"), p("collect"))

    def fits(self, hbm_bytes: float, headroom: float = 0.1) -> bool:
        return self.peak_bytes <= hbm_bytes * (1.0 - headroom)


def _split(n: int, t: int) -> int:
    """A dimension split over the tensor axis when it divides (the rule tables' behaviour)."""
    return n // t if n % t == 0 else n


def _conv_channels(t) -> int:
    """X: a Gated DeltaNet's conv channels (q, k and v before the conv)."""
    return 2 * t.linear_num_key_heads * t.linear_key_head_dim + (
        t.linear_num_value_heads * t.linear_value_head_dim
    )


def recurrent_state_bytes(t) -> int:
    """One row's decode state in one Gated DeltaNet layer: the delta rule's [J, Dk, Dv] and the
    conv history [A − 1, X], both float32 (`model/recurrent_state.RecurrentState`)."""
    j, dk, dv = t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
    return 4 * (j * dk * dv + (t.linear_conv_kernel_dim - 1) * _conv_channels(t))


def estimate(inp: PlanInputs) -> MemoryPlan:
    tgt, dr = inp.target, inp.drafter
    data, fsdp, t = inp.mesh
    a = inp.compute_bytes
    rules = TRAIN_RULES if inp.target_rules == "train" else DECODE_RULES
    d, dh, n_feat = tgt.hidden_size, tgt.head_dim, dr.num_features
    h_t, kv_t = _split(tgt.num_attention_heads, t), _split(tgt.num_key_value_heads, t)
    f_t, v_t = _split(tgt.intermediate_size, t), _split(tgt.vocab_size, t)
    dh_t, dkv_t = _split(dr.num_attention_heads, t), _split(dr.num_key_value_heads, t)
    df_t = _split(dr.intermediate_size, t)
    naive = inp.attention == "naive"
    terms: list[Term] = []
    add = lambda phase, name, b: terms.append(Term(phase, name, int(b)))  # noqa: E731

    # ---- persistent state -----------------------------------------------------------------
    add(
        "persistent",
        "target params (compute dtype)",
        per_device_bytes(target_params(tgt), a, inp.mesh, rules),
    )
    drafter_w = per_device_bytes(drafter_params(dr), 4, inp.mesh, TRAIN_RULES)
    add("persistent", "drafter params (fp32 master)", drafter_w)
    add("persistent", "drafter grads (fp32)", drafter_w)
    add("persistent", "AdamW moments (2 x fp32)", 2 * drafter_w)

    # One target layer all-gathered over fsdp (double-buffered so the next gather overlaps),
    # and the LM head the teacher, the drafter and the verify read whole (the compiled 8B
    # stage-2 step holds it as one bf16[D, V] buffer).
    gathered, head = 0, 0
    if fsdp > 1 and inp.target_rules == "train":
        gathered = 2 * per_device_bytes(target_layer_params(tgt), a, (1, 1, t), rules)
        head = d * v_t * a

    # ---- train step -----------------------------------------------------------------------
    b, s, k = inp.batch_size // inp.batch_shards, inp.seq_len, inp.block_size
    q = inp.num_anchors * k
    nc = min(inp.num_anchors, inp.logits_chunk or inp.num_anchors)
    per_tok = 3 * d + (2 * h_t + 2 * kv_t) * dh + 3 * f_t
    # the target's attention materialises its scores (no fused kernel in this code base)
    layer = b * s * a * per_tok + b * s * s + b * h_t * s * s * (4 + a)
    add("train", "target layers gathered over fsdp (2)", gathered)
    add("train", "LM head gathered over fsdp", head)
    add("train", "target forward: one layer's temporaries", layer)
    add("train", "target outputs (features + final hidden)", b * s * (n_feat + 1) * d * a)
    add("train", "logits (teacher + student + grad, fp32)", 4 * b * nc * (k - 1) * v_t * 4)
    per_layer = (
        b * q * a * (4 * d + 2 * dh_t * dr.head_dim + 2 * dkv_t * dr.head_dim + 3 * df_t)
        + b * s * a * 2 * dkv_t * dr.head_dim
    )
    saved = dr.num_layers * b * q * d * a + per_layer if inp.remat else dr.num_layers * per_layer
    add("train", "drafter activations", saved + b * s * 2 * d * a + b * q * d * a)
    if naive:
        attn_layers = 1 if inp.remat else dr.num_layers
        scores = attn_layers * b * dh_t * q * (s + q) * (4 + a) + b * q * (s + q)
        add("train", "drafter attention scores (naive)", scores)

    # ---- on-policy collection -------------------------------------------------------------
    r, c, p = inp.slots // inp.collect_shards, inp.capacity, inp.prompt_len
    linear = sum(tgt.is_linear_layer(i) for i in range(tgt.num_hidden_layers))
    attends = tgt.num_hidden_layers - linear
    state = linear * r * recurrent_state_bytes(tgt)
    add("collect", "target KV cache", attends * 2 * r * c * kv_t * dh * a)
    if linear:
        add("collect", "target recurrent state (fp32)", state)
    add("collect", "drafter context K/V cache", dr.num_layers * 2 * r * c * dkv_t * dr.head_dim * a)
    # the prefill writes R fresh caches (target + drafter context) before scattering them in
    fresh = (attends * kv_t * dh + dr.num_layers * dkv_t * dr.head_dim) * 2 * r * c * a + state
    prefill = r * p * a * (per_tok + n_feat * d) + r * h_t * p * c * (4 + a)
    prefill += fresh
    verify = 2 * r * k * v_t * 4 + r * h_t * k * c * (4 + a)
    if linear:
        j, dk, dv = tgt.linear_num_value_heads, tgt.linear_key_head_dim, tgt.linear_value_head_dim
        verify += linear * r * k * (_conv_channels(tgt) + j * (dk + dv + 2)) * 4
    add("collect", "target layers gathered over fsdp (2)", gathered)
    add("collect", "LM head gathered over fsdp", head)
    add("collect", "prefill/verify temporaries", max(prefill, verify))
    return MemoryPlan(inputs=inp, terms=tuple(terms))


def format_plan(plan: MemoryPlan, hbm_gib: float, headroom: float = 0.1) -> str:
    """Human-readable per-device breakdown and verdict."""
    inp = plan.inputs
    lines = [
        f"mesh (data, fsdp, tensor) = {inp.mesh} on {inp.devices} devices; "
        f"batch {inp.batch_size} x seq {inp.seq_len}, {inp.num_anchors} anchors x block "
        f"{inp.block_size}, drafter {inp.drafter.num_layers} layers, remat={inp.remat}, "
        f"attention={inp.attention}",
        "FORMULA estimate (plan/memory_estimate.py, no compile; `--compile SLICE` checks it "
        "against the compiler):",
        f"{'phase':<11} {'term':<44} {'GiB/device':>10}",
    ]
    for term in plan.terms:
        lines.append(f"{term.phase:<11} {term.name:<44} {term.bytes / GIB:>10.2f}")
    for phase in PHASES:
        lines.append(f"{'':<11} {'total ' + phase:<44} {plan.phase_bytes(phase) / GIB:>10.2f}")
    budget = hbm_gib * (1 - headroom)
    verdict = "FITS" if plan.fits(hbm_gib * GIB, headroom) else "DOES NOT FIT"
    lines.append(
        f"peak (FORMULA) = persistent + max(train, collect) = {plan.peak_bytes / GIB:.2f} GiB; "
        f"budget {budget:.2f} GiB ({hbm_gib:g} GiB HBM, {headroom:.0%} headroom): {verdict}"
    )
    return "\n".join(lines)
