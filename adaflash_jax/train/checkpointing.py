"""Resumable training checkpoints (orbax) and clean shutdown on preemption.

A checkpoint step holds three items: `state` (the whole `TrainState`: params, optimizer
state, step, rng), `data` (the grain iterator's position, written by grain's own orbax
handler, one file per process) and `extra` (a small JSON dict the caller adds, e.g. the
stage-2 round). A resumed run therefore continues with the exact next batch and rng.
Saves are asynchronous (training continues while arrays are written), kept `keep` deep,
every `save_every` steps, on demand, or at a preemption sync point. Restore targets the
abstract state WITH shardings, so every array comes back directly in its training layout.

Preemption: on a multi-process run, JAX's preemption service (started by
`jax.distributed.initialize`) catches SIGTERM on any host and has every host agree on one
step, which `CheckpointManager.reached_preemption` reports; single-process runs have no
such service, so `PreemptionGuard` turns SIGTERM into a flag there.

Faults: orbax writes a step into a temporary directory and renames it when complete, so a
save killed halfway leaves no step (the next start resumes from the previous one, and orbax
removes the leftover). A save that fails (an `OSError` out of the writer, raised by `save`,
`wait` or `close`, whichever meets it first: saves are asynchronous) becomes `StorageError`,
one line naming the directory, the step and the last complete step, which stays intact.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import grain
import jax
import orbax.checkpoint as ocp

from adaflash_jax.io import fs
from adaflash_jax.io.fs import StorageError
from adaflash_jax.train.state import abstract_with_shardings

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int,
        keep: int = 2,
        async_save: bool = True,
    ):
        if save_every <= 0:
            raise ValueError(f"save_every must be positive, got {save_every}")
        if keep <= 0:
            raise ValueError(f"keep must be positive, got {keep}")
        self.directory = fs.absolute(directory)  # local or gs://
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=save_every,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self.restored_step: int | None = None
        self._saving: int | None = None  # the last step a save started for

    def _failed(self, e: OSError, step: int | None) -> StorageError:
        return StorageError(
            f"a checkpoint save in {self.directory} failed at step {step} "
            f"({type(e).__name__}: {' '.join(str(e).split())}); the last complete checkpoint, "
            f"step {self._manager.latest_step()}, is intact"
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def reached_preemption(self, step: int) -> bool:
        """Whether every process reached the step JAX's preemption service agreed on."""
        return self._manager.reached_preemption(step)

    def save(
        self, step: int, state, data=None, extra: dict | None = None, *, force: bool = False
    ) -> bool:
        """Starts a save when `step` is due (or `force`, or at a preemption sync point);
        `data` is the grain iterator. Returns whether one started."""
        args = {"state": ocp.args.StandardSave(state), "extra": ocp.args.JsonSave(extra or {})}
        if data is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data)
        try:
            started = self._manager.save(step, args=ocp.args.Composite(**args), force=force)
        except OSError as e:  # this save, or the previous one (asynchronous) failed
            raise self._failed(e, step) from None
        if started:
            self._saving = step
        return started

    def restore(self, abstract_state, shardings, step: int | None = None):
        """(state, extra) of `step` (default: latest), laid out as `shardings`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
        target = abstract_with_shardings(abstract_state, shardings)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore()
            ),
        )
        self.restored_step = step
        return out.state, dict(out.extra or {})

    def restore_data(self, iterator, step: int | None = None):
        """Moves a freshly built grain iterator to its checkpointed position (default: the
        step `restore` read)."""
        step = self.restored_step if step is None else step
        args = ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(iterator))
        return self._manager.restore(step, args=args).data

    def wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except OSError as e:
            raise self._failed(e, self._saving) from None

    def close(self) -> None:
        self.wait()
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PreemptionGuard:
    """Turns SIGTERM (and optionally SIGINT) into a flag the loop checks between steps, on
    single-process runs.

    The training loop then saves a checkpoint and returns normally instead of dying
    mid-write. Multi-process runs leave SIGTERM to JAX's preemption service (a Python
    handler would replace its own), and outside the main thread no handler can be
    installed; the guard then only honours `request_stop()`, which must then come at the
    same step on every process.
    """

    def __init__(self, signals=(signal.SIGTERM,)):
        self._signals = tuple(signals)
        self._stop = threading.Event()
        self._previous = {}

    @property
    def should_stop(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, *_args) -> None:
        if not self._stop.is_set():
            log.warning("stop requested: will checkpoint and exit at the next step boundary")
        self._stop.set()

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        if main and jax.process_count() == 1:
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self.request_stop)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
