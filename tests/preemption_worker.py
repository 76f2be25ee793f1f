"""One process of the two-process preemption check (launched by tests/test_preemption.py).

    python tests/preemption_worker.py RUN_DIR PROCESS_ID PORT [--sigterm-at N]
    python tests/preemption_worker.py RUN_DIR 0 0 --single --save-every 10 [--slow-save-at N]

Runs `distill.loop.run_stage` with a trivial host-side step (no model: the step only counts
and records the batch it got) over grain batches of this process, with orbax checkpoints
in RUN_DIR/ckpt. With --sigterm-at N, process 1 alone sends itself SIGTERM after step N:
JAX's preemption service must stop both processes at one agreed step, where orbax saves.
Writes RUN_DIR/process<I>.json: {"stopped_at", "steps": {step: batch}, "w": the final
parameter, the sum of every batch the steps saw since the start (checkpointed)}.

--single runs one process without jax.distributed. --slow-save-at N is the interrupted-save
hook: orbax's commit of checkpoint N (the rename of its temporary directory, after every
array is written) first writes RUN_DIR/saving_N and then waits for a minute, so that the
test can kill -9 the process in the middle of that save.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

TOTAL, SAVE_EVERY, BATCH = 40, 100, 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("process_id", type=int)
    p.add_argument("port", type=int)
    p.add_argument("--sigterm-at", type=int)
    p.add_argument("--single", action="store_true")
    p.add_argument("--save-every", type=int, default=SAVE_EVERY)
    p.add_argument("--slow-save-at", type=int)
    a = p.parse_args()
    import jax

    processes = 1 if a.single else 2
    if not a.single:
        jax.distributed.initialize(f"127.0.0.1:{a.port}", num_processes=2,
                                   process_id=a.process_id)  # fmt: skip
    if a.slow_save_at is not None:
        slow_save(a.run_dir, a.slow_save_at)
    import numpy as np
    import optax

    from adaflash_jax.data.loader import batch_iterator
    from adaflash_jax.distill.loop import Preempted, StageRun, run_stage
    from adaflash_jax.train.checkpointing import Checkpointer, PreemptionGuard
    from adaflash_jax.train.optimizer import skip_nonfinite
    from adaflash_jax.train.state import TrainState

    seen: dict[int, list[int]] = {}

    def step_fn(state, batch):
        seen[int(state.step) + 1] = batch["x"].tolist()
        time.sleep(0.05)  # a step takes time: the SIGTERM lands between steps
        params = {"w": state.params["w"] + np.float32(batch["x"].sum())}
        loss = np.float32(batch["x"].sum())
        return state.replace(step=state.step + 1, params=params), {"loss": loss}

    def on_step(done):
        if done == a.sigterm_at and a.process_id == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    source = [{"x": np.int64(i)} for i in range(10)]
    it = batch_iterator(source, global_batch=BATCH, seed=3, process_index=a.process_id,
                        process_count=processes)  # fmt: skip
    params = {"w": np.zeros(3, np.float32)}
    # the loop reads the optimizer's skip counts; host arrays, as the rest of this state
    opt_state = jax.tree.map(np.asarray, skip_nonfinite(optax.identity()).init(params))
    state = TrainState(step=np.int32(0), params=params, opt_state=opt_state,
                       rng=np.zeros(2, np.uint32))  # fmt: skip
    ckpt = Checkpointer(os.path.join(a.run_dir, "ckpt"), save_every=a.save_every)
    if ckpt.latest_step() is not None:
        mesh = jax.make_mesh((processes,), ("data",))  # one device per process: replicated
        everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        restored, _ = ckpt.restore(state, jax.tree.map(lambda _: everywhere, state))
        state = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), restored)
        ckpt.restore_data(it)
    run = StageRun(name="s", step_fn=step_fn, put=lambda b: b, batches=it, total_steps=TOTAL,
                   tokens_per_step=1, log_every=1000, progress=False, on_step=on_step)  # fmt: skip
    stopped = None
    with ckpt, PreemptionGuard() as guard:
        try:
            state, _ = run_stage(run, state, ckpt=ckpt, guard=guard)
        except Preempted:
            stopped = max(seen)
    with open(os.path.join(a.run_dir, f"process{a.process_id}.json"), "w") as f:
        json.dump({"stopped_at": stopped, "steps": seen, "w": state.params["w"].tolist()}, f)


STALL: dict = {}  # slow_save's step and run directory
_FINALIZE: list = []  # orbax's own commit


async def _stalled_finalize(self, *args, **kwargs):
    if self.get_final().name == str(STALL["step"]):
        with open(os.path.join(STALL["run_dir"], f"saving_{STALL['step']}"), "w") as f:
            f.write(str(self.get_final()))
        time.sleep(60)
    return await _FINALIZE[0](self, *args, **kwargs)


def slow_save(run_dir: str, step: int) -> None:
    """Test hook: checkpoint `step`'s commit (orbax renames the finished temporary directory)
    announces itself in RUN_DIR/saving_<step>, then stalls."""
    from orbax.checkpoint._src.path import atomicity

    STALL.update(step=step, run_dir=run_dir)
    _FINALIZE.append(atomicity.AtomicRenameTemporaryPath.finalize)
    atomicity.AtomicRenameTemporaryPath.finalize = _stalled_finalize


if __name__ == "__main__":
    main()
