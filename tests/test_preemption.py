"""SIGTERM on ONE process of a two-process run: JAX's preemption service (through orbax's
`reached_preemption`) stops both at one agreed step, orbax saves there (grain's position
file per process included), and a restart continues each process's batches exactly.

A save killed halfway (kill -9 during orbax's commit) leaves no step: the restart resumes
from the previous one with the same result. A save that keeps failing stops the run with
one line (`StorageError`) and leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from adaflash_jax.data.loader import batch_iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "preemption_worker.py")
SIGTERM_AT, TOTAL, BATCH = 3, 40, 4


def _pair(run_dir, *extra):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # os.environ carries conftest's XLA_FLAGS (faster XLA:CPU compiles) to the workers
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, run_dir, str(i), str(port), *extra],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    results = []
    for i in range(2):
        with open(os.path.join(run_dir, f"process{i}.json")) as f:
            results.append(json.load(f))
    return results


def test_sigterm_on_one_process_stops_both_at_one_step_and_resumes_exactly(tmp_path):
    run_dir = str(tmp_path)
    first = _pair(run_dir, "--sigterm-at", str(SIGTERM_AT))
    stop = first[0]["stopped_at"]
    assert stop is not None and stop == first[1]["stopped_at"], first  # one agreed step
    assert SIGTERM_AT <= stop < TOTAL
    step_dir = os.path.join(run_dir, "ckpt", str(stop))
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(
        os.listdir(os.path.join(step_dir, "data"))
    )
    second = _pair(run_dir)
    for p in range(2):
        assert second[p]["stopped_at"] is None
        steps = {**first[p]["steps"], **second[p]["steps"]}
        assert sorted(map(int, second[p]["steps"])) == list(range(stop + 1, TOTAL + 1))
        it = batch_iterator([{"x": np.int64(i)} for i in range(10)], global_batch=4, seed=3,
                            process_index=p, process_count=2)  # fmt: skip
        want = [next(it)["x"].tolist() for _ in range(TOTAL)]
        assert [steps[str(k)] for k in range(1, TOTAL + 1)] == want


def _single(run_dir, *extra) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    cmd = [sys.executable, WORKER, run_dir, "0", "0", "--single", "--save-every", "10", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_a_save_killed_halfway_resumes_from_the_previous_checkpoint(tmp_path):
    """kill -9 while orbax commits checkpoint 20 (the worker's hook stalls it there, every
    array written): the restart finds step 10 the latest, resumes there, and ends with the
    uninterrupted run's batches and weights."""
    run_dir = str(tmp_path)
    first = _single(run_dir, "--slow-save-at", "20")
    marker = os.path.join(run_dir, "saving_20")
    deadline = time.time() + 300
    while not os.path.exists(marker) and first.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert os.path.exists(marker), first.communicate(timeout=60)[0][-3000:]
    first.kill()  # SIGKILL in the middle of the save
    first.wait()
    ckpt = os.path.join(run_dir, "ckpt")
    assert "20" not in os.listdir(ckpt) and "10" in os.listdir(ckpt), os.listdir(ckpt)
    second = _single(run_dir)
    out = second.communicate(timeout=300)[0]
    assert second.returncode == 0, out[-3000:]
    with open(os.path.join(run_dir, "process0.json")) as f:
        got = json.load(f)
    assert sorted(map(int, got["steps"])) == list(range(11, TOTAL + 1))  # from step 10
    it = batch_iterator([{"x": np.int64(i)} for i in range(10)], global_batch=BATCH, seed=3,
                        process_index=0, process_count=1)  # fmt: skip
    want = [next(it)["x"].tolist() for _ in range(TOTAL)]
    assert [got["steps"][str(k)] for k in range(11, TOTAL + 1)] == want[10:]
    assert got["w"] == [float(sum(map(sum, want)))] * 3  # every batch applied exactly once


def _host_state():
    import jax
    import optax

    from adaflash_jax.train.optimizer import skip_nonfinite
    from adaflash_jax.train.state import TrainState

    params = {"w": np.zeros(3, np.float32)}
    opt_state = jax.tree.map(np.asarray, skip_nonfinite(optax.identity()).init(params))
    return TrainState(step=np.int32(0), params=params, opt_state=opt_state,
                      rng=np.zeros(2, np.uint32))  # fmt: skip


def _add_batch(state, batch):
    w = state.params["w"] + np.float32(batch["x"].sum())
    return state.replace(step=state.step + 1, params={"w": w}), {"loss": np.float32(0)}


def test_a_save_that_keeps_failing_stops_with_one_line_and_keeps_the_last(tmp_path, monkeypatch):
    """Every checkpoint write after the first (orbax saves step 1, then every 2) raises
    OSError: the stage stops with StorageError (one line: directory, step, last complete
    step) and checkpoint 1 restores intact."""
    import jax
    import orbax.checkpoint as ocp

    from adaflash_jax.distill.loop import StageRun, run_stage
    from adaflash_jax.io.fs import StorageError
    from adaflash_jax.train.checkpointing import Checkpointer

    save = ocp.StandardCheckpointHandler.async_save
    calls = []

    async def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:  # the first save (step 1) goes through
            raise OSError("injected: 503 Service Unavailable")
        return await save(self, *args, **kwargs)

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)
    it = batch_iterator([{"x": np.int64(i)} for i in range(10)], global_batch=BATCH, seed=3,
                        process_index=0, process_count=1)  # fmt: skip
    run = StageRun(name="s", step_fn=_add_batch, put=lambda b: b, batches=it, total_steps=8,
                   tokens_per_step=1, log_every=100, progress=False)  # fmt: skip
    directory = str(tmp_path / "ckpt")
    with pytest.raises(StorageError) as err:
        with Checkpointer(directory, save_every=2) as ckpt:
            run_stage(run, _host_state(), ckpt=ckpt, guard=None)
    message = str(err.value)
    assert "\n" not in message and directory in message and "503" in message, message
    assert "failed at step 2" in message and "checkpoint, step 1, is intact" in message, message
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", save)
    with Checkpointer(directory, save_every=2) as ckpt:
        assert ckpt.latest_step() == 1
        state = _host_state()
        everywhere = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        restored, _ = ckpt.restore(state, jax.tree.map(lambda _: everywhere, state))
    it = batch_iterator([{"x": np.int64(i)} for i in range(10)], global_batch=BATCH, seed=3,
                        process_index=0, process_count=1)  # fmt: skip
    want = int(next(it)["x"].sum())
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), [want] * 3)
    assert int(restored.step) == 1
