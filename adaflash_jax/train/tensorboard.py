"""TensorBoard scalars through tensorboardX, which needs no TensorFlow and writes local
directories and `gs://` ones (through google-cloud-storage) alike. Only process 0 writes.

`read_scalars` reads event files back with tensorboard's own loader (tests and reports).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tensorboardX import SummaryWriter

from adaflash_jax.io import fs


class ScalarWriter:
    def __init__(self, logdir: str | os.PathLike, *, enabled: bool | None = None):
        if enabled is None:
            import jax

            enabled = jax.process_index() == 0
        self.logdir = fs.absolute(logdir)
        self._writer = SummaryWriter(self.logdir, flush_secs=30) if enabled else None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), global_step=int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from the event files in `logdir` (for tests and reports)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out: dict[str, list[tuple[int, float]]] = {}
    logdir = fs.absolute(logdir)
    for name in fs.listdir(logdir):
        if "tfevents" not in name:
            continue
        for event in EventFileLoader(fs.join(logdir, name)).Load():
            for v in event.summary.value:  # the loader turns simple values into tensors
                if v.HasField("simple_value"):
                    value = v.simple_value
                elif v.HasField("tensor") and v.tensor.float_val:
                    value = v.tensor.float_val[0]
                else:
                    continue
                out.setdefault(v.tag, []).append((int(event.step), float(value)))
    return out
