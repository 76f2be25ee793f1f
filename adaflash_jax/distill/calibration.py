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
  `clamp(round(r·K·rate), 1, K)` (`length_head.verify_length` at the adaflash policy's
  `length_head.SERVING_RATE`) equals A + 1 (verifies exactly what is accepted, plus the
  bonus), or is at least A + 1 (cuts no accepted draft); the same at rate 1 as
  `width_exact_rate1`;
- `by_predicted`: per predicted length round(r·K) = 1..K, the block count and the mean
  realised A + 1 (the reliability table).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence

import numpy as np

from adaflash_jax.distill import collect, schedule
from adaflash_jax.distill.batches import SequenceData
from adaflash_jax.drafter.length_head import SERVING_RATE, verify_length
from adaflash_jax.io import fs

DIRECTORY = "calibration"  # under the run directory (`Context.path`): one <point>.json each


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
    r32_T = r_T.astype(np.float32)  # the serving rule on r as the engine holds it
    width_T = np.asarray(verify_length(r32_T, k, rate))
    width1_T = np.asarray(verify_length(r32_T, k, 1.0))
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
        "width_exact_rate1": float(np.mean(width1_T == realised_T)),
        "by_predicted": by_predicted,
    }


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a run measures the calibration with: `replay(params, data, desc, head=True)`
    (`stages.Trainer.replay`: one SPMD program every process runs) over `data`, the held-out
    set, in blocks of `block_size`; the entries are saved in `directory` (the run's
    DIRECTORY) by the main process."""

    replay: Callable[..., list[collect.Trajectory]]
    data: SequenceData
    block_size: int
    directory: str
    is_main: bool


def point_path(directory: str, point: str) -> str:
    """Where a calibration point's entries are kept (so a resumed run reports them too)."""
    return f"{directory}/{point}.json"


def measure(calibration: Calibration, params, point: str) -> dict:
    """The calibration of `params` at `point` (one of `schedule.calibration_points`), saved
    under the run directory. Every process measures, whatever a resumed run's directory
    already holds; process 0 writes."""
    c = calibration
    trajectories = c.replay(params, c.data, f"head calibration {point}", head=True)
    entry = head_calibration(trajectories, c.block_size)
    if c.is_main:
        fs.write_text(point_path(c.directory, point), json.dumps(entry, indent=2))
    return entry


def collected(ctx) -> dict[str, dict]:
    """{point: entries} of every saved calibration point of the run, in training order."""
    out = {}
    for point in schedule.calibration_points(ctx.cfg):
        path = point_path(ctx.path(DIRECTORY), point)
        if fs.exists(path):
            out[point] = json.loads(fs.read_text(path))
    return out
