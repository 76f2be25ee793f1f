"""AdaFlash adaptive length head (docs/design.md §4.3, "two-model" head) and its optional
per-position acceptance output.

Dimensions: B batch, K block size, P = K−1 draft positions, D drafter width, R bottleneck
(256), A acceptance width (`accept_dim`), V vocab.

The reference part reads the drafter's final-normed states of one whole block (detached by
the caller's `stop_gradient`, so no gradient reaches the drafter) and predicts
r ≈ verify length / K.

The acceptance part (only when `accept_dim` > 0) is a separate small network, so r is
unchanged by it. For draft position i = 1..K−1 it predicts a_i = P(draft i accepted | drafts
< i accepted) from features [hidden_i (D), max log-prob_i, entropy_i] of the drafter's own
forward pass (never from sampled tokens, docs/design.md §4.3): Dense(D+2 → A) → SiLU → Dense(A → 1)
+ a learned per-position bias → sigmoid. Its inputs are detached here, whatever the caller
does. A block size different from the trained one reuses the last position's bias beyond
the trained positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.drafter.config import LengthHeadConfig
from adaflash_jax.model.layers import Dense

# Order of the per-position features after the hidden state (recorded in exports).
ACCEPT_FEATURES = ("hidden", "max_logprob", "entropy")
PROB_EPS = 1e-6
# The serving rule's rate (`verify_length`): the adaflash policy's default, and the rate the
# length head's calibration scores serving widths at (distill/calibration.py).
SERVING_RATE = 1.3


def confidence_features(logits_BxPxV) -> tuple[jax.Array, jax.Array]:
    """(max log-prob, entropy) of softmax(logits) per position, float32 → ([B, P], [B, P]).

    Written as reductions over V (no log-softmax array), so XLA fuses them into the logits.
    """
    x = logits_BxPxV.astype(jnp.float32)
    m = jnp.max(x, axis=-1, keepdims=True)
    lse = m + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True))
    mean_logit = jnp.sum(jnp.exp(x - lse) * x, axis=-1)
    lse = lse[..., 0]
    return m[..., 0] - lse, lse - mean_logit


class AcceptNet(nnx.Module):
    def __init__(self, hidden_size: int, accept_dim: int, positions: int, *, rngs: nnx.Rngs):
        kw = dict(rngs=rngs, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32)
        n_in = hidden_size + len(ACCEPT_FEATURES) - 1
        self.proj_in = Dense(n_in, accept_dim, logical_axes=("accept_in", "accept_hidden"), **kw)
        self.proj_out = Dense(accept_dim, 1, logical_axes=("accept_hidden", None), **kw)
        self.position_bias = nnx.Param(
            jnp.zeros((positions,), jnp.float32), logical_axes=("accept_pos",)
        )

    def __call__(self, hidden_BxKxD, max_lp_BxP, ent_BxP) -> jax.Array:
        """Logits z_i from the block states and the drafter's confidence features of draft
        positions 1..K−1 (`confidence_features` of its logits) → [B, K−1]."""
        b, k, _ = hidden_BxKxD.shape
        p = k - 1
        if max_lp_BxP.shape != (b, p) or ent_BxP.shape != (b, p):
            raise ValueError(
                f"accept head: features {max_lp_BxP.shape} do not cover the K−1 = {p} draft "
                f"positions of hidden {hidden_BxKxD.shape}"
            )
        h_BxPxD = jax.lax.stop_gradient(hidden_BxKxD[:, 1:].astype(jnp.float32))
        max_lp_BxP = jax.lax.stop_gradient(max_lp_BxP.astype(jnp.float32))
        ent_BxP = jax.lax.stop_gradient(ent_BxP.astype(jnp.float32))
        f_BxPxF = jnp.concatenate([h_BxPxD, max_lp_BxP[..., None], ent_BxP[..., None]], axis=-1)
        z_BxP = self.proj_out(jax.nn.silu(self.proj_in(f_BxPxF)))[..., 0]
        trained = self.position_bias[...].shape[0]
        idx_P = jnp.minimum(jnp.arange(p), trained - 1)  # positions past training reuse the last
        return z_BxP + jnp.take(self.position_bias[...], idx_P)


class LengthHead(nnx.Module):
    def __init__(self, hidden_size: int, cfg: LengthHeadConfig, *, block_size: int, rngs: nnx.Rngs):
        r = cfg.bottleneck_dim
        kw = dict(rngs=rngs, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32)
        self.down = Dense(2 * hidden_size, r, logical_axes=("head_in", "head_hidden"), **kw)
        self.res = Dense(r, r, logical_axes=("head_hidden", "head_hidden"), **kw)
        self.out = Dense(r, 1, logical_axes=("head_hidden", None), **kw)
        # Built after the reference part, so r's initial weights do not depend on accept_dim.
        self.accept = (
            AcceptNet(hidden_size, cfg.accept_dim, block_size - 1, rngs=rngs)
            if cfg.accept_dim > 0
            else None
        )

    def __call__(self, hidden_BxKxD) -> jax.Array:
        """Returns r_B in (0, 1)."""
        y = hidden_BxKxD.astype(jnp.float32)
        f_Bx2D = jnp.concatenate([y.mean(axis=1), y[:, -1]], axis=-1)
        h_BxR = jax.nn.silu(self.down(f_Bx2D))
        h_BxR = h_BxR + jax.nn.silu(self.res(h_BxR))
        return jax.nn.sigmoid(self.out(h_BxR))[:, 0]

    @property
    def has_accept_output(self) -> bool:
        return self.accept is not None

    def accept_logits(self, hidden_BxKxD, logits_BxKm1xV) -> jax.Array:
        """Logit of a_i for draft positions 1..K−1 → float32 [B, K−1] (train on these)."""
        b, p = hidden_BxKxD.shape[0], hidden_BxKxD.shape[1] - 1
        if logits_BxKm1xV.shape[:2] != (b, p):
            raise ValueError(
                f"accept head: logits {logits_BxKm1xV.shape} do not cover the K−1 = {p} draft "
                f"positions of hidden {hidden_BxKxD.shape}"
            )
        return self.accept_logits_from_features(
            hidden_BxKxD, *confidence_features(jax.lax.stop_gradient(logits_BxKm1xV))
        )

    def accept_logits_from_features(self, hidden_BxKxD, max_lp_BxP, ent_BxP) -> jax.Array:
        """`accept_logits` from precomputed confidence features (training computes them per
        chunk of blocks, never holding every block's logits)."""
        if self.accept is None:
            raise ValueError("this length head has no acceptance output (accept_dim = 0)")
        return self.accept(hidden_BxKxD, max_lp_BxP, ent_BxP)

    def accept_probs(self, hidden_BxKxD, logits_BxKm1xV) -> jax.Array:
        """a_i = P(draft i accepted | drafts < i accepted) → float32 [B, K−1] in (0, 1).

        `logits_BxKm1xV` are the drafter's raw logits (no temperature or top-p), as in
        training. Kept off exact 0 and 1 (float32 sigmoid saturates), so policies may take logs.
        """
        a_BxP = jax.nn.sigmoid(self.accept_logits(hidden_BxKxD, logits_BxKm1xV))
        return jnp.clip(a_BxP, PROB_EPS, 1.0 - PROB_EPS)


def length_label(accepted_B, block_size: int):
    """Direct-length regression target y = clip((A + 1) / K, 0, 1)."""
    return jnp.clip((accepted_B.astype(jnp.float32) + 1.0) / block_size, 0.0, 1.0)


def verify_length(r_B, block_size: int, rate: float = SERVING_RATE):
    """Reference serving rule: clamp(round(r·K·rate), 1, K) → int32 [B] (a jax array; `r_B`
    may be a numpy array, as host-side calibration passes)."""
    return jnp.clip(jnp.round(r_B * block_size * rate), 1, block_size).astype(jnp.int32)
