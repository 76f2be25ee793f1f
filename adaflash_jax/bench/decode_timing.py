"""Throughput measurement of plain vs speculative decoding through the same slot scheduler.

Both paths run `SpeculativeEngine` (plain = `drafter=None`: width 1, no drafting), so
prefill, scheduling and host round trips cost the same and the ratio is honest. The one timing
path of every throughput harness (this module, `bench/throughput_bench.py`,
`experiments/benchmark_decode.py --mode slots`): `warm_up` (an untimed pass over the same
requests compiles every program the timed pass needs), then `timed_pass`es; the best is
reported.

Returned dicts (JSON-ready):
    method, policy, slots, requests, tokens (generated), wall_s, tokens_per_s,
    tau (Σ(accepted+1) / Σ steps, all requests), verify_steps (Σ per-request steps),
    loop_steps (device loop iterations), step_ms (wall / loop_steps, prefill included),
    mean_verify_width (batch width per row-step), mean_requested_width, draft_fraction
    (row-steps that ran the drafter; 0 for plain decoding), warmup_s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaflash_jax.bench.engines import measured_engine
from adaflash_jax.decode.programs import compiled_programs
from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.distill.shapes import slot_capacity


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


@dataclasses.dataclass(frozen=True)
class TimedPass:
    wall_s: float
    results: list  # the engine's per-request results
    run: dict  # its `last_run` (loop_steps, probes)
    compiles: int  # programs compiled during the pass (0 when the warm-up did its job)


def warm_up(engine: SpeculativeEngine, requests) -> tuple[float, Any]:
    """One untimed pass (it compiles every program the timed passes need) → (its seconds, the
    start every timed pass takes). An engine that adapts across calls (goodput's skip arm:
    `engine.learnt`) runs a second warm-up from that start, which each timed pass then
    replays step for step, so nothing compiles while timed."""
    t0 = time.perf_counter()
    engine.generate(requests)
    seconds = time.perf_counter() - t0
    start = engine.learnt
    if start is not None:
        engine.generate(requests)
    return seconds, start


def timed_pass(engine: SpeculativeEngine, requests, start: Any) -> TimedPass:
    """One timed pass from the warm-up's `start`, counting what it compiled."""
    engine.learnt = start
    before = sum(compiled_programs().values())
    t0 = time.perf_counter()
    results = engine.generate(requests)
    wall = time.perf_counter() - t0
    compiled = sum(compiled_programs().values()) - before
    return TimedPass(wall, results, dict(engine.last_run), compiled)


def _timed(engine: SpeculativeEngine, requests, repeats: int) -> tuple[TimedPass, float]:
    """(the fastest of `repeats` timed passes, the warm-up's seconds)."""
    warmup, start = warm_up(engine, requests)
    passes = [timed_pass(engine, requests, start) for _ in range(max(1, repeats))]
    return min(passes, key=lambda p: p.wall_s), warmup


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
    options = dict(policy=policy, policy_kwargs=policy_kwargs, cost_table=cost_table)
    engine = measured_engine(target, drafter, **options, **kw)
    best, warmup = _timed(engine, list(requests), repeats)
    row = summarize(best.results, wall_s=best.wall_s, loop_steps=best.run["loop_steps"],
                    warmup_s=warmup)  # fmt: skip
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


def compare_slots(
    target, drafter, slot_counts: Sequence[int], *, prompt_len: int, new_tokens: int,
    policies: Sequence[str] = ("fixed",), requests: int | None = None,
) -> list[dict]:  # fmt: skip
    """Plain, then speculative decoding under each policy, at every slot count, on random
    prompts (`requests`, default 2 per slot) of 8..`prompt_len` tokens; each speculative row
    carries its `ratio_to_plain`, measured in the same run."""
    capacity = slot_capacity(prompt_len, new_tokens, drafter.config.block_size)
    rows = []
    for slots in slot_counts:
        reqs = random_requests(
            target.config.vocab_size, requests or 2 * slots, prompt_len=(8, prompt_len),
            max_new=new_tokens,
        )  # fmt: skip
        plain = time_plain(target, reqs, slots=slots, capacity=capacity)
        rows.append(plain)
        for policy in policies:
            spec = time_speculative(
                target, drafter, reqs, slots=slots, capacity=capacity, policy=policy
            )
            spec["ratio_to_plain"] = spec["tokens_per_s"] / plain["tokens_per_s"]
            rows.append(spec)
    return rows


def slots_table(rows: list[dict]) -> str:
    """`compare_slots` rows as a fixed-width table."""
    lines = [
        f"{'slots':>5} {'method':>12} {'policy':>8} {'tok/s':>9} {'ratio':>6} {'tau':>5} "
        f"{'width':>5} {'step ms':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['slots']:>5} {r['method']:>12} {r['policy'] or '-':>8} "
            f"{r['tokens_per_s']:>9.1f} {r.get('ratio_to_plain', 1.0):>6.2f} {r['tau']:>5.2f} "
            f"{r['mean_verify_width']:>5.2f} {r['step_ms']:>8.2f}"
        )
    return "\n".join(lines)
