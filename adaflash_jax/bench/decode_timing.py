"""Throughput measurement of plain vs speculative decoding through the same slot scheduler.

Both paths run `SpeculativeEngine` (plain = `drafter=None`: width 1, no drafting), so
prefill, scheduling and host round trips cost the same and the ratio is honest. Each timing
does one untimed warm-up pass over the same requests (compiles every program the timed pass
needs), then `repeats` timed passes; the best pass is reported.

Returned dicts (JSON-ready):
    method, policy, slots, requests, tokens (generated), wall_s, tokens_per_s,
    tau (Σ(accepted+1) / Σ steps, all requests), verify_steps (Σ per-request steps),
    loop_steps (device loop iterations), step_ms (wall / loop_steps, prefill included),
    mean_verify_width (batch width per row-step), mean_requested_width, draft_fraction
    (row-steps that ran the drafter; 0 for plain decoding), warmup_s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from adaflash_jax.bench.step_cost import engine_table
from adaflash_jax.decode.build import build_engine
from adaflash_jax.decode.slots import SpeculativeEngine


def random_requests(
    vocab_size: int,
    num_requests: int,
    *,
    prompt_len: tuple[int, int] = (8, 32),
    max_new: int = 64,
    seed: int = 0,
) -> list[tuple[list[int], int]]:
    """Random prompts with lengths uniform in [lo, hi] and a fixed generation budget."""
    rng = np.random.default_rng(seed)
    lo, hi = prompt_len
    return [
        (rng.integers(0, vocab_size, size=int(rng.integers(lo, hi + 1))).tolist(), max_new)
        for _ in range(num_requests)
    ]


def _timed(engine: SpeculativeEngine, requests, repeats: int):
    t0 = time.perf_counter()
    engine.generate(requests)
    warmup = time.perf_counter() - t0
    best, results, loop_steps = None, None, 0
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = engine.generate(requests)
        wall = time.perf_counter() - t0
        if best is None or wall < best:
            best, results, loop_steps = wall, out, engine.last_run["loop_steps"]
    return results, best, warmup, loop_steps


def summarize(results, *, wall_s: float, loop_steps: int, warmup_s: float = 0.0) -> dict:
    tokens = sum(len(r.output_ids) for r in results)
    steps = sum(r.steps for r in results)
    committed = sum(a + 1 for r in results for a in r.accepted)
    widths = [w for r in results for w in r.widths]
    requested = [w for r in results for w in r.requested_widths]
    return {
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "tau": committed / steps if steps else float("nan"),
        "verify_steps": steps,
        "loop_steps": loop_steps,
        "step_ms": 1e3 * wall_s / max(loop_steps, 1),
        "mean_verify_width": float(np.mean(widths)) if widths else float("nan"),
        "mean_requested_width": float(np.mean(requested)) if requested else float("nan"),
        # row-steps that ran the drafter (a skip_draft policy records requested width 0)
        "draft_fraction": float(np.mean([w > 0 for w in requested])) if requested else 0.0,
        "warmup_s": warmup_s,
    }


def time_plain(target, requests: Sequence[tuple[Sequence[int], int]], **kw) -> dict:
    """Plain autoregressive decoding (one target token per row per step) through the slots;
    options as `time_speculative`'s."""
    return time_speculative(target, None, requests, **kw)


def time_speculative(
    target,
    drafter,
    requests: Sequence[tuple[Sequence[int], int]],
    *,
    slots: int,
    capacity: int,
    repeats: int = 1,
    eos_ids: Sequence[int] = (),
    policy="fixed",
    policy_kwargs: dict | None = None,
    cost_table=None,
    **engine_kw,
) -> dict:
    """Speculative decoding through the slots with the `build_engine` options (policy by
    name or object, `policy_kwargs`, `cost_table`) and engine settings in `engine_kw`
    (buckets, temperature, ...); goodput without a cost table measures its engine's
    (`step_cost.engine_table`, cached)."""
    kw = dict(slots=slots, capacity=capacity, eos_ids=eos_ids, **engine_kw)
    if policy == "goodput" and cost_table is None:
        cost_table = engine_table(target, drafter, policy_kwargs=policy_kwargs, **kw)
    options = dict(policy=policy, policy_kwargs=policy_kwargs, cost_table=cost_table)
    engine = build_engine(target, drafter, **options, **kw)
    results, wall, warmup, loop_steps = _timed(engine, list(requests), repeats)
    row = summarize(results, wall_s=wall, loop_steps=loop_steps, warmup_s=warmup)
    if drafter is None:
        return {"method": "plain", "policy": None, "slots": slots, **row, "draft_fraction": 0.0}
    return {
        "method": "speculative",
        "policy": engine.policy.name,
        "slots": slots,
        "block_size": engine.block_size,
        "buckets": list(engine.buckets),
        **row,
    }
