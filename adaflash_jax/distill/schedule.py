"""The distillation job's training order, written once (docs/design.md §4): which stages run,
from which drafter, in which order, and where the length head's calibration is measured.

A schedule is a tuple of tracks, one per final drafter (τ, export): "stage1" (stage 1, then
head init), then each stage-2 method in `stage2.methods` order. A stage-2 method starts from
the "stage1" drafter: its rounds, then (`stage2.head_refit`) a head re-fit. `stage1_long`
starts from the untrained drafter: stage 1 for `stage1_long_steps`, then a head init. The
pipeline runs the tracks in order (`pipeline._train`); `calibration_points` lists the points
the run measures, and the report reads them back in that order (`calibration.collected`).
"""

from __future__ import annotations

import dataclasses

from adaflash_jax.distill.config import RunConfig

INIT = "init"  # a track's start: the drafter before any training (fresh or draft.init_from)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    kind: str  # a train step kind (`steps.KINDS`): the Trainer stage that runs it
    name: str  # the stage's name: checkpoint directory, log prefix, history key
    phase: str  # the report's `stage_seconds` entry its time adds to
    method: str | None = None  # stage 2: the method it trains
    total: int | None = None  # stage 1: its train steps (0 with draft.init_from: skipped)
    # Its calibration points (measured with eval.head_calibration): a head fit's own name,
    # measured once fitted; a stage-2 step's one per round, measured after that round.
    points: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Track:
    drafter: str  # the final drafter it makes: "stage1" or a stage-2 method
    start: str  # the params it trains from: INIT or an earlier track's drafter
    steps: tuple[Step, ...]


def stage1_long_steps(cfg: RunConfig) -> int:
    """Stage 1's steps plus every stage-2 step: the equal-total-steps baseline."""
    return cfg.stage1.steps + cfg.stage2.rounds * cfg.stage2.steps_per_round


def stage2_name(method: str) -> str:
    return f"stage2_{method}"


def _head_fit(name: str, phase: str) -> Step:
    return Step(kind="head_init", name=name, phase=phase, points=(name,))


def _method_track(cfg: RunConfig, method: str) -> Track:
    phase = stage2_name(method)
    if method == "stage1_long":
        long = Step(kind="stage1", name=method, phase=phase, total=stage1_long_steps(cfg))
        head = _head_fit(f"head_init_{method}", phase)
        return Track(drafter=method, start=INIT, steps=(long, head))
    rounds = tuple(f"{phase}_round{r}" for r in range(cfg.stage2.rounds))
    run = (Step(kind="stage2", name=phase, phase=phase, method=method, points=rounds),)
    if cfg.stage2.head_refit:  # the head re-fitted to the drafter stage 2 left
        run += (_head_fit(f"head_refit_{method}", phase),)
    return Track(drafter=method, start="stage1", steps=run)


def tracks(cfg: RunConfig) -> tuple[Track, ...]:
    """The run's tracks in training order (the module docstring)."""
    total = cfg.stage1.steps if cfg.draft.init_from is None else 0
    stage1 = Step(kind="stage1", name="stage1", phase="stage1", total=total)
    first = Track(drafter="stage1", start=INIT, steps=(stage1, _head_fit("head_init", "head_init")))
    return (first, *(_method_track(cfg, m) for m in cfg.stage2.methods))


def steps(cfg: RunConfig) -> tuple[Step, ...]:
    """Every step of the run, in training order."""
    return tuple(step for track in tracks(cfg) for step in track.steps)


def calibration_points(cfg: RunConfig) -> list[str]:
    """Every calibration point of the run, in training order."""
    return [point for step in steps(cfg) for point in step.points]
