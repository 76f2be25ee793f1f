"""One measured cell of the throughput benchmark (a method at one concurrency and domain):
its bench.json row (the timing summary, the scheduler's occupancy, lossless-output digest)
and, for a drafter, its per-request acceptance trace in the compact encoding."""

from __future__ import annotations

import hashlib

import numpy as np

from adaflash_jax.bench.decode_timing import TimedPass, summarize
from adaflash_jax.bench.methods import Method
from adaflash_jax.bench.occupancy import encode_trace, running_per_step
from adaflash_jax.decode.slots import SpeculativeEngine


def cell_record(
    m: Method, engine: SpeculativeEngine, concurrency: int, domain: str, timed: TimedPass, *,
    policy_options: dict, warmup: float, compiles: int,
) -> tuple[dict, dict | None]:  # fmt: skip
    """The row (and, for a drafter, the acceptance trace) of one method's fastest pass."""
    wall, results, run = timed.wall_s, timed.results, timed.run
    loop_steps = run["loop_steps"]
    row = summarize(results, wall_s=wall, loop_steps=loop_steps, warmup_s=warmup)
    steps = [r.steps for r in results]
    running = running_per_step(steps, concurrency)
    k = engine.block_size
    requested = [w for r in results for w in r.requested_widths]
    row.update(
        method="plain" if m.drafter is None else m.drafter,
        policy="none" if m.policy is None else m.policy,
        label=m.label,
        concurrency=concurrency,
        domain=domain,
        block_size=k,
        policy_options=policy_options,
        committed=sum(a + 1 for r in results for a in r.accepted),
        mean_running=float(np.mean(running)) if len(running) else 0.0,
        occupancy_exact=len(running) == loop_steps,
        cut_fraction=float(np.mean([0 < w < k for w in requested])) if requested else 0.0,
        compiles_in_timed_pass=compiles,
        probes=run["probes"],
        # Σ w_b over the verify steps, and the tokens the target ran for them
        verified_tokens=run.get("verified_tokens", 0),
        computed_tokens=run.get("computed_tokens", 0),
        output_digest=hashlib.sha1(repr([r.output_ids for r in results]).encode()).hexdigest(),
    )
    if m.drafter is None:
        row["draft_fraction"] = 0.0
    if m.policy == "adaflash":
        thr = row["policy_options"]["threshold"]
        row["policy_active_fraction"] = float(np.mean(running > thr)) if len(running) else 0.0
    if m.drafter is None:
        return row, None
    trace = {
        "label": m.label,
        "method": row["method"],
        "policy": row["policy"],
        "policy_options": row["policy_options"],
        "concurrency": concurrency,
        "domain": domain,
        "block_size": k,
        "buckets": list(engine.buckets),
        "loop_steps": loop_steps,
        "wall_s": wall,
        "accepted": [encode_trace(r.accepted) for r in results],
        "requested": [encode_trace(r.requested_widths) for r in results],
        "requested_offset": 0,  # 0 = an undrafted (plain) step
    }
    if m.policy == "goodput":  # the table the policy decided with (measured or given)
        trace["goodput_cost"] = engine.policy.cost.to_json()
    return row, trace
