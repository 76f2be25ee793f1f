"""The three train steps: stage 1 (DFlash CE), head init, stage 2 (AdaFlash / sft / fkl).

Dimensions: B batch, S sequence, N anchors, K block size, P = K−1, D model, nD features,
V vocab.

Each is ONE pure function `(state, batch) -> (state, metrics)` over a `TrainState` whose
`params` are the whole drafter (length head included, float32 master weights) and whose
`frozen` field holds the target's weights. The target runs first, OUTSIDE `value_and_grad`
and under `stop_gradient`: it yields the context features, the embedding and LM-head tables
the drafter borrows, and (stage 2) its final states at ℓ − 1 for every label position
ℓ = a + k, from which the loss computes teacher logits chunk by chunk. Parameters that a
stage does not train get a zero update (`optax.set_to_zero`) rather than a zero gradient, so
weight decay cannot touch them. The length head always reads DETACHED drafter states (and
detached confidence features), so its MSE and BCE never reach the drafter; the optional
acceptance network is also clipped on its own (`clip_part`), so it cannot rescale the
drafter's update either.

`jit_step` compiles a step once with explicit in/out shardings and donates the old state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from adaflash_jax.distill import losses
from adaflash_jax.distill.anchors import block_targets
from adaflash_jax.drafter.train_attention import DEFAULT_CHUNK
from adaflash_jax.sharding.rows import RowLayout
from adaflash_jax.sharding.rules import Rules
from adaflash_jax.train.optimizer import (
    OptimizerConfig,
    adamw,
    make_schedule,
    nonfinite_metrics,
    path_labels,
    poison_if_nonfinite,
    skip_nonfinite,
)
from adaflash_jax.train.state import TrainState, batch_sharding

KINDS = ("stage1", "head_init", "stage2")
GROUPS = ("drafter", "head", "accept")  # optimizer groups (learning rate, decay)
BATCH_KEYS = ("tokens", "loss_mask", "anchors", "valid")
# Stage-2 loss weights ride in the batch as replicated scalars, so methods that differ only
# in weights (AdaFlash α = 0.8, `sft` α = 1) share one compiled program. `head_on` (1 or 0)
# says whether the length head learns from this batch (`Stage2Spec.head_fit`).
KNOB_KEYS = ("alpha", "tau", "temperature", "head_on")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSpec:
    kind: str  # one of KINDS
    block_size: int
    gamma: float
    feature_layers: tuple[int, ...]
    divergence: str = "rkl"  # stage 2 only: rkl | fkl (the clipped KL term's direction)
    loss_chunk: int = 0  # blocks per loss chunk (0: all at once); see losses.position_stats
    attention: str = "sparse"  # drafter training attention: "sparse" | "dense" (train_hidden)
    attention_chunk: int = DEFAULT_CHUNK  # context keys per chunk of the sparse attention
    rows: RowLayout | None = None  # the batch's rows over the mesh (activations stay split)
    # The non-finite guard (loss poisoning + the optimizer's skip, train/optimizer.py). Off
    # only to measure what it costs (experiments/guard_overhead.py): then `skipped` is 0.
    nonfinite_guard: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; choose from {KINDS}")
        if self.divergence not in losses.DIVERGENCES:
            raise ValueError(f"unknown divergence {self.divergence!r}")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0, got {self.loss_chunk}")


# ---- optimizer -------------------------------------------------------------------------------
def param_group(path: str) -> str:
    """ "accept" (the optional acceptance network), "head" (the reference thresh head) or
    "drafter"."""
    if path.startswith("length_head/accept"):
        return "accept"
    return "head" if path.startswith("length_head") else "drafter"


def clip_part(path: str) -> str:
    """The reference clips its draft model (drafter + thresh head) with ONE global norm; our
    acceptance network is no part of it and is clipped on its own, so its gradients can never
    shrink the drafter's step."""
    return "accept" if param_group(path) == "accept" else "draft_model"


def make_optimizer(
    groups: Mapping[str, OptimizerConfig | None],
    *,
    clip_norm: float | None,
    nonfinite_guard: bool = True,
) -> tuple[optax.GradientTransformation, dict[str, optax.Schedule]]:
    """AdamW per group of `GROUPS` (a missing or None group is frozen: zero updates, so weight
    decay cannot touch it), after a global-norm clip at `clip_norm` per `clip_part` (None:
    no clip), wrapped in the non-finite skip (off only with `StepSpec.nonfinite_guard`)."""
    transforms, schedules = {}, {}
    for name in GROUPS:
        cfg = groups.get(name)
        if cfg is None:
            transforms[name] = optax.set_to_zero()
            continue
        schedules[name] = make_schedule(cfg)
        transforms[name] = adamw(cfg, schedules[name])
    tx = optax.multi_transform(transforms, path_labels(param_group))
    if clip_norm is not None:
        clip = optax.clip_by_global_norm(clip_norm)
        clips = optax.multi_transform({"draft_model": clip, "accept": clip}, path_labels(clip_part))
        tx = optax.chain(clips, tx)
    return (skip_nonfinite(tx) if nonfinite_guard else tx), schedules


def _head_gated(updates, head_on: jax.Array):
    """`updates` with the length head's (and acceptance network's) scaled by `head_on`: a
    batch the head must not learn from moves it by nothing, not even by Adam's momentum."""
    labels = path_labels(param_group)(updates)
    return jax.tree.map(lambda u, g: u if g == "drafter" else u * head_on, updates, labels)


def clip_part_norms(grads) -> dict[str, jax.Array]:
    """Global gradient norm of each clip part (what the clip compares with its threshold)."""
    labels = path_labels(clip_part)(grads)
    sq = {"draft_model": jnp.float32(0.0), "accept": jnp.float32(0.0)}
    for label, g in zip(jax.tree.leaves(labels), jax.tree.leaves(grads), strict=True):
        sq[label] = sq[label] + jnp.sum(jnp.square(g.astype(jnp.float32)))
    return {k: jnp.sqrt(v) for k, v in sq.items()}


# ---- the frozen target -----------------------------------------------------------------------
def _teacher(target_graphdef, frozen, tokens_BxS, feature_layers, rows):
    target = nnx.merge(target_graphdef, jax.lax.stop_gradient(frozen))
    out = target(tokens_BxS, feature_layers=feature_layers, compute_logits=False, rows=rows)
    return target, out.features_BxTxnD, out.hidden_BxTxD


def _teacher_hidden(hidden_BxSxD, teacher_pos_BxNxP):
    """The target's final states at ℓ − 1 for each label position ℓ → [B, N, P, D]."""
    b, n, p = teacher_pos_BxNxP.shape
    flat = teacher_pos_BxNxP.reshape(b, n * p, 1)
    return jnp.take_along_axis(hidden_BxSxD, flat, axis=1).reshape(b, n, p, -1)


def _head_loss(drafter, hidden_BxNxKxD, stats, labels_BxNxP, mask_BxNxP, valid_BxN, k):
    """Length-head loss on DETACHED drafter outputs: r's MSE, plus the acceptance output's BCE
    when the head has one. A block's label is the greedy streak of the drafter's argmax
    against the sequence's own tokens (the reference's). Returns (loss, metrics, accepted)."""
    b, n, _, d = hidden_BxNxKxD.shape
    hidden = jax.lax.stop_gradient(hidden_BxNxKxD).reshape(b * n, k, d)
    accepted_BxN = losses.accepted_streak(stats.draft, labels_BxNxP, mask_BxNxP)
    r_BxN = drafter.length_head(hidden).reshape(b, n)
    mse, mae = losses.length_head_loss(r_BxN, accepted_BxN, valid_BxN, k)
    aux = {"head_mse": mse, "head_mae": mae}
    if not drafter.length_head.has_accept_output:
        return mse, aux, accepted_BxN
    z_BxNxP = drafter.length_head.accept_logits_from_features(
        hidden, stats.max_logprob.reshape(b * n, k - 1), stats.entropy.reshape(b * n, k - 1)
    ).reshape(b, n, k - 1)
    bce, parts = losses.accept_head_loss(z_BxNxP, stats.draft == labels_BxNxP, mask_BxNxP)
    aux.update(accept_bce=bce, **parts)
    return mse + bce, aux, accepted_BxN


# ---- the steps -------------------------------------------------------------------------------
def make_step(
    spec: StepSpec,
    drafter_graphdef: nnx.GraphDef,
    target_graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    schedules: Mapping[str, optax.Schedule] | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The un-jitted pure step of `spec.kind`."""
    k = spec.block_size

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        tokens, loss_mask = batch["tokens"], batch["loss_mask"]
        anchors, valid = batch["anchors"], batch["valid"]
        # -- frozen target, outside the differentiated function --
        target, feats_BxSxnD, t_hidden_BxSxD = _teacher(
            target_graphdef, state.frozen, tokens, spec.feature_layers, spec.rows
        )
        emb_VxD = jax.lax.stop_gradient(target.embedding_VxD())
        head_DxV = jax.lax.stop_gradient(target.lm_head_DxV())
        labels_BxNxP, mask_BxNxP, tpos_BxNxP = block_targets(tokens, loss_mask, anchors, valid, k)
        weights_BxNxP = losses.position_weights(mask_BxNxP, spec.gamma)
        teacher_BxNxPxD = None
        if spec.kind == "stage2":
            teacher_BxNxPxD = jax.lax.stop_gradient(_teacher_hidden(t_hidden_BxSxD, tpos_BxNxP))

        def student(params):
            drafter = nnx.merge(drafter_graphdef, params)
            hidden = drafter.train_hidden(
                feats_BxSxnD,
                tokens,
                anchors,
                valid,
                emb_VxD,
                attention=spec.attention,
                attention_chunk=spec.attention_chunk,
                rows=spec.rows,
            )
            stats = losses.position_stats(
                hidden[:, :, 1:],
                head_DxV,
                labels_BxNxP,
                teacher_BxNxPxD,
                temperature=batch["temperature"] if spec.kind == "stage2" else 1.0,
                divergence=spec.divergence,
                chunk=spec.loss_chunk,
                dtype=drafter.dtype,
            )
            return drafter, hidden, stats

        def head_loss(drafter, hidden, stats):
            return _head_loss(drafter, hidden, stats, labels_BxNxP, mask_BxNxP, valid, k)

        if spec.kind == "head_init":
            # The drafter is frozen too: its forward stays outside value_and_grad.
            _, hidden, stats = student(jax.lax.stop_gradient(state.params))

            def loss_fn(params):
                loss, aux, _ = head_loss(nnx.merge(drafter_graphdef, params), hidden, stats)
                return loss, aux

        elif spec.kind == "stage1":

            def loss_fn(params):
                _, _, stats = student(params)
                loss = losses.decayed_ce(stats.ce, weights_BxNxP)
                return loss, {
                    "ce": loss,
                    "ce_acc": losses.accuracy(stats.draft, labels_BxNxP, mask_BxNxP),
                }

        else:

            def loss_fn(params):
                drafter, hidden, stats = student(params)
                loss, parts = losses.distill_loss(
                    stats.ce,
                    stats.kl,
                    weights_BxNxP,
                    objective=spec.divergence,
                    alpha=batch["alpha"],
                    tau=batch["tau"],
                )
                h_loss, h_aux, accepted = head_loss(drafter, hidden, stats)
                h_loss = h_loss * batch["head_on"]
                aux = {**parts, **h_aux, "drafter_loss": loss}
                aux["ce_acc"] = losses.accuracy(stats.draft, stats.labels, mask_BxNxP)
                aux["accepted_mean"] = jnp.sum(accepted * valid) / jnp.maximum(valid.sum(), 1)
                return loss + h_loss, aux

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        if spec.nonfinite_guard:
            grads = poison_if_nonfinite(loss, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        if spec.kind == "stage2":
            updates = _head_gated(updates, batch["head_on"])
        params = optax.apply_updates(state.params, updates)
        norms = clip_part_norms(grads)
        metrics = {"loss": loss, "grad_norm": norms["draft_model"], **aux}
        if spec.nonfinite_guard:
            metrics.update(nonfinite_metrics(opt_state))
        else:
            metrics["skipped"] = jnp.zeros((), jnp.int32)
        metrics["accept_grad_norm"] = norms["accept"]
        for name, schedule in (schedules or {}).items():
            metrics[f"lr_{name}"] = schedule(state.step)
        metrics["label_tokens"] = jnp.sum(mask_BxNxP)
        rng, _ = jax.random.split(state.rng)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new, metrics

    return step


def batch_shardings(mesh: Mesh, rules: Rules, batch_size: int) -> dict[str, NamedSharding]:
    out = {key: batch_sharding(mesh, rules, 2, batch_size) for key in BATCH_KEYS}
    out.update({key: NamedSharding(mesh, PartitionSpec()) for key in KNOB_KEYS})
    return out


def jit_step(step_fn, *, state_shardings, batch_shardings_: dict, donate: bool = True):
    """Compiled once: explicit shardings in and out, the old state donated."""
    mesh = next(iter(batch_shardings_.values())).mesh
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_shardings_),
        out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,) if donate else (),
    )


def put_batch(batch: dict, shardings: dict, knobs: Mapping[str, float] | None = None) -> dict:
    """This process's rows → global arrays (per-host input sharding), plus the loss knobs
    (default α 0.8, τ 0.01, T 1, head on; stage 1 and head init ignore them)."""
    out = {k: jax.make_array_from_process_local_data(shardings[k], batch[k]) for k in BATCH_KEYS}
    knobs = {"alpha": 0.8, "tau": 0.01, "temperature": 1.0, "head_on": 1.0, **(knobs or {})}
    for k in KNOB_KEYS:
        out[k] = jax.device_put(jnp.float32(knobs[k]), shardings[k])
    return out
