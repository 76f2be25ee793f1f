"""Resumable training checkpoints (orbax) and clean shutdown on SIGTERM.

A checkpoint holds the whole `TrainState` (params, optimizer state, step, rng) and the data
iterator's state (JSON), so a resumed run continues with the exact next batch and rng.
Saves are asynchronous (training continues while arrays are written), kept `keep` deep,
every `save_every` steps or on demand. Restore targets the abstract state WITH shardings,
so every array comes back directly in its training layout.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import orbax.checkpoint as ocp

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
        directory = os.fspath(directory)
        # Remote run dirs (gs://...) go to orbax untouched; abspath would mangle the scheme.
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=save_every,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(
        self, step: int, state, data_state: dict | None = None, *, force: bool = False
    ) -> bool:
        """Starts a save when `step` is due (or `force`); returns whether one started."""
        args = {"state": ocp.args.StandardSave(state)}
        args["data"] = ocp.args.JsonSave(data_state or {})
        return self._manager.save(step, args=ocp.args.Composite(**args), force=force)

    def restore(self, abstract_state, shardings, step: int | None = None):
        """(state, data_state) of `step` (default: latest), laid out as `shardings`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
        target = abstract_with_shardings(abstract_state, shardings)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
            ),
        )
        return out.state, dict(out.data or {})

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PreemptionGuard:
    """Turns SIGTERM (and optionally SIGINT) into a flag the loop checks between steps.

    The training loop then saves a checkpoint and returns normally instead of dying
    mid-write. Outside the main thread signal handlers cannot be installed; the guard then
    only honours `request_stop()`.
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
        if threading.current_thread() is threading.main_thread():
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self.request_stop)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
