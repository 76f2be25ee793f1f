"""τ per target forward of draft trees against the chain (docs/design.md §5.6, issue 39).

A verify step is one target forward for every running row; τ is the tokens a row commits per
step (accepted drafts + the bonus), over every row-step of a run. Speed needs τ per token the
target runs, so each cell also counts the verify tokens the steps asked for (Σ w_b) and ran
(the token buckets). Cells are deterministic given (method, concurrency, temperature, seed):
the seed picks the prompts from the embedded eval set and seeds the sampling.

Methods, by verify tokens per row t (K the drafter's block), each tree ranked by path
probability and, with `surrogates`, by the length head's acceptance too (`tree.head_scores`):
- `chain`: the fixed policy, every row its whole block (t = K);
- `tree t`: every row a tree of t − 1 nodes (a per-row budget, DDTree as published);
- `batch t`: a tree of up to `cap` nodes per row, t − 1 nodes per running row on average,
  allocated across the batch (`TreeBatchPolicy`): the same total tokens as `tree t`.
"""

from __future__ import annotations

import dataclasses
import statistics

from adaflash_jax.decode.build import build_engine
from adaflash_jax.decode.tree import TreeShape
from adaflash_jax.distill.shapes import slot_capacity


@dataclasses.dataclass(frozen=True)
class TreeMethod:
    label: str
    tree: TreeShape | None = None  # None: the chain
    mean_nodes: float | None = None  # batch allocation (None: each row its whole tree)

    def engine_kwargs(self) -> dict:
        if self.tree is None:
            return {"policy": "fixed", "verify": "packed"}
        if self.mean_nodes is None:
            return {"policy": "fixed", "tree": self.tree}
        return {
            "policy": "tree-batch",
            "policy_kwargs": {"mean_nodes": self.mean_nodes},
            "tree": self.tree,
        }


def methods_at(concurrency: int, topk: int, budgets, cap: int, surrogates=("path",)):
    """The chain and, per budget t (verify tokens per row) and surrogate, the per-row tree of
    t − 1 nodes; above one row also batch allocation of the same total, a row taking up to
    `cap` nodes (labels name a surrogate other than path probability)."""
    out = [TreeMethod("chain")]
    for t in budgets:
        for sur in surrogates:
            tail = "" if sur == "path" else f" {sur}"
            out.append(TreeMethod(f"tree {t}{tail}", TreeShape(topk, t - 1, sur)))
            if concurrency > 1:
                batch = TreeShape(topk, cap, sur)
                out.append(TreeMethod(f"batch {t}{tail}", batch, mean_nodes=t - 1.0))
    return out


def run_cell(target, drafter, prompts, method: TreeMethod, *, concurrency, temperature, seed,
             max_new_tokens, eos_ids=()) -> dict:  # fmt: skip
    """One run of `prompts` (each `max_new_tokens`) through `concurrency` slots."""
    k = drafter.config.block_size
    capacity = slot_capacity(max(map(len, prompts)), max_new_tokens, k)
    engine = build_engine(
        target,
        drafter,
        slots=concurrency,
        capacity=min(capacity, target.config.max_position_embeddings),
        temperature=temperature,
        seed=seed,
        eos_ids=eos_ids,
        **method.engine_kwargs(),
    )
    results = engine.generate([(list(p), max_new_tokens) for p in prompts])
    steps = sum(r.steps for r in results)
    committed = sum(a + 1 for r in results for a in r.accepted)
    return {
        "method": method.label,
        "concurrency": concurrency,
        "temperature": temperature,
        "seed": seed,
        "tau": committed / steps if steps else float("nan"),
        "row_steps": steps,
        "loop_steps": engine.last_run["loop_steps"],
        "verified_tokens": engine.last_run["verified_tokens"],
        "computed_tokens": engine.last_run["computed_tokens"],
        "committed": committed,
    }


def summarise(cells: list[dict]) -> list[dict]:
    """Per (method, concurrency, temperature): τ's mean and spread over seeds, tokens the
    steps verified per committed token, and τ relative to the chain's in the same setting."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["method"], c["concurrency"], c["temperature"]), []).append(c)
    chain = {
        (c, t): statistics.mean(x["tau"] for x in g)
        for (m, c, t), g in groups.items()
        if m == "chain"
    }
    out = []
    for (m, c, t), g in groups.items():
        taus = [x["tau"] for x in g]
        mean = statistics.mean(taus)
        out.append(
            {
                "method": m,
                "concurrency": c,
                "temperature": t,
                "tau": mean,
                "tau_min": min(taus),
                "tau_max": max(taus),
                "vs_chain": mean / chain[(c, t)] if (c, t) in chain else float("nan"),
                "verified_per_row_step": sum(x["verified_tokens"] for x in g)
                / sum(x["row_steps"] for x in g),
                "seeds": len(g),
            }
        )
    return out


def markdown(summary: list[dict]) -> str:
    lines = [
        "| c | T | method | τ (min–max over seeds) | τ / chain | verify tokens per row-step |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(summary, key=lambda r: (r["concurrency"], r["temperature"])):
        lines.append(
            f"| {r['concurrency']} | {r['temperature']:g} | {r['method']} | {r['tau']:.3f} "
            f"({r['tau_min']:.3f}–{r['tau_max']:.3f}) | {r['vs_chain']:.3f} | "
            f"{r['verified_per_row_step']:.2f} |"
        )
    return "\n".join(lines)
