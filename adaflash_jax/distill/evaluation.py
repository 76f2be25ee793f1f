"""Held-out τ beyond the greedy table (docs/design.md §4.5): at sampling temperatures, and by
the position of the block in the sequence. Both are off by default (`eval.temperatures`,
`eval.long_new_tokens`).

- Sampled τ: real speculative decoding with `decode.slots.SpeculativeEngine` at temperature
  t (the target's rejection sampling, the drafter sampled from its own distribution at the
  same t), seeded by the run's seed, on the held-out prompts; τ pooled per domain as the
  greedy table. Temperature 0 is the greedy table itself, never measured twice.
- τ by position: a long-response prompt set (the embedded corpus's held-out prompts whose
  documents are the longest of their domain, or the run's eval prompts with a target of its
  own), decoded greedily to `eval.long_new_tokens` with EOS ignored, so every sequence reaches
  past the training `seq_len` (text after an EOS continues as a new document). Each verify
  step falls in the bucket of its block's first position (the bonus token's, counted from the
  start of the prompt); τ is pooled over a bucket's steps.

τ counts the bonus token, as everywhere: Σ (accepted + 1) / steps.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from adaflash_jax.distill import collect
from adaflash_jax.distill import prompts as P
from adaflash_jax.distill.context import encode_prompts

POSITION_EDGES = (0, 128, 256, 512)  # bucket lower bounds; the last bucket is open


def bucket_names(edges: Sequence[int] = POSITION_EDGES) -> tuple[str, ...]:
    """ "lo-hi" per bucket, "lo+" for the last (open) one."""
    highs = [str(e) for e in edges[1:]]
    return (*(f"{lo}-{hi}" for lo, hi in zip(edges, highs)), f"{edges[-1]}+")


def tau_by_position(
    trajectories: Sequence[collect.Trajectory], edges: Sequence[int] = POSITION_EDGES
) -> dict[str, dict[str, float]]:
    """{"tau": {bucket: τ}, "steps": {bucket: verify steps}}: a step belongs to the bucket
    holding its anchor (the block's first position), [lo, hi); τ is nan for an empty bucket.
    Anchors below the first edge belong to no bucket."""
    lower = np.asarray(edges, np.int64)
    if np.any(np.diff(lower) <= 0):
        raise ValueError(f"bucket edges must increase: {tuple(edges)}")
    anchors_T = np.concatenate([np.asarray(t.anchors, np.int64) for t in trajectories] or [[]])
    committed_T = np.concatenate(
        [np.asarray(t.accepted, np.int64) + 1 for t in trajectories] or [[]]
    )
    bucket_T = np.searchsorted(lower, anchors_T, side="right") - 1
    tau, steps = {}, {}
    for i, name in enumerate(bucket_names(edges)):
        mine_T = bucket_T == i
        n = int(mine_T.sum())
        steps[name] = n
        tau[name] = float(committed_T[mine_T].sum() / n) if n else math.nan
    return {"tau": tau, "steps": steps}


def pooled_tau(
    domain_ids: Sequence[int], domains: Sequence[str], trajectories: Sequence[collect.Trajectory]
) -> dict[str, float]:
    """τ per domain, pooled over the domain's sequences (`collect.tau_by_domain` without the
    dataset)."""
    out = {}
    for d, name in enumerate(domains):
        rows = [t for t, i in zip(trajectories, domain_ids, strict=True) if i == d]
        steps = sum(len(t.accepted) for t in rows)
        tokens = sum(int(np.sum(np.asarray(t.accepted) + 1)) for t in rows)
        out[name] = tokens / steps if steps else math.nan
    return out


def engine_tau(
    target,
    drafter,
    prompt_ids: Sequence[Sequence[int]],
    domain_ids: Sequence[int],
    domains: Sequence[str],
    *,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    slots: int,
    eos_ids: Sequence[int] | None = None,
    rows=None,
) -> dict[str, float]:
    """τ per domain of speculative decoding at `temperature` (0: greedy; else the drafter
    samples at it and the target accepts by rejection sampling), full block every step."""
    _, trajectories = collect.engine_collect(
        target,
        drafter,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        slots=slots,
        temperature=temperature,
        seed=seed,
        eos_ids=eos_ids,
        rows=rows,
    )
    return pooled_tau(domain_ids, domains, trajectories)


def temperature_key(t: float) -> str:
    """A temperature's key in report.json ("0.7", "1")."""
    return f"{t:g}"


def sampled_tables(
    finals: Mapping[str, object],
    temperatures: Sequence[float],
    greedy: Mapping[str, Mapping[str, float]],
    measure: Callable[[object, float], dict[str, float]],
) -> dict[str, dict[str, dict[str, float]]]:
    """{temperature: {method: {domain: τ}}} for each configured temperature, in order: at 0
    the greedy table `greedy` itself, at any other t `measure(params, t)` per method."""
    out = {}
    for t in temperatures:
        if t == 0:
            out[temperature_key(t)] = {m: dict(greedy[m]) for m in finals}
        else:
            out[temperature_key(t)] = {m: measure(p, t) for m, p in finals.items()}
    return out


def long_prompts(ctx) -> list[P.Prompt]:
    """The long-response prompt set: with the embedded target, the held-out prompts whose
    corpus documents are the longest of their domain; with a target of the run's own, its
    eval prompts (`eval.long_per_domain` per domain either way)."""
    cfg = ctx.cfg
    n = cfg.eval.long_per_domain
    if cfg.target_path is None:
        from adaflash_jax import embedded

        found = P.from_records(embedded.long_eval_prompts(n, preset=cfg.embedded_preset))
        return P.per_domain(found, n, seed=cfg.seed, domains=cfg.data.domains)
    return P.per_domain(ctx.eval_prompts, n, seed=cfg.seed, domains=cfg.data.domains)


def _models(trainer, params, slots: int):
    """(target, drafter, rows) of a trainer's current weights for an engine of `slots`."""
    from flax import nnx

    from adaflash_jax.sharding.rows import RowLayout
    from adaflash_jax.sharding.rules import TRAIN_RULES

    target = nnx.merge(trainer.t_graph, trainer.frozen)
    drafter = nnx.merge(trainer.d_graph, params)
    return target, drafter, RowLayout.of(trainer.mesh, TRAIN_RULES, slots)


def sampled_tau(trainer, eval_data, eval_ids, params, temperature: float) -> dict[str, float]:
    """τ per domain of one drafter on the held-out prompts at `temperature` (> 0)."""
    cfg = trainer.cfg
    target, drafter, rows = _models(trainer, params, cfg.eval.slots)
    return engine_tau(
        target,
        drafter,
        eval_ids,
        eval_data.domain,
        eval_data.domains,
        temperature=temperature,
        seed=cfg.seed,
        max_new_tokens=cfg.data.max_new_tokens,
        slots=cfg.eval.slots,
        eos_ids=trainer.ctx.eos_ids,
        rows=rows,
    )


def position_tau(trainer, params, prompt_ids: Sequence[Sequence[int]]) -> dict:
    """τ by block position of one drafter on the long-response set (greedy, EOS ignored)."""
    cfg = trainer.cfg
    target, drafter, rows = _models(trainer, params, cfg.eval.slots)
    _, trajectories = collect.engine_collect(
        target,
        drafter,
        prompt_ids,
        max_new_tokens=cfg.eval.long_new_tokens,
        slots=cfg.eval.slots,
        temperature=0.0,
        seed=cfg.seed,
        eos_ids=(),
        rows=rows,
    )
    return tau_by_position(trajectories)


def extra_evaluations(ctx, trainer, finals, greedy, eval_data, eval_ids) -> dict:
    """report.json's optional τ entries: "tau_sampled" (`eval.temperatures`) and
    "tau_by_position" with its "long_set" (`eval.long_new_tokens` > 0), and "extra_seconds";
    {} when neither is configured."""
    cfg = ctx.cfg
    out, seconds = {}, {}
    t0 = time.perf_counter()
    if cfg.eval.temperatures:
        measure = functools.partial(sampled_tau, trainer, eval_data, eval_ids)
        out["tau_sampled"] = sampled_tables(finals, cfg.eval.temperatures, greedy, measure)
        seconds["sampled"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    if cfg.eval.long_new_tokens:
        prompts = long_prompts(ctx)
        # the whole set, each cut to its last max_prompt_len tokens
        ids = encode_prompts(cfg, ctx.tokenizer, prompts, long_prompts="truncate")
        out["tau_by_position"] = {m: position_tau(trainer, p, ids) for m, p in finals.items()}
        out["long_set"] = {
            "prompts": len(ids),
            "new_tokens": cfg.eval.long_new_tokens,
            "domains": list(dict.fromkeys(p.domain for p in prompts)),
        }
        seconds["by_position"] = round(time.perf_counter() - t0, 2)
    if seconds:
        out["extra_seconds"] = seconds  # each extra's wall time, compiles included
    return out
