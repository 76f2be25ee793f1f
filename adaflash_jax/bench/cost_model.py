"""Step-cost model for projections: verify ms per (batch B, width W) and draft ms per B, filled
from whatever measurements exist, every filled cell explained.

Inputs (several may be merged; a later file's cell replaces an earlier one): cost tables
(`io/cost_table.py`, from `bench.step_cost` or a TPU compile), and, read as they are,
the bare-forward timing rows of `experiments.benchmark_forward` / `benchmark_decode --shape`
({"rows": [{batch, width, median_ms}], optional "draft_rows": [{batch, median_ms}]}: the
committed H200 measurements in benchmarks/h200/).

Filling a missing (B, W): inside row B's measured widths, linear in W between the nearest
two; outside them, row B's nearest measured width scaled by the width profile of the nearest
row (in log B) that has both widths. Between rows, costs are linear in B; outside the
measured rows nothing is extrapolated (a clear error).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from adaflash_jax.io.cost_table import VerifyCostTable

# docs/design.md §7: a 5-layer DFlash-shaped drafter (Qwen3-8B widths) over 16 block tokens, context
# 1024, one H200, naive jnp forward; median ms per batch size.
DESIGN_DRAFT_MS = {1: 2.613, 8: 3.012, 32: 5.364, 64: 8.829, 128: 16.148}


class CostError(ValueError):
    """Cost measurements that cannot give the requested cells."""


@dataclasses.dataclass
class Measurements:
    verify: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    draft: dict[int, float] = dataclasses.field(default_factory=dict)
    packed: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (B, fill)
    sources: list[str] = dataclasses.field(default_factory=list)


def add_table(m: Measurements, table: VerifyCostTable, source: str) -> Measurements:
    """Adds every cell of a cost table to `m`."""
    for i, b in enumerate(table.rows):
        for j, w in enumerate(table.widths):
            m.verify[(b, w)] = table.verify_ms[i][j]
        if table.draft_ms[i] > 0:
            m.draft[b] = table.draft_ms[i]
        for j, f in enumerate(table.fills):
            m.packed[(b, f)] = table.packed_ms[i][j]
    m.sources.append(source)
    return m


def read_cost_json(path: str, into: Measurements | None = None) -> Measurements:
    """Adds the cells of one cost file (a cost table, or bare-forward timing rows) to `into`."""
    m = into if into is not None else Measurements()
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "format" not in data and "rows" in data:
        try:
            for r in data["rows"]:
                m.verify[(int(r["batch"]), int(r["width"]))] = float(r["median_ms"])
            for r in data.get("draft_rows", []):
                m.draft[int(r["batch"])] = float(r["median_ms"])
        except (KeyError, TypeError, ValueError) as e:
            raise CostError(f"{path}: a timing row lacks batch/width/median_ms ({e!r})") from None
        m.sources.append(path)
        return m
    try:
        return add_table(m, VerifyCostTable.from_json(data), path)
    except (ValueError, TypeError) as e:
        raise CostError(f"{path}: {e} (or bare-forward timing rows)") from None


@dataclasses.dataclass(frozen=True)
class CostModel:
    rows: tuple[int, ...]
    widths: tuple[int, ...]
    verify_ms: np.ndarray  # [rows, widths], every cell filled
    draft_rows: tuple[int, ...]
    draft_ms: tuple[float, ...]
    notes: tuple[str, ...]  # how each missing cell was filled
    # packed verify ms per (B, fill: mean tokens per row), as measured (no filling)
    packed_cells: dict = dataclasses.field(default_factory=dict)

    def _check(self, b: float, rows) -> None:
        if not rows[0] <= b <= rows[-1]:
            raise CostError(f"batch {b} is outside the measured rows {list(rows)}")

    def verify(self, b: float, w: int) -> float:
        self._check(b, self.rows)
        return float(np.interp(b, self.rows, self.verify_ms[:, self.widths.index(w)]))

    def draft(self, b: float) -> float:
        self._check(b, self.draft_rows)
        return float(np.interp(b, self.draft_rows, self.draft_ms))

    def packed_fills(self, b: float) -> tuple[int, ...]:
        """The fills measured at every row count bracketing `b` (() without a packed form)."""
        rows = sorted({r for r, _ in self.packed_cells})
        if not rows or not rows[0] <= b <= rows[-1]:
            return ()
        near = [r for r in rows if r <= b][-1:] + [r for r in rows if r >= b][:1]
        fills = [{f for r, f in self.packed_cells if r == n} for n in near]
        return tuple(sorted(set.intersection(*fills)))

    def packed(self, b: float, fill: int) -> float:
        """Packed verify ms at token bucket b·fill, linear in B between measured rows."""
        rows = sorted(r for r, f in self.packed_cells if f == fill)
        self._check(b, rows or [math.inf])
        return float(np.interp(b, rows, [self.packed_cells[(r, fill)] for r in rows]))


def _nearest(rows, b):
    return sorted(rows, key=lambda r: (abs(math.log(r) - math.log(b)), -r))


def build(m: Measurements, widths, *, draft_ms: dict[int, float] | None = None) -> CostModel:
    """The model at `widths` for every measured row. `draft_ms` overrides the files' draft."""
    widths = tuple(sorted(set(int(w) for w in widths)))
    rows = tuple(sorted({b for b, _ in m.verify}))
    if not rows:
        raise CostError("no verify timings")
    notes, cells = [], dict(m.verify)
    for b in rows:  # pass 1: inside a row's measured widths, linear in W
        have = sorted(w for bb, w in m.verify if bb == b)
        for w in widths:
            if (b, w) not in cells and have[0] < w < have[-1]:
                lo = max(x for x in have if x < w)
                hi = min(x for x in have if x > w)
                cells[(b, w)] = float(
                    np.interp(w, [lo, hi], [m.verify[(b, lo)], m.verify[(b, hi)]])
                )
                notes.append(f"B={b} W={w}: linear in width between W={lo} and W={hi}")
    missing = [(b, w) for b in rows for w in widths if (b, w) not in cells]
    while missing:  # pass 2: outside them, borrow the width profile of the nearest row
        progress = []
        for b, w in missing:
            have = sorted(x for bb, x in m.verify if bb == b)
            near = min(have, key=lambda x: (abs(x - w), x))
            donors = [r for r in _nearest(rows, b) if r != b]
            donor = next((r for r in donors if {(r, w), (r, near)} <= cells.keys()), None)
            if donor is not None:
                cells[(b, w)] = m.verify[(b, near)] * cells[(donor, w)] / cells[(donor, near)]
                notes.append(
                    f"B={b} W={w}: B={b} W={near} times the W={w}/W={near} ratio of B={donor}"
                )
                progress.append((b, w))
        if not progress:
            raise CostError(f"cannot fill {missing[:4]}: no row has those widths")
        missing = [x for x in missing if x not in progress]
    grid = np.array([[cells[(b, w)] for w in widths] for b in rows])
    draft = dict(draft_ms) if draft_ms is not None else dict(m.draft)
    if not draft:
        draft = dict(DESIGN_DRAFT_MS)
        notes.append("draft cost: docs/design.md §7 (5 layers, 16 tokens, Qwen3-8B widths, H200)")
    d_rows = tuple(sorted(draft))
    return CostModel(
        rows=rows,
        widths=widths,
        verify_ms=grid,
        draft_rows=d_rows,
        draft_ms=tuple(float(draft[b]) for b in d_rows),
        notes=tuple(notes),
        packed_cells=dict(m.packed),
    )


def parse_draft_ms(text: str) -> dict[int, float]:
    """'1:2.6,128:16' → {1: 2.6, 128: 16.0}."""
    out = {}
    for item in text.split(","):
        b, sep, ms = item.partition(":")
        if not sep:
            raise CostError(f"--draft-ms wants BATCH:MS pairs, got {item!r}")
        out[int(b)] = float(ms)
    return out
