"""Training losses and metrics of DFlash stage 1 and AdaFlash stage 2 (docs/design.md §4).

Dimensions: B batch, N blocks (anchors) per sequence, P = K−1 predicted positions per block
(block position k = 1..K−1 predicts the token at anchor + k), D model, V vocab, C blocks per
loss chunk.

Two layers. `position_stats` turns drafter states into per-position numbers (CE against the
label, the divergence from the teacher, argmaxes, confidence features) in chunks of C blocks:
the full-vocabulary logits of one chunk exist at a time, forward and backward (the chunk is
rematerialised), so peak memory does not grow with N·K·V. The loss functions below then only
combine [B, N, P] arrays.

Weights. Position k carries w_k = exp(−(k−1)/γ) times its validity mask.

Per-sequence normalisation (docs/design.md §4.2, as the reference, whose micro-batch is one
sequence). Sequence b has Nw_b = Σ w over ITS valid positions; its loss is Σ w·ℓ / Nw_b; the
batch loss is the mean over the sequences that have a valid position. Long and short
responses weigh the same, and nothing depends on the batch size.

The clip. The KL term of sequence b is Σ w·min(r, τ) with r = T²·KL/Nw_b: τ clips each
position's KL AFTER its division by the sequence's Nw, so one position's KL is capped at
τ·Nw_b/T² nats (reference: τ = 0.01, Nw ≈ 3,400 at 512 anchors of K = 16 → 34 nats). Below the
cap the term is exactly the sequence's weighted mean KL.

Acceptance head (`accept_head_loss`). Draft position i's label is the greedy match m_i
(drafter argmax == label); a_i is conditional on drafts < i being accepted, so only
positions after an unbroken run of matches count.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.drafter.length_head import confidence_features

OBJECTIVES = ("rkl", "fkl", "sft")
DIVERGENCES = ("rkl", "fkl")
_EPS = 1e-9


# ---- weights and normalisation -------------------------------------------------------------
def decay_weights(block_size: int, gamma: float) -> jax.Array:
    """w_k = exp(−(k−1)/γ) for k = 1..K−1 → [P]."""
    k = jnp.arange(1, block_size, dtype=jnp.float32)
    return jnp.exp(-(k - 1.0) / gamma)


def position_weights(mask_BxNxP: jax.Array, gamma: float) -> jax.Array:
    """Decay weights times the validity mask → [B, N, P] float32."""
    w_P = decay_weights(mask_BxNxP.shape[-1] + 1, gamma)
    return w_P * mask_BxNxP.astype(jnp.float32)


def kl_cap_nats(tau: float, num_blocks: int, block_size: int, gamma: float, temperature=1.0):
    """The clip's cap on one position's KL for a sequence of `num_blocks` full blocks:
    τ·Nw/T² nats with Nw = num_blocks·Σ_k w_k (fewer valid positions give a lower cap)."""
    per_block = float(sum(math.exp(-(k - 1) / gamma) for k in range(1, block_size)))
    return tau * num_blocks * per_block / temperature**2


def sequence_normaliser(weights_BxNxP: jax.Array) -> jax.Array:
    """Nw_b = Σ w over sequence b's positions → [B] (0 for a sequence without any)."""
    return jnp.sum(weights_BxNxP, axis=(1, 2))


def mean_over_sequences(per_sequence_B: jax.Array, nw_B: jax.Array) -> jax.Array:
    """Mean over the sequences that have a valid position (an all-padding batch gives 0)."""
    present_B = (nw_B > 0).astype(jnp.float32)
    return jnp.sum(per_sequence_B * present_B) / jnp.maximum(jnp.sum(present_B), 1.0)


def sequence_weighted_mean(values_BxNxP, weights_BxNxP) -> jax.Array:
    """mean_b [Σ w·x / Nw_b]: the reference's per-sequence weighted mean of a position loss."""
    nw_B = sequence_normaliser(weights_BxNxP)
    per_B = jnp.sum(weights_BxNxP * values_BxNxP, axis=(1, 2)) / jnp.maximum(nw_B, _EPS)
    return mean_over_sequences(per_B, nw_B)


# ---- per-position numbers from logits --------------------------------------------------------
def cross_entropy(logits_BxNxPxV: jax.Array, labels_BxNxP: jax.Array) -> jax.Array:
    """Per-position CE in float32 → [B, N, P]."""
    logp = jax.nn.log_softmax(logits_BxNxPxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels_BxNxP[..., None], axis=-1)[..., 0]


def reverse_kl(student_BxNxPxV, teacher_BxNxPxV, temperature=1.0) -> jax.Array:
    """KL(p_S^T ‖ p_T^T) per position over the full vocabulary, float32 → [B, N, P]."""
    log_s = jax.nn.log_softmax(student_BxNxPxV.astype(jnp.float32) / temperature, axis=-1)
    log_t = jax.nn.log_softmax(teacher_BxNxPxV.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(log_s) * (log_s - log_t), axis=-1)


def forward_kl(student_BxNxPxV, teacher_BxNxPxV, temperature=1.0) -> jax.Array:
    """KL(p_T^T ‖ p_S^T) per position, float32 → [B, N, P]."""
    return reverse_kl(teacher_BxNxPxV, student_BxNxPxV, temperature)


@struct.dataclass
class PositionStats:
    """Per-position numbers of one batch of blocks, all [B, N, P]."""

    ce: jax.Array  # float32 CE of the student against `labels`
    kl: jax.Array | None  # float32 T²·divergence from the teacher (None without a teacher)
    labels: jax.Array  # int32: the data token, or the teacher's argmax when there is a teacher
    draft: jax.Array  # int32 student argmax
    max_logprob: jax.Array  # float32, detached (acceptance-head features)
    entropy: jax.Array  # float32, detached


def _chunk_stats(student_h, teacher_h, labels, head_DxV, temperature, divergence, dtype):
    """`PositionStats` fields of one chunk of blocks (see `position_stats`)."""
    head = head_DxV.astype(dtype)
    s_logits = jnp.dot(student_h.astype(dtype), head).astype(jnp.float32)
    max_lp, ent = confidence_features(jax.lax.stop_gradient(s_logits))
    kl = None
    if teacher_h is not None:
        t_logits = jax.lax.stop_gradient(jnp.dot(teacher_h.astype(dtype), head)).astype(jnp.float32)
        labels = jnp.argmax(t_logits, axis=-1).astype(jnp.int32)
        div = reverse_kl if divergence == "rkl" else forward_kl
        kl = temperature**2 * div(s_logits, t_logits, temperature)
    ce = cross_entropy(s_logits, labels)
    draft = jnp.argmax(s_logits, axis=-1).astype(jnp.int32)
    return ce, kl, labels, draft, max_lp, ent


def position_stats(
    student_hidden_BxNxPxD: jax.Array,
    lm_head_DxV: jax.Array,
    labels_BxNxP: jax.Array,
    teacher_hidden_BxNxPxD: jax.Array | None = None,
    *,
    temperature=1.0,
    divergence: str = "rkl",
    chunk: int = 0,
    dtype=jnp.float32,
) -> PositionStats:
    """Per-position CE, divergence and argmaxes, computed `chunk` blocks at a time.

    Logits are `hidden @ lm_head` in `dtype`, softmaxes in float32. With a teacher (its final
    hidden states at ℓ − 1 for every label position ℓ, taken under stop_gradient) the CE label
    is the teacher's argmax and `kl` holds T²·KL (`divergence` "rkl": KL(p_S ‖ p_T), "fkl":
    KL(p_T ‖ p_S), both at temperature T). `chunk` = 0 or ≥ N computes all blocks at once;
    otherwise blocks are padded to a multiple of `chunk` and each chunk's logits are
    rematerialised in the backward pass, so at most one chunk's [B, C, P, V] logits live.
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}; choose from {DIVERGENCES}")
    b, n, p, d = student_hidden_BxNxPxD.shape
    has_teacher = teacher_hidden_BxNxPxD is not None
    head = jax.lax.stop_gradient(lm_head_DxV)
    if chunk <= 0 or chunk >= n:
        out = _chunk_stats(
            student_hidden_BxNxPxD, teacher_hidden_BxNxPxD, labels_BxNxP, head,
            temperature, divergence, dtype,
        )  # fmt: skip
        return PositionStats(*out)
    chunks = -(-n // chunk)
    pad = chunks * chunk - n

    def split(x):  # [B, N, ...] → [chunks, B, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, chunks, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def join(x):  # [chunks, B, C, ...] → [B, N, ...]
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(b, chunks * chunk, *x.shape[3:])[:, :n]

    @jax.checkpoint
    def one(xs):
        s_h, t_h, lab = xs
        return _chunk_stats(s_h, t_h, lab, head, temperature, divergence, dtype)

    t_chunks = split(teacher_hidden_BxNxPxD) if has_teacher else None
    out = jax.lax.map(one, (split(student_hidden_BxNxPxD), t_chunks, split(labels_BxNxP)))
    return PositionStats(*(None if x is None else join(x) for x in out))


# ---- losses --------------------------------------------------------------------------------
def decayed_ce(ce_BxNxP, weights_BxNxP) -> jax.Array:
    """Stage 1 and the `sft` objective: mean_b Σ w·CE / Nw_b."""
    return sequence_weighted_mean(ce_BxNxP, weights_BxNxP)


def accuracy(draft_BxNxP, labels_BxNxP, mask_BxNxP) -> jax.Array:
    """Fraction of valid positions whose argmax is the label (unweighted, pooled)."""
    hit = (draft_BxNxP == labels_BxNxP) & mask_BxNxP
    return jnp.sum(hit) / jnp.maximum(jnp.sum(mask_BxNxP), 1)


def distill_loss(
    ce_BxNxP,
    kl_BxNxP,
    weights_BxNxP,
    *,
    objective: str = "rkl",
    alpha=0.8,
    tau=0.01,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Stage-2 drafter loss: mean_b [α·Σw·CE/Nw_b + (1−α)·Σw·min(KL/Nw_b, τ)].

    `kl_BxNxP` is T²·divergence per position ("rkl" or "fkl", chosen in `position_stats`);
    "sft" is the CE term alone, i.e. continued stage-1 training on on-policy data. Returns
    (loss, parts): the CE and clipped-KL terms, the unclipped weighted-mean KL, the clip
    ratio (share of valid positions with r > τ) and the mean per-sequence cap τ·Nw in nats.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")
    nw_B = sequence_normaliser(weights_BxNxP)
    nw_Bx1x1 = jnp.maximum(nw_B, _EPS)[:, None, None]
    ce_B = jnp.sum(weights_BxNxP * ce_BxNxP, axis=(1, 2)) / nw_Bx1x1[:, 0, 0]
    r_BxNxP = kl_BxNxP / nw_Bx1x1
    clipped_B = jnp.sum(weights_BxNxP * jnp.minimum(r_BxNxP, tau), axis=(1, 2))
    valid_BxNxP = weights_BxNxP > 0
    parts = {
        "ce": mean_over_sequences(ce_B, nw_B),
        "kl_clipped": mean_over_sequences(clipped_B, nw_B),
        "kl_mean": sequence_weighted_mean(kl_BxNxP, weights_BxNxP),
        "clip_ratio": jnp.sum((r_BxNxP > tau) & valid_BxNxP) / jnp.maximum(jnp.sum(valid_BxNxP), 1),
        "kl_cap_nats": mean_over_sequences(tau * nw_B, nw_B),
    }
    if objective == "sft":
        return parts["ce"], parts
    per_B = alpha * ce_B + (1.0 - alpha) * clipped_B
    return mean_over_sequences(per_B, nw_B), parts


def accepted_streak(draft_BxNxP, target_BxNxP, mask_BxNxP) -> jax.Array:
    """A per block: leading valid positions whose draft token equals the target's → [B, N]."""
    ok_BxNxP = (draft_BxNxP == target_BxNxP) & mask_BxNxP
    return jnp.sum(jnp.cumprod(ok_BxNxP.astype(jnp.int32), axis=-1), axis=-1)


def length_head_loss(r_BxN, accepted_BxN, valid_BxN, block_size: int):
    """MSE of the head's r against y = clip((A + 1)/K, 0, 1) over valid blocks; also MAE.

    Pooled over the batch's blocks, as the reference averages over its micro-batch's blocks.
    """
    y_BxN = jnp.clip((accepted_BxN.astype(jnp.float32) + 1.0) / block_size, 0.0, 1.0)
    v_BxN = valid_BxN.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(v_BxN), 1.0)
    err_BxN = r_BxN.astype(jnp.float32) - jax.lax.stop_gradient(y_BxN)
    return jnp.sum(v_BxN * err_BxN**2) / count, jnp.sum(v_BxN * jnp.abs(err_BxN)) / count


def conditional_mask(match_BxNxP, mask_BxNxP) -> jax.Array:
    """Positions whose acceptance is defined: valid, and every earlier position of the block
    valid and matched (a_i is conditional on drafts < i being accepted) → bool [B, N, P]."""
    ok_BxNxP = (match_BxNxP & mask_BxNxP).astype(jnp.int32)
    streak_BxNxP = jnp.cumprod(ok_BxNxP, axis=-1)  # 1 up to and including the last match
    first_BxNx1 = jnp.ones_like(streak_BxNxP[..., :1])
    prior_BxNxP = jnp.concatenate([first_BxNx1, streak_BxNxP[..., :-1]], axis=-1)
    return mask_BxNxP & (prior_BxNxP > 0)


def accept_head_loss(logits_BxNxP, match_BxNxP, mask_BxNxP) -> tuple[jax.Array, dict]:
    """BCE of the acceptance head's logits z (a = sigmoid(z)) against greedy matches m, over
    the positions of `conditional_mask`; computed from logits: softplus(z) − m·z.

    Returns (bce, parts): `accept_mae` mean |a − m|, `accept_gap` |mean a − mean m| (the
    calibration gap over all counted positions), `accept_rate` the empirical mean m.
    """
    z = logits_BxNxP.astype(jnp.float32)
    m = jax.lax.stop_gradient(match_BxNxP.astype(jnp.float32))
    w = conditional_mask(match_BxNxP.astype(bool), mask_BxNxP).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(w), 1.0)
    bce = jnp.sum(w * (jax.nn.softplus(z) - m * z)) / count
    a = jax.lax.stop_gradient(jax.nn.sigmoid(z))
    mean_a, mean_m = jnp.sum(w * a) / count, jnp.sum(w * m) / count
    parts = {
        "accept_mae": jnp.sum(w * jnp.abs(a - m)) / count,
        "accept_gap": jnp.abs(mean_a - mean_m),
        "accept_rate": mean_m,
    }
    return bce, parts
