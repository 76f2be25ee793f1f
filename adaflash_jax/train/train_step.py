"""The train step: ONE pure function (state, batch) -> (state, metrics), jitted once.

The loss is supplied by the caller as `loss_fn(params, frozen, batch, rng) -> (loss, aux)`
(aux: dict of scalar metrics), so pretraining and distillation share this step. Frozen
arrays enter only through `frozen`, outside `value_and_grad`'s differentiated argument,
and under `stop_gradient`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from adaflash_jax.train.optimizer import nonfinite_metrics, poison_if_nonfinite
from adaflash_jax.train.state import TrainState

# optax >= 0.2.5 moved global_norm to optax.tree.norm; older installs only have the former.
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def train_step_fn(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedules: Mapping[str, optax.Schedule] | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The un-jitted step (useful to compose or inspect)."""

    def step(state: TrainState, batch) -> tuple[TrainState, dict]:
        rng, step_rng = jax.random.split(state.rng)
        frozen = jax.lax.stop_gradient(state.frozen)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, frozen, batch, step_rng
        )
        grads = poison_if_nonfinite(loss, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads), **aux}
        metrics.update(nonfinite_metrics(opt_state))
        for name, schedule in (schedules or {}).items():
            metrics[name] = schedule(state.step)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new_state, metrics

    return step


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    state_shardings,
    batch_shardings,
    schedules: Mapping[str, optax.Schedule] | None = None,
    donate: bool = True,
):
    """Jitted step with explicit shardings; the input state is donated (updated in place).

    `schedules` ({"lr": schedule} or one per group) are reported in the metrics at the step
    the update used. Metrics come back replicated.
    """
    mesh = jax.tree.leaves(batch_shardings)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        train_step_fn(loss_fn, tx, schedules),
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,) if donate else (),
    )
