"""Next-token loss on packed rows, for training and for held-out evaluation.

Dimensions: B rows, T inputs per row (rows hold T+1 tokens), V vocab.

A target token counts only when it continues the same document as its input token
(`segment_ids` equal and non-zero): document starts, padding and row-boundary fragments
are never predicted across.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def _forward_ce(model, batch):
    tokens_BxT1, seg_BxT1 = batch["tokens"], batch["segment_ids"]
    out = model(
        tokens_BxT1[:, :-1],
        positions_BxT=batch["positions"][:, :-1],
        segment_ids_BxT=seg_BxT1[:, :-1],
    )
    logits_BxTxV = out.logits_BxTxV.astype(jnp.float32)
    ce_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, tokens_BxT1[:, 1:])
    mask_BxT = (seg_BxT1[:, 1:] == seg_BxT1[:, :-1]) & (seg_BxT1[:, 1:] > 0)
    return ce_BxT, mask_BxT


def lm_loss_fn(graphdef):
    """loss_fn(params, frozen, batch, rng) -> (mean CE over counted tokens, aux)."""

    def loss_fn(params, frozen, batch, rng):
        del frozen, rng  # pretraining has neither a teacher nor dropout
        ce_BxT, mask_BxT = _forward_ce(nnx.merge(graphdef, params), batch)
        count = mask_BxT.sum()
        loss = jnp.where(mask_BxT, ce_BxT, 0.0).sum() / jnp.maximum(count, 1)
        return loss, {"tokens": count}

    return loss_fn


def lm_eval_fn(graphdef):
    """eval_fn(params, batch) -> (summed CE, counted tokens); no gradient."""

    def eval_fn(params, batch):
        ce_BxT, mask_BxT = _forward_ce(nnx.merge(graphdef, params), batch)
        return jnp.where(mask_BxT, ce_BxT, 0.0).sum(), mask_BxT.sum()

    return eval_fn


def jit_eval(graphdef, *, param_shardings, batch_shardings):
    mesh = jax.tree.leaves(batch_shardings)[0].mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(
        lm_eval_fn(graphdef),
        in_shardings=(param_shardings, batch_shardings),
        out_shardings=replicated,
    )
