"""The train loop shared by every stage: resume, step, log, checkpoint, stop on preemption.

A stage's checkpoint directory holds its `TrainState` minus the frozen target, the grain
iterator's position (grain's orbax handler) and a JSON `extra` the caller adds (e.g. the
stage-2 round). `restore_or_start` restores the latest checkpoint when there is one, and
the caller moves its freshly built iterator there (`Checkpointer.restore_data`), so
calling it again after a kill continues with the exact next batch; the last step is always
saved (forced). Logged metrics are means over the log interval (TensorBoard and the
returned history), plus `skipped_total`: the stage's non-finite steps so far (skipped by the
optimizer, `train/optimizer.py`). At a log point with `max_skips` or more of them in a row
the run stops (`NonFiniteError`): the stop comes at most `log_every` steps after the limit,
and the weights are those of the last finite step, as is every checkpoint saved since.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from adaflash_jax.distill.state import checkpointable
from adaflash_jax.train.checkpointing import Checkpointer, PreemptionGuard
from adaflash_jax.train.optimizer import check_skips
from adaflash_jax.train.progress import Progress
from adaflash_jax.train.state import TrainState


def _stop_requested(ckpt: Checkpointer | None, guard, step: int) -> bool:
    """Orbax's preemption sync point (multi-process: JAX's preemption service has every host
    agree on the step) or the guard's flag (single process: SIGTERM; tests)."""
    if ckpt is not None and ckpt.reached_preemption(step):
        return True
    return guard is not None and guard.should_stop


class Preempted(RuntimeError):
    """Raised after a stop request (SIGTERM) once the checkpoint is safely written."""


@dataclasses.dataclass
class StageRun:
    name: str
    step_fn: Callable  # jitted (state, global batch) -> (state, metrics)
    put: Callable[[dict], dict]  # host rows -> global sharded batch
    batches: object  # grain DatasetIterator (checkpointed by grain's orbax handler)
    total_steps: int
    tokens_per_step: int
    log_every: int = 10
    writer: object | None = None  # ScalarWriter
    progress: bool = True
    on_step: Callable[[int], None] | None = None  # test hook: called after each step
    max_skips: int = 10  # non-finite steps in a row that stop the run


def restore_or_start(
    ckpt: Checkpointer | None, state: TrainState, shardings: TrainState
) -> tuple[TrainState, dict]:
    """(state, extra) from the latest checkpoint, re-attaching the frozen target; the
    iterator's position is restored separately (`ckpt.restore_data`)."""
    if ckpt is None or ckpt.latest_step() is None:
        return state, {}
    abstract = jax.eval_shape(lambda s: s, checkpointable(state))
    restored, extra = ckpt.restore(abstract, checkpointable(shardings))
    return restored.replace(frozen=state.frozen), extra


def run_stage(
    run: StageRun,
    state: TrainState,
    *,
    ckpt: Checkpointer | None,
    guard: PreemptionGuard | None,
    extra: dict | None = None,
) -> tuple[TrainState, list[dict]]:
    """Trains until `state.step == run.total_steps`; returns (state, logged metrics)."""
    history: list[dict] = []
    start = int(jax.device_get(state.step))
    if start >= run.total_steps:
        return state, history

    def save(step: int, force: bool):
        if ckpt is not None and ckpt.latest_step() != step:
            ckpt.save(step, checkpointable(state), run.batches, extra, force=force)

    with Progress(
        total=run.total_steps,
        initial=start,
        tokens_per_step=run.tokens_per_step,
        desc=run.name,
        enabled=run.progress and jax.process_index() == 0,
    ) as bar:
        t_last, steps_since = time.perf_counter(), 0
        summed, count = None, 0  # metrics summed on device over the log interval
        for step in range(start, run.total_steps):
            if _stop_requested(ckpt, guard, step):
                save(step, force=True)
                if ckpt is not None:
                    ckpt.wait()
                raise Preempted(f"{run.name}: stopped at step {step}, checkpoint saved")
            state, metrics = run.step_fn(state, run.put(next(run.batches)))
            summed = metrics if summed is None else jax.tree.map(jnp.add, summed, metrics)
            count += 1
            steps_since += 1
            done = step + 1
            if done == start + 1:
                bar.restart_clock()  # the first step compiled
                t_last, steps_since = time.perf_counter(), 0
            if done % run.log_every == 0 or done == run.total_steps or done == start + 1:
                m = {k: float(v) / count for k, v in jax.device_get(summed).items()}
                summed, count = None, 0
                now = time.perf_counter()
                if steps_since:
                    m["tokens_per_s"] = steps_since * run.tokens_per_step / (now - t_last)
                t_last, steps_since = now, 0
                m["step"] = done
                last = ckpt.latest_step() if ckpt is not None else None
                m["skipped_total"] = check_skips(
                    run.name, state.opt_state, done, run.max_skips, last
                )
                history.append(m)
                if run.writer is not None:
                    run.writer.write(
                        done,
                        {f"{run.name}/{k}": v for k, v in m.items() if k != "step"},
                    )
                bar.update(0, loss=m["loss"])
            bar.update(1)
            save(done, force=done == run.total_steps)
            if run.on_step is not None:
                run.on_step(done)
    if ckpt is not None:
        ckpt.wait()
    return state, history
