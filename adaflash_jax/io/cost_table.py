"""The cost table: milliseconds of one engine step per (engine rows, verify width), in ONE
JSON format (`adaflash_jax.verify_cost/1`) that goodput, the benchmark and the projection read.

Dimensions: NR row counts, NW widths (verify buckets), NF fills (packed verify's mean tokens
per row), B rows, W width.

Both producers (the engine's loop programs timed, `bench/step_cost.py`; their TPU compiler
estimates, `aot/programs.py`) decompose the steps alike (`step_cost.table_from_steps`):
`verify_ms[·][W=1]` is the plain step, `draft_ms` the drafter's block forward, draft +
verify[W] the drafted step at width W. A packed form (optional) adds
`packed_ms[·][f]`: packed verify (docs/design.md §5.5) of rows·f tokens, so draft + packed[f]
is the drafted step at token bucket rows·f. Goodput reads it inside the jitted step, so the
table is static data (tuples).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "adaflash_jax.verify_cost/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyCostTable:
    rows: tuple[int, ...]  # ascending active-row counts
    widths: tuple[int, ...]  # ascending verify widths
    verify_ms: tuple[tuple[float, ...], ...]  # [NR][NW] target forward over W tokens per row
    draft_ms: tuple[float, ...]  # [NR] drafter block forward (same for every width)
    # one device call's own overhead (dispatch, loop entry, host fetch): what a host switch
    # between loop programs costs (0 where unknown)
    switch_ms: float = 0.0
    # packed verify: mean tokens per row of its token buckets (bucket M = rows·f), and the
    # [NR][NF] ms of its verify at each (empty: the table has no packed form)
    fills: tuple[int, ...] = ()
    packed_ms: tuple[tuple[float, ...], ...] = ()
    device: str = "unknown"
    model: str = ""  # free-form description of the shapes measured

    def __post_init__(self):
        fix = functools.partial(object.__setattr__, self)  # frozen: normalise in place
        fix("rows", tuple(int(r) for r in self.rows))
        fix("widths", tuple(int(w) for w in self.widths))
        fix("verify_ms", tuple(tuple(float(x) for x in row) for row in self.verify_ms))
        fix("draft_ms", tuple(float(x) for x in self.draft_ms))
        fix("switch_ms", float(self.switch_ms))
        fix("fills", tuple(int(f) for f in self.fills))
        fix("packed_ms", tuple(tuple(float(x) for x in row) for row in self.packed_ms))
        if self.fills or self.packed_ms:
            if list(self.fills) != sorted(set(self.fills)) or not self.fills[0] >= 1:
                raise ValueError(f"cost table fills must be ascending positive ints: {self.fills}")
            if [len(r) for r in self.packed_ms] != [len(self.fills)] * len(self.rows):
                raise ValueError("packed_ms must have one row per row count and one per fill")
            if min(min(r) for r in self.packed_ms) <= 0:
                raise ValueError("packed verify times must be positive")
        for name, xs in (("rows", self.rows), ("widths", self.widths)):
            if not xs or list(xs) != sorted(set(xs)) or xs[0] < 1:
                raise ValueError(f"cost table {name} must be ascending positive ints: {xs}")
        if [len(r) for r in self.verify_ms] != [len(self.widths)] * len(self.rows):
            raise ValueError("verify_ms must have one row per row count and one entry per width")
        if len(self.draft_ms) != len(self.rows):
            raise ValueError("draft_ms must have one entry per row count")
        if min(min(r) for r in self.verify_ms) <= 0 or min(self.draft_ms) < 0:
            raise ValueError("verify times must be positive and draft times non-negative")
        if not self.switch_ms >= 0:
            raise ValueError(f"switch_ms must be non-negative: {self.switch_ms}")

    # ---- lookups (jnp, traceable) --------------------------------------------------------
    def _in_rows(self, num_rows, values_NR) -> jax.Array:
        """At `num_rows` active rows: linear between measured row counts, clamped outside."""
        n = jnp.maximum(jnp.asarray(num_rows, jnp.float32), 1.0)
        return jnp.interp(n, jnp.asarray(self.rows, jnp.float32), values_NR)

    def verify_step_ms(self, num_rows, widths: tuple[int, ...]) -> jax.Array:
        """Verify-only ms at each width in `widths` for `num_rows` active rows [NW]."""
        cols = [self.widths.index(w) for w in widths]
        verify_NRxNW = jnp.asarray(self.verify_ms, jnp.float32)[:, jnp.asarray(cols)]
        return jax.vmap(lambda col_NR: self._in_rows(num_rows, col_NR), in_axes=1)(verify_NRxNW)

    def draft_step_ms(self, num_rows) -> jax.Array:
        """The drafter's block forward for `num_rows` active rows (scalar)."""
        return self._in_rows(num_rows, jnp.asarray(self.draft_ms, jnp.float32))

    def step_ms(self, num_rows, widths: tuple[int, ...]) -> jax.Array:
        """Draft + verify ms at each width in `widths` for `num_rows` active rows [NW]."""
        return self.verify_step_ms(num_rows, widths) + self.draft_step_ms(num_rows)

    def packed_step_ms(self, num_rows, fills: tuple[int, ...]) -> jax.Array:
        """Draft + packed verify ms at each fill in `fills` (token bucket rows·f) [NF]."""
        cols = [self.fills.index(f) for f in fills]
        packed_NRxNF = jnp.asarray(self.packed_ms, jnp.float32)[:, jnp.asarray(cols)]
        verify_NF = jax.vmap(lambda col_NR: self._in_rows(num_rows, col_NR), in_axes=1)(
            packed_NRxNF
        )
        return verify_NF + self.draft_step_ms(num_rows)

    def at_rows(self, rows: int) -> VerifyCostTable:
        """The one-row table of a measured row count (an engine's step costs the same however
        many of its slots are active)."""
        if rows not in self.rows:
            raise ValueError(f"cost table has rows {self.rows}, not {rows}")
        i = self.rows.index(rows)
        one = dict(rows=(rows,), verify_ms=(self.verify_ms[i],), draft_ms=(self.draft_ms[i],))
        if self.fills:
            one["packed_ms"] = (self.packed_ms[i],)
        return dataclasses.replace(self, **one)

    def verify(self, rows: int, width: int) -> float:
        """Host lookup of the measured verify ms (interpolated in rows)."""
        col = [r[self.widths.index(width)] for r in self.verify_ms]
        return float(np.interp(rows, self.rows, col))

    def packed(self, rows: int, fill: int) -> float:
        """Host lookup of the packed verify ms at token bucket rows·fill (interpolated)."""
        col = [r[self.fills.index(fill)] for r in self.packed_ms]
        return float(np.interp(rows, self.rows, col))

    # ---- JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> VerifyCostTable:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a cost table: format {got!r}, expected {FORMAT!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def save(self, path: str | os.PathLike) -> None:
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> VerifyCostTable:
        with open(path) as f:
            return cls.from_json(json.load(f))
