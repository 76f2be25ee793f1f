"""GPU-shaped timings with random weights: the verify table per (batch, width), the drafter's
block forward per batch, the plain decode step at batch 1 against the weight-read floor.

Dimensions: B batch rows, W verify width (new tokens per row), C cached context, K block.

Builds on `forward_timing` (random target, jitted verify with cache rollback); the drafter
is a DFlash-shaped model of the target's widths, initialised leaf by leaf like the target
(a jitted init of a big model compiles for minutes).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.bench.forward_timing import (
    make_verify_fn,
    random_state,
    random_target,
    time_forward,
)
from adaflash_jax.bench.shapes import weight_bytes
from adaflash_jax.bench.step_cost import measure
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter

DECODE_GOAL = 1.5  # issue 4: a plain decode step within 1.5x the weight-read floor


def floor_ms(cfg, bandwidth_tbs: float) -> float:
    return weight_bytes(cfg) / (bandwidth_tbs * 1e12) * 1e3


def verify_table(
    graphdef, state, cfg, *, batches, widths, context: int, iters: int, log=print, rows=None
):
    """Median ms of the cached target forward at every (batch, width), appended to `rows`
    as they come (a run cut short keeps the finished cells)."""
    verify_fn = make_verify_fn(graphdef)
    rows = [] if rows is None else rows
    for b in batches:
        for w in widths:
            r = time_forward(
                graphdef, state, cfg, batch=b, width=w, context=context, iters=iters,
                verify_fn=verify_fn,
            )  # fmt: skip
            rows.append(r)
            log(f"verify B={b:4d} W={w:3d}  median {r['median_ms']:8.2f} ms  "
                f"first call {r['first_call_s']:.1f} s")  # fmt: skip
    return rows


def random_drafter(target_cfg, *, layers: int, block_size: int, dtype=jnp.bfloat16, seed=1):
    """(graphdef, state) of a random DFlash-shaped drafter for the target's widths."""
    cfg = DrafterConfig.for_target(
        target_cfg,
        mask_token_id=target_cfg.vocab_size - 1,
        num_layers=layers,
        block_size=block_size,
        num_features=min(5, target_cfg.num_hidden_layers),
        length_head=False,
    )
    abstract = nnx.eval_shape(
        lambda: Drafter(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)
    )
    return random_state(abstract, seed)


def draft_times(
    tgraph, tstate, dgraph, dstate, *, batches, context: int, iters: int, log=print, rows=None
):
    """Median ms of one drafter block forward (K tokens, LM head on K−1) per batch size."""

    @jax.jit
    def draft(dstate, tstate, cache, bonus_B):
        target, drafter = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
        out = drafter.draft(cache, bonus_B, target.embedding_VxD(), target.lm_head_DxV())
        return jnp.argmax(out.logits_BxKm1xV, axis=-1)

    drafter = nnx.merge(dgraph, dstate)
    rows = [] if rows is None else rows
    for b in batches:
        cache = drafter.init_context_cache(b, context + drafter.config.block_size)
        cache = cache.with_lengths(jnp.full((b,), context, jnp.int32))
        bonus = jnp.zeros((b,), jnp.int32)
        t0 = time.perf_counter()
        draft(dstate, tstate, cache, bonus).block_until_ready()
        first = time.perf_counter() - t0
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            draft(dstate, tstate, cache, bonus).block_until_ready()
            times.append(time.perf_counter() - t0)
        rows.append({"batch": b, "median_ms": float(np.median(times) * 1e3), "first_call_s": first})
        log(f"draft  B={b:4d} K={drafter.config.block_size:3d}  median "
            f"{rows[-1]['median_ms']:8.2f} ms  first call {first:.1f} s")  # fmt: skip
    return rows


def markdown_grid(rows, floor: float | None = None) -> str:
    """docs/design.md §7-style table: batch rows × width columns, median ms."""
    batches = sorted({r["batch"] for r in rows})
    widths = sorted({r["width"] for r in rows})
    cells = {(r["batch"], r["width"]): r["median_ms"] for r in rows}
    lines = ["| B \\ W | " + " | ".join(str(w) for w in widths) + " |"]
    lines.append("|---|" + "---|" * len(widths))
    for b in batches:
        vals = [f"{cells[(b, w)]:.3g}" if (b, w) in cells else "" for w in widths]
        lines.append(f"| {b} | " + " | ".join(vals) + " |")
    if floor is not None:
        lines.append(f"\nweight-read floor of one step: {floor:.2f} ms")
    return "\n".join(lines)


def shape_tables(
    cfg, name: str, *, batches, widths, context: int, iters: int, bandwidth_tbs: float,
    draft_layers: int = 0, block_size: int = 16, draft_batches=None, report: dict, log=print,
):  # fmt: skip
    """The verify table of random bf16 weights of `cfg` and, with `draft_layers`, the drafter
    block forward per batch, filled into `report` as they come (a run cut short keeps what
    it has; `log` gets every progress line). Returns the (graphdef, state) pairs of the
    target and of the drafter (None without one), for `engine_cost_table`."""
    device = jax.devices()[0].device_kind
    floor = floor_ms(cfg, bandwidth_tbs)
    rows, draft_rows, summary = [], [], {}
    report.update(shape=name, device=device, context=context, floor_ms=floor,
                  decode_b1=summary, rows=rows, draft_rows=draft_rows)  # fmt: skip
    log(f"{name} on {device}: weight-read floor {floor:.2f} ms")
    t0 = time.perf_counter()
    target = random_target(cfg, jnp.bfloat16)
    log(f"random bf16 weights in {time.perf_counter() - t0:.1f} s")
    kw = dict(context=context, iters=iters, log=log)
    verify_table(*target, cfg, batches=batches, widths=widths, rows=rows, **kw)
    drafter = None
    if draft_layers:
        drafter = random_drafter(cfg, layers=draft_layers, block_size=block_size)
        draft_times(*target, *drafter, batches=draft_batches or batches, rows=draft_rows, **kw)
    decode = [r for r in rows if r["batch"] == 1 and r["width"] == 1]
    if decode:
        ms = decode[0]["median_ms"]
        summary.update(decode_b1_ms=ms, floor_ms=floor, ratio=ms / floor)
    return target, drafter


def decode_summary(summary: dict) -> str:
    """The plain decode step at B=1 against the weight-read floor and the goal."""
    met = "met" if summary["ratio"] <= DECODE_GOAL else "NOT met"
    return (
        f"plain decode step at B=1: {summary['decode_b1_ms']:.2f} ms = {summary['ratio']:.2f}x "
        f"the floor (goal <= {DECODE_GOAL}x: {met})"
    )


def engine_cost_table(target, drafter, *, rows, capacity: int, widths, rounds: int, label: str):
    """The engine's cost table (`step_cost.measure`: its loop program per verify width, the
    plain loop and the draft forward) of random-weight (graphdef, state) pairs."""
    table = measure(
        nnx.merge(*target), nnx.merge(*drafter), rows=rows, capacity=capacity, buckets=widths,
        rounds=rounds,
    )  # fmt: skip
    return dataclasses.replace(table, model=f"{label} random bf16; {table.model}")
