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
    assert mesh.maybe_initialize_distributed(heartbeat_timeout_s=7) is True
    assert seen == dict(
        coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1,
        initialization_timeout=300, heartbeat_timeout_seconds=7, shutdown_timeout_seconds=300,
    )  # fmt: skip


def test_run_passes_the_configs_timeouts(monkeypatch):
    """`pipeline.run` starts the runtime with the config's `distributed` timeouts."""
    from adaflash_jax.distill import config as C
    from adaflash_jax.distill import pipeline

    seen = {}

    class Stop(Exception):
        pass

    def fake_prepare(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(mesh, "maybe_initialize_distributed", lambda **kw: seen.update(kw))
    monkeypatch.setattr(pipeline, "prepare", fake_prepare)
    spec = C.DistributedSpec(init_timeout_s=11, heartbeat_timeout_s=12, shutdown_timeout_s=13)
    try:
        pipeline.run(C.RunConfig(distributed=spec))
    except Stop:
        pass
    assert seen == dict(init_timeout_s=11, heartbeat_timeout_s=12, shutdown_timeout_s=13)


def test_a_lost_peer_is_recognised_only_on_multi_process_runs(monkeypatch):
    gloo = ValueError("UNKNOWN: Gloo all-reduce failed: [pair.cc:547] Connection closed by peer")
    assert not mesh.is_peer_loss(gloo)  # one process: no peer to lose
    mesh.exit_on_peer_loss(gloo)  # returns
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert mesh.is_peer_loss(gloo)
    assert not mesh.is_peer_loss(ValueError("RESOURCE_EXHAUSTED: out of memory"))


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


def test_the_distill_cli_ends_on_a_lost_peer_with_one_line(monkeypatch, capsys):
    """`experiments.distill` on a multi-process run whose collective lost its peer: one line
    on stderr and exit 3, without the runtime's exit barrier (`os._exit`, faked here)."""
    import pytest

    from adaflash_jax.distill import pipeline
    from experiments import distill

    class Exited(Exception):
        pass

    def lost(*args, **kwargs):
        raise ValueError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer [1.2.3.4]")

    def fake_exit(code):
        raise Exited(code)

    monkeypatch.setattr(pipeline, "run", lost)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(mesh.os, "_exit", fake_exit)
    with pytest.raises(Exited) as exited:
        distill.main(["--no-progress"])
    assert exited.value.args == (mesh.PEER_LOST_EXIT,)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stopped: process 0 of 2 lost a peer process")
    assert "Connection closed by peer" in err[0]
    monkeypatch.setattr(jax, "process_count", lambda: 1)  # one process: a plain traceback
    with pytest.raises(ValueError, match="Gloo"):
        distill.main(["--no-progress"])
