"""Slot occupancy of the engine's scheduler, replayed from step counts alone, and the compact
per-step trace encoding the benchmark writes and the projection reads.

With FIFO admission and stop-on-finish the scheduler is deterministic, so each request's
start step follows from the step counts (`occupancy`): the benchmark checks it against the
measured loop steps and the projection replays it at other concurrencies.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"  # trace encoding: one base-36 digit per step


def occupancy(steps: Sequence[int], slots: int) -> tuple[np.ndarray, int]:
    """(start step per request, total loop steps) of FIFO admission into `slots` slots where
    a freed slot takes the next request before the next step (the engine's scheduler)."""
    starts = np.zeros(len(steps), np.int64)
    free_at = [0] * min(slots, len(steps))  # heap of times at which slots become free
    heapq.heapify(free_at)
    end = 0
    for i, n in enumerate(steps):
        t = heapq.heappop(free_at)
        starts[i] = t
        end = max(end, t + int(n))
        heapq.heappush(free_at, t + int(n))
    return starts, end


def running_per_step(steps: Sequence[int], slots: int) -> np.ndarray:
    starts, end = occupancy(steps, slots)
    delta = np.zeros(end + 1, np.int64)
    np.add.at(delta, starts, 1)
    np.add.at(delta, starts + np.asarray(steps, np.int64), -1)
    return np.cumsum(delta)[:end]


def encode_trace(values: Sequence[int], offset: int = 0) -> str:
    return "".join(DIGITS[int(v) - offset] for v in values)


def decode_trace(text: str, offset: int = 0) -> list[int]:
    return [int(ch, 36) + offset for ch in text]
