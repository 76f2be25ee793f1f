"""The three train steps: stage 1 (DFlash CE), head init, stage 2 (AdaFlash / sft / fkl).

Dimensions: B batch, S sequence, N anchors, K block size, P = K−1, D model, nD features,
V vocab.

Each is ONE pure function `(state, batch) -> (state, metrics)` over a `TrainState` whose
`params` are the whole drafter (length head included, float32 master weights) and whose
`frozen` field holds the target's weights. The target runs first, OUTSIDE `value_and_grad`
and under `stop_gradient`: it yields the context features, the embedding and LM-head tables
the drafter borrows, and the teacher logits at ℓ − 1 for every label position ℓ = a + k.
Parameters that a stage does not train get a zero update (`optax.set_to_zero`) rather than
a zero gradient, so weight decay cannot touch them. The length head always reads DETACHED
drafter states (and, for its acceptance output, detached drafter logits), so its MSE and BCE
never reach the drafter.

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
from adaflash_jax.sharding.rules import Rules
from adaflash_jax.train.optimizer import OptimizerConfig, decay_mask, make_schedule, path_labels
from adaflash_jax.train.state import TrainState, batch_sharding

# optax >= 0.2.6 moved the global norm to optax.tree.norm (the old name warns).
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm
KINDS = ("stage1", "head_init", "stage2")
BATCH_KEYS = ("tokens", "loss_mask", "anchors", "valid")
# Stage-2 loss weights ride in the batch as replicated scalars, so methods that differ only
# in weights (AdaFlash α = 0.8, `sft` α = 1) share one compiled program.
KNOB_KEYS = ("alpha", "tau", "temperature")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSpec:
    kind: str  # one of KINDS
    block_size: int
    gamma: float
    feature_layers: tuple[int, ...]
    divergence: str = "rkl"  # stage 2 only: rkl | fkl (the clipped KL term's direction)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; choose from {KINDS}")
        if self.divergence not in ("rkl", "fkl"):
            raise ValueError(f"unknown divergence {self.divergence!r}")


# ---- optimizer -------------------------------------------------------------------------------
def param_group(path: str) -> str:
    return "head" if path.startswith("length_head") else "drafter"


def make_optimizer(
    groups: Mapping[str, OptimizerConfig | None], *, clip_norm: float
) -> tuple[optax.GradientTransformation, dict[str, optax.Schedule]]:
    """AdamW per group ("drafter", "head"); a None group is frozen. One global-norm clip
    over all parameters runs before the split (DESIGN §4.2)."""
    transforms, schedules = {}, {}
    for name in ("drafter", "head"):
        cfg = groups.get(name)
        if cfg is None:
            transforms[name] = optax.set_to_zero()
            continue
        schedules[name] = make_schedule(cfg)
        transforms[name] = optax.adamw(
            schedules[name],
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    tx = optax.multi_transform(transforms, path_labels(param_group))
    return optax.chain(optax.clip_by_global_norm(clip_norm), tx), schedules


# ---- the frozen target -----------------------------------------------------------------------
def _teacher(target_graphdef, frozen, tokens_BxS, feature_layers):
    target = nnx.merge(target_graphdef, jax.lax.stop_gradient(frozen))
    out = target(tokens_BxS, feature_layers=feature_layers, compute_logits=False)
    return target, out.features_BxTxnD, out.hidden_BxTxD


def _teacher_logits(target, hidden_BxSxD, teacher_pos_BxNxP):
    """Target logits at ℓ − 1 for each label position ℓ → [B, N, P, V] (float32)."""
    b, n, p = teacher_pos_BxNxP.shape
    h_BxNPxD = jnp.take_along_axis(hidden_BxSxD, teacher_pos_BxNxP.reshape(b, n * p, 1), axis=1)
    logits = target.logits(h_BxNPxD).astype(jnp.float32)
    return logits.reshape(b, n, p, -1)


def _head_loss(drafter, hidden_BxNxKxD, logits_BxNxPxV, best_BxNxP, mask_BxNxP, valid_BxN, k):
    """Length-head loss on DETACHED drafter outputs: r's MSE, plus the acceptance output's BCE
    against greedy matches when the head has one. Returns (loss, metrics, accepted_BxN)."""
    b, n, _, d = hidden_BxNxKxD.shape
    hidden = jax.lax.stop_gradient(hidden_BxNxKxD).reshape(b * n, k, d)
    draft_BxNxP = jnp.argmax(logits_BxNxPxV, axis=-1)
    accepted_BxN = losses.accepted_streak(draft_BxNxP, best_BxNxP, mask_BxNxP)
    r_BxN = drafter.length_head(hidden).reshape(b, n)
    mse, mae = losses.length_head_loss(r_BxN, accepted_BxN, valid_BxN, k)
    aux = {"head_mse": mse, "head_mae": mae}
    if not drafter.length_head.has_accept_output:
        return mse, aux, accepted_BxN
    logits = jax.lax.stop_gradient(logits_BxNxPxV).reshape(b * n, k - 1, -1)
    z_BxNxP = drafter.length_head.accept_logits(hidden, logits).reshape(b, n, k - 1)
    bce, parts = losses.accept_head_loss(z_BxNxP, draft_BxNxP == best_BxNxP, mask_BxNxP)
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
            target_graphdef, state.frozen, tokens, spec.feature_layers
        )
        emb_VxD = jax.lax.stop_gradient(target.embedding_VxD())
        head_DxV = jax.lax.stop_gradient(target.lm_head_DxV())
        labels_BxNxP, mask_BxNxP, tpos_BxNxP = block_targets(tokens, loss_mask, anchors, valid, k)
        weights_BxNxP = losses.position_weights(mask_BxNxP, spec.gamma)
        teacher_BxNxPxV = None
        if spec.kind != "stage1":
            teacher_BxNxPxV = jax.lax.stop_gradient(
                _teacher_logits(target, t_hidden_BxSxD, tpos_BxNxP)
            )
            best_BxNxP = jnp.argmax(teacher_BxNxPxV, axis=-1)

        def student(params):
            drafter = nnx.merge(drafter_graphdef, params)
            hidden = drafter.train_hidden(feats_BxSxnD, tokens, anchors, valid, emb_VxD)
            return drafter, hidden, drafter.logits(hidden[:, :, 1:], head_DxV)

        if spec.kind == "head_init":
            # The drafter is frozen too: its forward stays outside value_and_grad.
            _, hidden, logits = student(jax.lax.stop_gradient(state.params))

            def loss_fn(params):
                drafter = nnx.merge(drafter_graphdef, params)
                loss, aux, _ = _head_loss(drafter, hidden, logits, best_BxNxP, mask_BxNxP, valid, k)
                return loss, aux

        else:

            def loss_fn(params):
                drafter, hidden, logits = student(params)
                aux = {}
                if spec.kind == "stage1":
                    loss = losses.decayed_ce(logits, labels_BxNxP, weights_BxNxP)
                    aux["ce"] = loss
                    aux["ce_acc"] = losses.accuracy(logits, labels_BxNxP, mask_BxNxP)
                    return loss, aux
                loss, parts = losses.distill_loss(
                    logits,
                    teacher_BxNxPxV,
                    weights_BxNxP,
                    objective=spec.divergence,
                    alpha=batch["alpha"],
                    tau=batch["tau"],
                    temperature=batch["temperature"],
                )
                head_loss, head_aux, accepted = _head_loss(
                    drafter, hidden, logits, best_BxNxP, mask_BxNxP, valid, k
                )
                aux.update(parts)
                aux["drafter_loss"] = loss
                aux["ce_acc"] = losses.accuracy(logits, best_BxNxP, mask_BxNxP)
                aux.update(head_aux)
                aux["accepted_mean"] = jnp.sum(accepted * valid) / jnp.maximum(valid.sum(), 1)
                return loss + head_loss, aux

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads), **aux}
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
    (default α 0.8, τ 0.01, T 1; stage 1 and head init ignore them)."""
    out = {k: jax.make_array_from_process_local_data(shardings[k], batch[k]) for k in BATCH_KEYS}
    knobs = {"alpha": 0.8, "tau": 0.01, "temperature": 1.0, **(knobs or {})}
    for k in KNOB_KEYS:
        out[k] = jax.device_put(jnp.float32(knobs[k]), shardings[k])
    return out
