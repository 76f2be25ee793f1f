"""Online calibration of the acceptance estimator, per request row (goodput).

Dimensions: B slots, Y a row's draft nodes (a tree's, or a chain's K − 1 positions).

Why: an estimator can be far off for a given drafter and domain (BENCHMARKS.md §1: on the
tiny target's math prompts the drafter's confidence expected ~0.5 accepted drafts per step
where 5–7 were accepted). Scaling the expected count cannot fix that (the same factor is
wrong for prose), nor can an engine-wide correction learnt only from drafted steps (it learns
nothing once nothing drafts). So each row calibrates its estimates with an exponent.
The estimates are survivals s_i, the chance node i is accepted (a chain's draft i with all
before it, s_i = Π_{j<=i} a_j; a tree node's path probability), taken as s_i ↦ s_i^γ (for a
chain the same as a_j ↦ a_j^γ; γ < 1 lifts an under-confident estimator, γ > 1 lowers an
over-confident one; the ordering is kept). A row verifying its first W − 1 nodes expects
Σ_{i<W} s_i^γ accepted drafts (each node counts once if it lies on the accepted path). Each
outcome (a draft of known estimates graded over width W, n drafts accepted) moves the row's
calibrated expected count a fraction of the way towards n, and γ is refit to that count.
Outcomes come from drafted steps and from probes graded after the fact by walking their
nodes along the committed tokens (`decode/undrafted.py`; with sampling, drafts matching the
sampled tokens are a proxy for rejection-sampling acceptance). Only committed tokens are
read, so decisions stay lossless. A fresh request starts from the engine-wide EMA of all outcomes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ROW_RATE = 0.3  # how far one outcome moves its row's expected count towards it
ENGINE_RATE = 0.1  # the same for the engine-wide γ (a fresh request's start)
MAX_LOG_GAMMA = math.log(32.0)  # γ within [1/32, 32]
FIT_ITERS = 12  # bisection steps: log γ to ±2·MAX_LOG_GAMMA / 2^12 ≈ 0.002


def bisect(too_high, lo_B: jax.Array, hi_B: jax.Array, iters: int, unroll: bool = False):
    """The root of a monotone function within [lo_B, hi_B] per row, by `iters` halvings;
    `too_high(mid_B)` (bool [B]) says the root lies below mid."""

    def body(_, lo_hi):
        lo_B, hi_B = lo_hi
        mid_B = 0.5 * (lo_B + hi_B)
        below_B = too_high(mid_B)
        return jnp.where(below_B, lo_B, mid_B), jnp.where(below_B, mid_B, hi_B)

    lo_B, hi_B = jax.lax.fori_loop(0, iters, body, (lo_B, hi_B), unroll=unroll)
    return 0.5 * (lo_B + hi_B)


def chain_survival(accept_BxKm1: jax.Array) -> jax.Array:
    """A chain's survivals Π_{j<=i} a_j from per-position acceptance a → [B, K − 1]."""
    return jnp.cumprod(jnp.clip(accept_BxKm1.astype(jnp.float32), 0.0, 1.0), axis=-1)


def calibrated(survive_BxY: jax.Array, log_gamma) -> jax.Array:
    """s^γ per row (log_gamma a scalar or [B])."""
    lg = jnp.asarray(log_gamma, jnp.float32)
    gamma = jnp.exp(lg)[..., None] if lg.ndim == 1 else jnp.exp(lg)
    return jnp.power(jnp.clip(survive_BxY.astype(jnp.float32), 0.0, 1.0), gamma)


def accepted_by_width(survive_BxY: jax.Array) -> jax.Array:
    """E[accepted drafts | width W] = Σ_{i=1}^{W−1} s_i for W = 1..Y + 1 → [B, Y + 1]."""
    survive_BxY = jnp.clip(survive_BxY, 0.0, 1.0)
    zero_Bx1 = jnp.zeros_like(survive_BxY[:, :1])
    return jnp.concatenate([zero_Bx1, jnp.cumsum(survive_BxY, axis=-1)], axis=-1)


def accepted_at(survive_BxY: jax.Array, width_B: jax.Array) -> jax.Array:
    """E[accepted drafts] at each row's own width W → [B]."""
    by_width_BxW = accepted_by_width(survive_BxY)
    return jnp.take_along_axis(by_width_BxW, (width_B - 1)[:, None], axis=1)[:, 0]


def fit_log_gamma(est_BxY, width_B, realised_B) -> jax.Array:
    """log γ* per row: the exponent at which the expected accepted count at width_B equals the
    realised one (clipped to ±MAX_LOG_GAMMA when no exponent reaches it)."""
    target_B = realised_B.astype(jnp.float32)

    def too_few(log_gamma_B):  # the count falls as γ grows
        return accepted_at(calibrated(est_BxY, log_gamma_B), width_B) < target_B

    lo_B = jnp.full_like(target_B, -MAX_LOG_GAMMA)
    hi_B = jnp.full_like(target_B, MAX_LOG_GAMMA)
    # unrolled: this runs inside every probe and drafted step, and a rolled loop of tiny
    # steps pays a loop iteration's overhead per step
    return bisect(too_few, lo_B, hi_B, FIT_ITERS, unroll=True)


def update(log_gamma_B, log_gamma, est_BxY, width_B, realised_B, graded_B):
    """(log_gamma_B, log_gamma) after outcomes: row b's draft (raw survivals est_BxY[b]) was
    verified or graded over width_B[b], realised_B[b] drafts accepted. Each moves the
    calibrated count a RATE fraction towards the realised one and refits γ to that (one
    outcome is noisy, and a 0 or a full block alone would fit γ at a bound). Rows not
    `graded_B` keep theirs; the engine's becomes the mean refit of the graded rows."""
    realised_B = realised_B.astype(jnp.float32)
    b = log_gamma_B.shape[0]
    # the rows' refits and the engine's in one bisection over 2B rows
    lg_2B = jnp.concatenate([log_gamma_B, jnp.broadcast_to(log_gamma, (b,))])
    rate_2B = jnp.repeat(jnp.asarray([ROW_RATE, ENGINE_RATE], jnp.float32), b)
    est_2BxY = jnp.concatenate([est_BxY, est_BxY])
    width_2B = jnp.concatenate([width_B, width_B])
    now_2B = accepted_at(calibrated(est_2BxY, lg_2B), width_2B)
    target_2B = now_2B + rate_2B * (jnp.concatenate([realised_B, realised_B]) - now_2B)
    fit_2B = fit_log_gamma(est_2BxY, width_2B, target_2B)
    rows_B = jnp.where(graded_B, fit_2B[:b], log_gamma_B)
    n = jnp.sum(graded_B)
    mean = jnp.sum(jnp.where(graded_B, fit_2B[b:], 0.0)) / jnp.maximum(n, 1)
    return rows_B, jnp.where(n > 0, mean, log_gamma)
