"""The length head's calibration through training (docs/design.md §4.5): predicted against
realised accepted length per block, on the held-out set, at the end of head init and after
every stage-2 round (`eval.head_calibration`, off by default).

The blocks are those greedy speculative decoding drafts on the held-out responses (`collect.
replay` with the head: every step's r comes from the block the engine would draft there).
Per block, the head predicts r ≈ (A + 1)/K and the block realises A accepted drafts, the head's
own training label y = clip((A + 1)/K, 0, 1) (`losses.length_head_loss`). Reported, pooled
over blocks:

- `mse`: mean (r − y)², the quantity the head trains on (`head_mse` in the logs);
- `predicted_len` / `realised_len`: mean r·K and mean A + 1, in tokens; `mae_len` mean
  |r·K − (A + 1)|; `corr`: Pearson correlation of r and y (nan when either is constant);
- `width_exact` / `width_covers`: the share of blocks whose serving width
  `clamp(round(r·K·rate), 1, K)` (`length_head.verify_length`, rate 1.3 as the adaflash
  policy) equals A + 1 (verifies exactly what is accepted, plus the bonus), or is at least
  A + 1 (cuts no accepted draft); the same at rate 1 as `width_exact_rate1`;
- `by_predicted`: per predicted length round(r·K) = 1..K, the block count and the mean
  realised A + 1 (the reliability table).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np

from adaflash_jax.distill import collect
from adaflash_jax.io import fs

SERVING_RATE = 1.3  # decode.policy.AdaFlashPolicy's default rate


def _serving_width(r_T: np.ndarray, block_size: int, rate: float) -> np.ndarray:
    """`length_head.verify_length` on the host: clamp(round(r·K·rate), 1, K)."""
    return np.clip(np.round(r_T * block_size * rate), 1, block_size).astype(np.int64)


def head_calibration(
    trajectories: Sequence[collect.Trajectory], block_size: int, rate: float = SERVING_RATE
) -> dict:
    """The calibration entries of the module docstring over every block of `trajectories`
    (each with `head_r`)."""
    if any(t.head_r is None for t in trajectories):
        raise ValueError("head calibration needs trajectories replayed with the head (head_r)")
    r_T = np.concatenate([np.asarray(t.head_r, np.float64) for t in trajectories] or [[]])
    acc_T = np.concatenate([np.asarray(t.accepted, np.int64) for t in trajectories] or [[]])
    k = block_size
    if not r_T.size:
        return {"blocks": 0}
    realised_T = acc_T + 1
    y_T = np.clip(realised_T / k, 0.0, 1.0)
    predicted_T = r_T * k
    corr = math.nan
    if r_T.std() > 0 and y_T.std() > 0:
        corr = float(np.corrcoef(r_T, y_T)[0, 1])
    width_T = _serving_width(r_T, k, rate)
    rounded_T = np.clip(np.round(predicted_T), 1, k).astype(np.int64)
    by_predicted = {}
    for w in range(1, k + 1):
        mine_T = rounded_T == w
        if mine_T.any():
            by_predicted[str(w)] = {
                "blocks": int(mine_T.sum()),
                "realised_len": float(realised_T[mine_T].mean()),
            }
    return {
        "blocks": int(r_T.size),
        "mse": float(np.mean((r_T - y_T) ** 2)),
        "predicted_len": float(predicted_T.mean()),
        "realised_len": float(realised_T.mean()),
        "mae_len": float(np.mean(np.abs(predicted_T - realised_T))),
        "corr": corr,
        "rate": rate,
        "width_exact": float(np.mean(width_T == realised_T)),
        "width_covers": float(np.mean(width_T >= realised_T)),
        "width_exact_rate1": float(np.mean(_serving_width(r_T, k, 1.0) == realised_T)),
        "by_predicted": by_predicted,
    }


def point_path(trainer, point: str) -> str:
    """Where a calibration point's entries are kept (so a resumed run reports them too)."""
    return trainer.ctx.path("calibration", f"{point}.json")


def measure(trainer, params, point: str) -> dict | None:
    """The calibration of `params` at `point` ("head_init", "stage2_adaflash_round0", ...) on
    `trainer.calibration_data`, saved under the run directory; None when the run does not
    measure it. Every process measures (the replay is one SPMD program), whatever a resumed
    run's directory already holds; process 0 writes."""
    data = trainer.calibration_data
    if data is None:
        return None
    trajectories = trainer.replay(params, data, f"head calibration {point}", head=True)
    entry = head_calibration(trajectories, trainer.ctx.drafter_cfg.block_size)
    if trainer.ctx.is_main:
        fs.write_text(point_path(trainer, point), json.dumps(entry, indent=2))
    return entry


def expected_points(cfg) -> list[str]:
    """Every calibration point a run measures, in training order."""
    points = []
    for method in cfg.stage2.methods:
        if method == "stage1_long":
            points.append(f"head_init_{method}")
        else:
            points += [f"stage2_{method}_round{r}" for r in range(cfg.stage2.rounds)]
            if cfg.stage2.head_refit:
                points.append(f"head_refit_{method}")
    return ["head_init", *points]


def collected(ctx) -> dict[str, dict]:
    """{point: entries} of every saved calibration point of the run, in training order."""
    out = {}
    for point in expected_points(ctx.cfg):
        path = ctx.path("calibration", f"{point}.json")
        if fs.exists(path):
            out[point] = json.loads(fs.read_text(path))
    return out
