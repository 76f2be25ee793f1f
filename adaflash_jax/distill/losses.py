"""Training losses and metrics of DFlash stage 1 and AdaFlash stage 2 (DESIGN §4).

Dimensions: B batch, N blocks (anchors) per sequence, P = K−1 predicted positions per block
(block position k = 1..K−1 predicts the token at anchor + k), V vocab.

Acceptance head (`accept_head_loss`). Draft position i's label is the greedy match m_i
(drafter argmax == target argmax, as in `accepted_streak`); a_i is conditional on drafts < i
being accepted, so only positions after an unbroken run of matches count.

Weights. Position k carries w_k = exp(−(k−1)/γ) times its validity mask; Nw = Σ w over
EVERY valid position of the (global) batch. All position losses are Σ w·loss / Nw, i.e. a
weighted mean over the batch.

The clip (DESIGN §4.2). The KL term is Σ w·min(r, τ) with r = T²·KL/Nw: τ clips each
position's KL AFTER it was divided by the batch-wide Nw. Without clipping the sum is exactly the
weighted mean KL; the clip only bites on a position whose KL exceeds τ·Nw (thousands of nats
for a real batch), so it removes outliers rather than capping ordinary positions. This keeps
the reference's semantics; note that the threshold therefore scales with the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

OBJECTIVES = ("rkl", "fkl", "sft")


def decay_weights(block_size: int, gamma: float) -> jax.Array:
    """w_k = exp(−(k−1)/γ) for k = 1..K−1 → [P]."""
    k = jnp.arange(1, block_size, dtype=jnp.float32)
    return jnp.exp(-(k - 1.0) / gamma)


def position_weights(mask_BxNxP: jax.Array, gamma: float) -> jax.Array:
    """Decay weights times the validity mask → [B, N, P] float32."""
    w_P = decay_weights(mask_BxNxP.shape[-1] + 1, gamma)
    return w_P * mask_BxNxP.astype(jnp.float32)


def cross_entropy(logits_BxNxPxV: jax.Array, labels_BxNxP: jax.Array) -> jax.Array:
    """Per-position CE in float32 → [B, N, P]."""
    logp = jax.nn.log_softmax(logits_BxNxPxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels_BxNxP[..., None], axis=-1)[..., 0]


def reverse_kl(student_BxNxPxV, teacher_BxNxPxV, temperature: float = 1.0) -> jax.Array:
    """KL(p_S^T ‖ p_T^T) per position over the full vocabulary, float32 → [B, N, P]."""
    log_s = jax.nn.log_softmax(student_BxNxPxV.astype(jnp.float32) / temperature, axis=-1)
    log_t = jax.nn.log_softmax(teacher_BxNxPxV.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(log_s) * (log_s - log_t), axis=-1)


def forward_kl(student_BxNxPxV, teacher_BxNxPxV, temperature: float = 1.0) -> jax.Array:
    """KL(p_T^T ‖ p_S^T) per position, float32 → [B, N, P]."""
    return reverse_kl(teacher_BxNxPxV, student_BxNxPxV, temperature)


def _normaliser(weights_BxNxP) -> jax.Array:
    # An all-padding batch gives zero loss instead of 0/0.
    return jnp.maximum(jnp.sum(weights_BxNxP), 1e-9)


def decayed_ce(logits_BxNxPxV, labels_BxNxP, weights_BxNxP) -> jax.Array:
    """Σ w·CE / Nw (stage 1 and the `sft` objective)."""
    ce = cross_entropy(logits_BxNxPxV, labels_BxNxP)
    return jnp.sum(weights_BxNxP * ce) / _normaliser(weights_BxNxP)


def accuracy(logits_BxNxPxV, labels_BxNxP, mask_BxNxP) -> jax.Array:
    """Fraction of valid positions whose argmax is the label (unweighted)."""
    hit = (jnp.argmax(logits_BxNxPxV, axis=-1) == labels_BxNxP) & mask_BxNxP
    return jnp.sum(hit) / jnp.maximum(jnp.sum(mask_BxNxP), 1)


def distill_loss(
    student_BxNxPxV,
    teacher_BxNxPxV,
    weights_BxNxP,
    *,
    objective: str = "rkl",
    alpha: float = 0.8,
    tau: float = 0.01,
    temperature: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Stage-2 drafter loss: α·Σw·CE(student, argmax teacher)/Nw + (1−α)·Σw·min(r, τ).

    `objective` picks the divergence in r: "rkl" (AdaFlash, reverse KL), "fkl" (forward KL);
    "sft" is the CE term alone (α = 1), i.e. continued stage-1 training on on-policy data.
    Returns (loss, parts); parts hold the CE and clipped-KL terms, the raw weighted-mean KL
    and the clip ratio (share of valid positions with r > τ).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")
    teacher_BxNxPxV = jax.lax.stop_gradient(teacher_BxNxPxV.astype(jnp.float32))
    labels_BxNxP = jnp.argmax(teacher_BxNxPxV, axis=-1)
    nw = _normaliser(weights_BxNxP)
    ce = jnp.sum(weights_BxNxP * cross_entropy(student_BxNxPxV, labels_BxNxP)) / nw
    div = reverse_kl if objective != "fkl" else forward_kl
    kl_BxNxP = temperature**2 * div(student_BxNxPxV, teacher_BxNxPxV, temperature)
    r_BxNxP = kl_BxNxP / nw
    valid_BxNxP = weights_BxNxP > 0
    kl_clipped = jnp.sum(weights_BxNxP * jnp.minimum(r_BxNxP, tau))
    parts = {
        "ce": ce,
        "kl_clipped": kl_clipped,
        "kl_mean": jnp.sum(weights_BxNxP * kl_BxNxP) / nw,
        "clip_ratio": jnp.sum((r_BxNxP > tau) & valid_BxNxP) / jnp.maximum(jnp.sum(valid_BxNxP), 1),
    }
    if objective == "sft":
        return ce, parts
    return alpha * ce + (1.0 - alpha) * kl_clipped, parts


def accepted_streak(draft_BxNxP, target_BxNxP, mask_BxNxP) -> jax.Array:
    """A per block: leading valid positions whose draft token equals the target's → [B, N]."""
    ok_BxNxP = (draft_BxNxP == target_BxNxP) & mask_BxNxP
    return jnp.sum(jnp.cumprod(ok_BxNxP.astype(jnp.int32), axis=-1), axis=-1)


def length_head_loss(r_BxN, accepted_BxN, valid_BxN, block_size: int):
    """MSE of the head's r against y = clip((A + 1)/K, 0, 1) over valid blocks; also MAE."""
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
