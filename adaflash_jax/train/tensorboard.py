"""TensorBoard scalars without TensorFlow: tensorboard's own event writer and protobufs.

Only process 0 writes. When the `tensorboard` package is missing, scalars go to
`scalars.jsonl` in the same directory instead (one JSON object per step), with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


class ScalarWriter:
    def __init__(self, logdir: str | os.PathLike, *, enabled: bool | None = None):
        if enabled is None:
            import jax

            enabled = jax.process_index() == 0
        self.logdir = os.fspath(logdir)
        self._writer = self._jsonl = None
        if not enabled:
            return
        os.makedirs(self.logdir, exist_ok=True)
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            log.warning("tensorboard is not installed: writing scalars to scalars.jsonl")
            self._jsonl = open(os.path.join(self.logdir, "scalars.jsonl"), "a")  # noqa: SIM115
            return
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._writer = EventFileWriter(self.logdir)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        values = {k: float(v) for k, v in scalars.items()}
        if self._writer is not None:
            summary = self._summary_pb2.Summary(
                value=[
                    self._summary_pb2.Summary.Value(tag=k, simple_value=v)
                    for k, v in values.items()
                ]
            )
            event = self._event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary)
            self._writer.add_event(event)
        elif self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": int(step), **values}) + "\n")

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()
        elif self._jsonl is not None:
            self._jsonl.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from the event files in `logdir` (for tests and reports)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out: dict[str, list[tuple[int, float]]] = {}
    for name in sorted(os.listdir(logdir)):
        if "tfevents" not in name:
            continue
        for event in EventFileLoader(os.path.join(logdir, name)).Load():
            for v in event.summary.value:
                value = v.simple_value if v.HasField("simple_value") else None
                if value is None and v.HasField("tensor"):
                    value = float(v.tensor.float_val[0]) if v.tensor.float_val else None
                if value is not None:
                    out.setdefault(v.tag, []).append((int(event.step), float(value)))
    return out
