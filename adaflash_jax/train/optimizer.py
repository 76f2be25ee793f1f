"""AdamW with warm-up + cosine (or constant) learning rate and global-norm clipping.

`make_optimizer` serves one parameter group; `make_grouped_optimizer` gives each group its
own AdamW (learning rate, schedule, decay) via `optax.multi_transform`, with ONE global-norm
clip over all trainable parameters before the split (docs/design.md §4.2: clip 1.0 over everything;
drafter and length head at different constant learning rates).

Weight decay skips 1-D parameters (norm scales, biases), the usual choice for transformers,
unless `decay_all` (torch's AdamW decays every parameter; the AdaFlash reference uses it).

Every optimizer skips non-finite steps (`skip_nonfinite`: optax's `apply_if_finite`): a step
whose gradients (or loss, `poison_if_nonfinite`) are not finite leaves the parameters and the
optimizer state as they were and is counted; the train loops stop a run after too many in a
row (docs/design.md §4.4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    lr: float
    schedule: str = "cosine"  # "cosine" (warm-up then cosine decay) or "constant"
    total_steps: int = 0  # cosine only: the step the decay ends at
    warmup_steps: int = 0
    final_lr_fraction: float = 0.1  # cosine only: final lr = lr * final_lr_fraction
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0  # global-norm clip; None disables
    decay_all: bool = False  # weight decay on 1-D parameters (norms, biases) too

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"OptimizerConfig.lr must be positive, got {self.lr}")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(
                f"OptimizerConfig.schedule must be 'cosine' or 'constant', got {self.schedule!r}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"OptimizerConfig.total_steps ({self.total_steps}) must exceed warmup_steps "
                f"({self.warmup_steps}) for a cosine schedule"
            )
        if not 0.0 <= self.final_lr_fraction <= 1.0:
            raise ValueError(
                f"OptimizerConfig.final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}"
            )
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ValueError(
                f"OptimizerConfig.clip_norm must be positive or None, got {self.clip_norm}"
            )


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    if cfg.schedule == "constant":
        if cfg.warmup_steps:
            return optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
        return optax.constant_schedule(cfg.lr)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=cfg.lr * cfg.final_lr_fraction,
    )


def decay_mask(params):
    """True for parameters that get weight decay (matrices), False for 1-D ones."""
    return jax.tree.map(lambda x: x.ndim > 1, params)


def adamw(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """AdamW with `cfg`'s moments and decay (no clip: callers chain their own)."""
    mask = None if cfg.decay_all else decay_mask
    return optax.adamw(
        schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask
    )


def make_optimizer(cfg: OptimizerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(cfg)
    tx = adamw(cfg, schedule)
    if cfg.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
    return skip_nonfinite(tx), schedule


# apply_if_finite applies the updates anyway after this many non-finite steps in a row; the
# loops stop the run long before (their own limit), so never.
_NEVER = 2**31 - 1


def skip_nonfinite(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx`, but a step with a non-finite gradient is a zero update with the inner state kept."""
    return optax.apply_if_finite(tx, max_consecutive_errors=_NEVER)


def poison_if_nonfinite(loss, grads):
    """NaN gradients when the loss is not finite, so `skip_nonfinite` skips that step too."""
    ok = jnp.isfinite(loss)
    return jax.tree.map(lambda g: jnp.where(ok, g, jnp.nan).astype(g.dtype), grads)


def nonfinite_metrics(opt_state: optax.ApplyIfFiniteState) -> dict[str, jax.Array]:
    """This step's skip: 1 or 0 (a log interval's mean is the fraction skipped)."""
    return {"skipped": 1 - opt_state.last_finite.astype(jnp.int32)}


def skip_counts(opt_state: optax.ApplyIfFiniteState) -> tuple[jax.Array, jax.Array]:
    """(non-finite steps in a row up to the last one, non-finite steps in all)."""
    return opt_state.notfinite_count, opt_state.total_notfinite


def path_labels(label_fn: Callable[[str], str]) -> Callable:
    """Turns `label_fn("layers/0/mlp/gate_proj/kernel") -> group` into optax param_labels."""

    def labels(params):
        def one(path, _):
            names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
            return label_fn("/".join(n for n in names if n != "value"))

        return jax.tree_util.tree_map_with_path(one, params)

    return labels


def make_grouped_optimizer(
    groups: Mapping[str, OptimizerConfig],
    label_fn: Callable[[str], str],
    *,
    clip_norm: float | None = 1.0,
) -> tuple[optax.GradientTransformation, dict[str, optax.Schedule]]:
    """Per-group AdamW; `label_fn(param path) -> group name`. Group configs' own clip_norm is
    ignored: one clip over all groups runs first."""
    if not groups:
        raise ValueError("make_grouped_optimizer needs at least one group")
    schedules = {name: make_schedule(cfg) for name, cfg in groups.items()}
    transforms = {name: adamw(cfg, schedules[name]) for name, cfg in groups.items()}

    def checked_label(path: str) -> str:
        group = label_fn(path)
        if group not in groups:
            raise ValueError(f"label_fn put parameter {path!r} in unknown group {group!r}")
        return group

    tx = optax.multi_transform(transforms, path_labels(checked_label))
    if clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    return skip_nonfinite(tx), schedules


def count_params(params) -> int:
    """Number of scalars in a parameter tree (concrete or abstract)."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


class NonFiniteError(RuntimeError):
    """Too many train steps in a row had a non-finite loss or gradient."""


def check_skips(name: str, opt_state, step: int, limit: int, last_checkpoint) -> int:
    """A train loop's check at a log point: the stage's skipped steps so far, or
    `NonFiniteError` (one line naming the stage, the step and the last checkpoint) when the
    last `limit` or more steps in a row were skipped."""
    in_a_row, total = map(int, jax.device_get(skip_counts(opt_state)))
    if in_a_row >= limit:
        raise NonFiniteError(
            f"{name}: {in_a_row} train steps in a row up to step {step} had a non-finite loss "
            f"or gradient (limit {limit}); the weights are step {step - in_a_row}'s, the last "
            f"checkpoint is step {last_checkpoint}"
        )
    return total
