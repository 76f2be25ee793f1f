"""One program a run executes, ready to lower: a jitted function and abstract arguments.

`Program.lower()` lowers the project's own jitted function against ShapeDtypeStructs that
carry the shardings a mesh of abstract TPU chips gives them; `report.compile_program` then
compiles it and reads the compiler's memory and cost analyses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

KINDS = ("train", "decode")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    name: str  # e.g. "stage2", "engine W=4 B=64"
    kind: str  # "train" (MFU, tokens/s) or "decode" (against the weight-read floor)
    fn: Callable  # jitted: fn.lower(*args, **static)
    args: tuple
    static: dict = dataclasses.field(default_factory=dict)
    useful_flops: float = 0.0  # train: useful model FLOPs of one call, whole batch (flops.py)
    loop_flops: float = 0.0  # FLOPs the cost analysis leaves out (loop bodies counted once)
    tokens: int = 0  # train: tokens one step trains on (batch × sequence)
    weight_bytes: int = 0  # decode: weight bytes per chip one call must read
    rows: int = 0  # decode: rows (slots) per call
    width: int = 0  # decode: verify width (0: not a verify step)
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"program kind must be one of {KINDS}, got {self.kind!r}")

    def lower(self) -> Any:
        return self.fn.lower(*self.args, **self.static)
