"""Multi-process start-up reads the process count and id of local launches from the env."""

import jax

from adaflash_jax.distill import loop
from adaflash_jax.train import mesh
from adaflash_jax.train.checkpointing import Checkpointer


def test_local_launch_passes_process_ids(monkeypatch):
    seen = {}
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert mesh.maybe_initialize_distributed() is True
    assert seen == dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1)


def test_single_process_stop_flag_needs_no_collective(tmp_path):
    """One process: the guard's flag decides; orbax's preemption check (JAX's preemption
    service, which only `jax.distributed.initialize` starts) answers no."""

    class Guard:
        should_stop = True

    assert loop._stop_requested(None, Guard(), 0) is True
    assert loop._stop_requested(None, None, 0) is False
    with Checkpointer(tmp_path / "ckpt", save_every=10) as ckpt:
        assert loop._stop_requested(ckpt, None, 3) is False
        assert loop._stop_requested(ckpt, Guard(), 3) is True
