"""Verify-cost table: milliseconds of one decode step per (active rows, verify width).

Dimensions: NR row counts, NW widths (verify buckets), B rows, W width, C context length.

The goodput policy divides expected committed tokens by this cost, inside the jitted step, so
the table is static data (tuples, hashable). Goodput's is measured on the engine's own step
(`goodput/step_cost.py`, cached as JSON under `~/.cache/adaflash_jax/verify_cost/`, override:
`cache_dir=` or $ADAFLASH_CACHE, keyed by device kind, models and engine settings) or loaded
from any JSON file in this format. `calibrate` times bare forwards instead (the target verify
at each (rows, width), the drafter's block forward at each row count, over caches of the
engine's capacity: attention reads the whole fixed-size cache, masked, so the capacity, not
the filled length, sets the cost); the benchmark reads it for the ideal speedup.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FORMAT = "adaflash_jax.verify_cost/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyCostTable:
    rows: tuple[int, ...]  # ascending active-row counts
    widths: tuple[int, ...]  # ascending verify widths
    verify_ms: tuple[tuple[float, ...], ...]  # [NR][NW] target forward over W tokens per row
    draft_ms: tuple[float, ...]  # [NR] drafter block forward (same for every width)
    # one host switch between the engine's drafted and undrafted loop programs (measured by
    # the engine-step calibration; 0 where unknown)
    switch_ms: float = 0.0
    # one probe in the undrafted program: the drafter forward with the context flush before it
    # and the loop exit around it (engine-step calibration); None: the draft time
    probe_ms: float | None = None
    device: str = "unknown"
    model: str = ""  # free-form description of the shapes measured

    def __post_init__(self):
        object.__setattr__(self, "rows", tuple(int(r) for r in self.rows))
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        object.__setattr__(
            self, "verify_ms", tuple(tuple(float(x) for x in row) for row in self.verify_ms)
        )
        object.__setattr__(self, "draft_ms", tuple(float(x) for x in self.draft_ms))
        object.__setattr__(self, "switch_ms", float(self.switch_ms))
        if self.probe_ms is not None:
            object.__setattr__(self, "probe_ms", float(self.probe_ms))
            if not self.probe_ms >= 0:
                raise ValueError(f"probe_ms must be non-negative: {self.probe_ms}")
        if not self.rows or list(self.rows) != sorted(set(self.rows)) or self.rows[0] < 1:
            raise ValueError(f"cost table rows must be ascending positive ints: {self.rows}")
        if not self.widths or list(self.widths) != sorted(set(self.widths)) or self.widths[0] < 1:
            raise ValueError(f"cost table widths must be ascending positive ints: {self.widths}")
        if len(self.verify_ms) != len(self.rows) or any(
            len(r) != len(self.widths) for r in self.verify_ms
        ):
            raise ValueError("verify_ms must have one row per row count and one entry per width")
        if len(self.draft_ms) != len(self.rows):
            raise ValueError("draft_ms must have one entry per row count")
        if min(min(r) for r in self.verify_ms) <= 0 or min(self.draft_ms) < 0:
            raise ValueError("verify times must be positive and draft times non-negative")
        if not self.switch_ms >= 0:
            raise ValueError(f"switch_ms must be non-negative: {self.switch_ms}")

    # ---- lookups ------------------------------------------------------------------------
    def verify_step_ms(self, num_rows, widths: tuple[int, ...]) -> jax.Array:
        """Verify-only ms at each width in `widths` for `num_rows` active rows [NW] (jnp,
        traceable): linear in the row count between measured rows, clamped outside."""
        cols = [self.widths.index(w) for w in widths]
        verify_NRxNW = jnp.asarray(self.verify_ms, jnp.float32)[:, jnp.asarray(cols)]
        rows_NR = jnp.asarray(self.rows, jnp.float32)
        n = jnp.maximum(jnp.asarray(num_rows, jnp.float32), 1.0)
        return jax.vmap(lambda col: jnp.interp(n, rows_NR, col), in_axes=1)(verify_NRxNW)

    def draft_step_ms(self, num_rows) -> jax.Array:
        """The drafter's block forward for `num_rows` active rows (jnp scalar, traceable)."""
        n = jnp.maximum(jnp.asarray(num_rows, jnp.float32), 1.0)
        rows_NR = jnp.asarray(self.rows, jnp.float32)
        return jnp.interp(n, rows_NR, jnp.asarray(self.draft_ms, jnp.float32))

    def probe_step_ms(self, num_rows) -> jax.Array:
        """One probe's cost (jnp scalar): measured, else the drafter's block forward."""
        if self.probe_ms is not None:
            return jnp.asarray(self.probe_ms, jnp.float32)
        return self.draft_step_ms(num_rows)

    def step_ms(self, num_rows, widths: tuple[int, ...]) -> jax.Array:
        """Draft + verify ms at each width in `widths` for `num_rows` active rows [NW]."""
        return self.verify_step_ms(num_rows, widths) + self.draft_step_ms(num_rows)

    def verify(self, rows: int, width: int) -> float:
        """Host lookup of the measured verify ms (interpolated in rows)."""
        col = [r[self.widths.index(width)] for r in self.verify_ms]
        return float(np.interp(rows, self.rows, col))

    # ---- JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> VerifyCostTable:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a verify-cost table (format {data.get('format')!r})")
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


# ---- calibration -----------------------------------------------------------------------------
def default_cache_dir() -> str:
    base = os.environ.get("ADAFLASH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "adaflash_jax"
    )
    return os.path.join(base, "verify_cost")


def device_kind() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{dev.device_kind}"


def model_key(target, drafter) -> str:
    t = dataclasses.asdict(target.config)
    d = dataclasses.asdict(drafter.config) if drafter is not None else None
    dtypes = (str(target.dtype), str(getattr(drafter, "dtype", None)))
    return json.dumps([t, d, dtypes], sort_keys=True, default=str)


@functools.partial(jax.jit, static_argnames=("feature_layers",))
def _verify_fwd(target, tokens_BxW, cache, feature_layers):
    out = nnx.merge(*target)(tokens_BxW, cache=cache, feature_layers=feature_layers)
    return out.logits_BxTxV, out.features_BxTxnD, out.cache.k[0]


@jax.jit
def _draft_fwd(drafter, cache, bonus_B, embedding_VxD, lm_head_DxV):
    return nnx.merge(*drafter).draft(cache, bonus_B, embedding_VxD, lm_head_DxV)


def _median_ms(repeats: int, fn, *args) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def calibrate(
    target,
    drafter,
    *,
    rows: tuple[int, ...],
    widths: tuple[int, ...],
    capacity: int,
    context_len: int | None = None,
    repeats: int = 5,
) -> VerifyCostTable:
    """Times the target verify at each (rows, width) and the drafter block at each row count
    over caches of `capacity` slots holding `context_len` tokens (default: half full).
    Compiles one program per cell."""
    target_pair = nnx.split(target)
    layers = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
    if context_len is None:
        context_len = capacity // 2
    if context_len + max(widths) > capacity:
        raise ValueError(f"context {context_len} + width {max(widths)} exceeds capacity {capacity}")
    verify, draft = [], []
    for r in rows:
        cache = target.init_cache(r, capacity).with_lengths(jnp.full((r,), context_len))
        row = []
        for w in widths:
            tokens = jnp.zeros((r, w), jnp.int32)
            row.append(_median_ms(repeats, _verify_fwd, target_pair, tokens, cache, layers))
        verify.append(tuple(row))
        if drafter is None:
            draft.append(0.0)
            continue
        ctx = drafter.init_context_cache(r, capacity).with_lengths(jnp.full((r,), context_len))
        emb, head = target.embedding_VxD(), target.lm_head_DxV()
        bonus = jnp.zeros((r,), jnp.int32)
        pair = nnx.split(drafter)
        draft.append(_median_ms(repeats, _draft_fwd, pair, ctx, bonus, emb, head))
    return VerifyCostTable(
        rows=rows,
        widths=widths,
        verify_ms=tuple(verify),
        draft_ms=tuple(draft),
        device=device_kind(),
        model=f"capacity {capacity} ctx {context_len} "
        + hashlib.sha1(model_key(target, drafter).encode()).hexdigest(),
    )


def keyed_path(prefix: str, slots: int, key_parts, cache_dir: str | None = None) -> str:
    """`<cache_dir>/<prefix><device>-s<slots>-<hash of key_parts>.json` (device included)."""
    key = json.dumps([device_kind(), *key_parts])
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    kind = device_kind().replace(" ", "_").replace("/", "_").replace(":", "_")
    return os.path.join(cache_dir or default_cache_dir(), f"{prefix}{kind}-s{slots}-{digest}.json")


def cached_table(path: str, measure) -> VerifyCostTable:
    """The table cached at `path`, else `measure()` saved there."""
    if os.path.isfile(path):
        return VerifyCostTable.load(path)
    table = measure()
    table.save(path)
    return table
