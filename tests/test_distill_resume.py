"""Kill after step n, resume from the checkpoint: the resumed steps match an uninterrupted
run exactly (params, optimizer, step, rng and the grain iterator's position, which grain's
orbax handler checkpoints, are restored).

SIGTERM: the guard's flag stops the loop, which saves step n and exits cleanly.
kill -9: a subprocess (this file run as a script) dies at once after step n, perhaps in the
middle of an asynchronous save; the resume starts from the newest complete checkpoint.
"""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.distill import steps
from adaflash_jax.distill.batches import SequenceData, batch_iterator
from adaflash_jax.distill.loop import Preempted, StageRun, restore_or_start, run_stage
from adaflash_jax.distill.state import fresh_drafter, new_train_state
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.checkpointing import Checkpointer, PreemptionGuard
from adaflash_jax.train.mesh import make_mesh
from adaflash_jax.train.optimizer import OptimizerConfig

TARGET = target_preset("test", vocab_size=96)
B, S, N, K, STOP, TOTAL = 8, 32, 3, 4, 3, 6
KILL_AT, SAVE_EVERY = 5, 2  # the kill -9 case: saves at 2 and 4 (asynchronous), dies after 5


@pytest.fixture(scope="module")
def world():
    return _world()


def _world():
    mesh = make_mesh(4, 2, 1)
    target = TargetLM(TARGET, rngs=nnx.Rngs(0))
    t_graph, t_params = nnx.split(target, nnx.Param)
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=95, num_layers=1, block_size=K, target_layer_ids=(0, 1)
    )
    d_graph, d_params = fresh_drafter(cfg, mesh=mesh, rules=TRAIN_RULES, seed=0)
    rng = np.random.default_rng(0)
    mask = np.zeros((10, S), bool)
    mask[:, 8:28] = True
    data = SequenceData(
        tokens=rng.integers(0, 90, (10, S)).astype(np.int32),
        loss_mask=mask,
        domain=np.zeros(10, np.int32),
    )
    opt = OptimizerConfig(lr=3e-3, schedule="cosine", total_steps=TOTAL, warmup_steps=2)
    tx, schedules = steps.make_optimizer({"drafter": opt, "head": None}, clip_norm=1.0)
    state, shardings = new_train_state(
        d_params, jax.tree.map(np.asarray, t_params), tx, mesh=mesh, rules=TRAIN_RULES, seed=0
    )
    bsh = steps.batch_shardings(mesh, TRAIN_RULES, B)
    spec = steps.StepSpec(kind="stage1", block_size=K, gamma=2.0, feature_layers=(0, 1))
    fn = steps.jit_step(
        steps.make_step(spec, d_graph, t_graph, tx, schedules),
        state_shardings=shardings,
        batch_shardings_=bsh,
    )
    # Keep host copies: every run starts from a fresh device state (the step donates).
    host = jax.device_get(state)
    return dict(host=host, shardings=shardings, data=data, fn=fn, bsh=bsh)


def _train(w, ckpt_dir, stop_after=None, kill=signal.SIGTERM, save_every=100, log=None):
    """One 'process': build state, restore if a checkpoint exists, train to TOTAL."""
    state = jax.device_put(w["host"], w["shardings"])
    ckpt = Checkpointer(ckpt_dir, save_every=save_every, keep=2)
    state, _ = restore_or_start(ckpt, state, w["shardings"])
    it = batch_iterator(w["data"], global_batch=B, num_anchors=N, block_size=K, seed=5)
    if ckpt.restored_step is not None:
        ckpt.restore_data(it)
    run = StageRun(
        name="stage1",
        step_fn=w["fn"],
        put=lambda b: steps.put_batch(b, w["bsh"]),
        batches=it,
        total_steps=TOTAL,
        tokens_per_step=B * S,
        log_every=1,
        writer=log,
        on_step=lambda done: done == stop_after and os.kill(os.getpid(), kill),
    )
    with ckpt, PreemptionGuard() as guard:
        _, history = run_stage(run, state, ckpt=ckpt, guard=guard)
    return {int(m["step"]): m["loss"] for m in history}


def test_kill_and_resume_matches_uninterrupted(world, tmp_path):
    straight = _train(world, str(tmp_path / "straight"))
    with pytest.raises(Preempted, match=f"step {STOP}"):
        _train(world, str(tmp_path / "killed"), stop_after=STOP)
    assert Checkpointer(str(tmp_path / "killed"), save_every=100).latest_step() == STOP
    data_files = os.listdir(tmp_path / "killed" / str(STOP) / "data")
    assert "process_0-of-1.json" in data_files  # grain's orbax handler wrote the position
    resumed = _train(world, str(tmp_path / "killed"))
    assert sorted(resumed) == [STOP + 1, STOP + 2, STOP + 3]
    for step in resumed:
        np.testing.assert_allclose(resumed[step], straight[step], rtol=1e-6)
    assert len(set(straight.values())) == len(straight)  # losses really move

    # kill -9 after step KILL_AT in a subprocess, then resume here
    ckpt_dir, log = str(tmp_path / "kill9"), str(tmp_path / "kill9.jsonl")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "tests.test_distill_resume", ckpt_dir, log]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    with open(log) as f:
        before = {int(r["step"]): r["loss"] for r in map(json.loads, f)}
    assert sorted(before) == list(range(1, KILL_AT + 1))
    latest = Checkpointer(ckpt_dir, save_every=SAVE_EVERY).latest_step()
    assert latest in (SAVE_EVERY, 2 * SAVE_EVERY), latest  # the newest complete save
    resumed = _train(world, ckpt_dir, save_every=SAVE_EVERY)
    assert sorted(resumed) == list(range(latest + 1, TOTAL + 1))
    for step, loss in [*before.items(), *resumed.items()]:
        np.testing.assert_allclose(loss, straight[step], rtol=1e-6)


class _JsonLog:
    """A ScalarWriter stand-in that appends each step's loss to a file, flushed at once."""

    def __init__(self, path):
        self.f = open(path, "a")  # noqa: SIM115

    def write(self, step, scalars):
        self.f.write(json.dumps({"step": step, "loss": scalars["stage1/loss"]}) + "\n")
        self.f.flush()


if __name__ == "__main__":  # the kill -9 victim: python -m tests.test_distill_resume CKPT LOG
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import conftest  # noqa: F401 - the test session's devices and XLA flags

    _train(_world(), sys.argv[1], stop_after=KILL_AT, kill=signal.SIGKILL,
           save_every=SAVE_EVERY, log=_JsonLog(sys.argv[2]))  # fmt: skip
