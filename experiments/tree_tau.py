"""τ per target forward of draft trees against the chain, on a distill run's drafter.

python -m experiments.tree_tau --run-dir RUN --out /tmp/tree_tau          # the defaults below
python -m experiments.tree_tau --run-dir RUN --concurrency 1 --budgets 8,16,32 --seeds 0

At c = 1 each budget t is a per-row tree of t − 1 nodes (--budgets: K, 2K, 4K by default);
above, per-row trees and batch allocation of the same total tokens (--batch-budgets), each
row taking up to 4K − 1 nodes. Every cell at each --temperatures and --seeds (the seed picks
the prompts and seeds sampling). Writes tree_tau.json (cells and summary) and tree_tau.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from adaflash_jax.cli import exit_status, int_list


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", required=True, help="distill run directory")
    p.add_argument("--drafter", default="adaflash", help="the run's export to use")
    p.add_argument("--concurrency", type=int_list, default="1,16,64")
    p.add_argument("--budgets", type=int_list, help="c = 1 verify tokens per row (K,2K,4K)")
    p.add_argument("--batch-budgets", type=int_list, default="4,8", help="c > 1, per row")
    p.add_argument("--topk", type=int, default=4, help="candidates per position")
    p.add_argument(
        "--surrogates", default="path", help="node scores to compare: path,head (head: the "
        "length head's acceptance; needs a drafter with its accept output)",
    )  # fmt: skip
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--seeds", type=int_list, default="0,1,2")
    p.add_argument("--prompts", type=int, default=16, help="requests per cell (>= c)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default="tree_tau_out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    return exit_status(run, parse(argv))


def run(a) -> None:
    from adaflash_jax.bench import inputs
    from adaflash_jax.bench import tree_tau as tt
    from adaflash_jax.bench.methods import BenchError
    from adaflash_jax.decode.tree import SURROGATES

    src = inputs.from_run_dir(a.run_dir)
    if a.drafter not in src["drafters"]:
        raise BenchError(
            f"{a.run_dir} has no {a.drafter!r} export; it has {sorted(src['drafters'])}"
        )
    import jax.numpy as jnp

    chosen_drafter = {a.drafter: src["drafters"][a.drafter]}
    target, drafters = inputs.load_models(src["target"], chosen_drafter, dtype=jnp.float32)
    drafter = drafters[a.drafter]
    k = drafter.config.block_size
    budgets = a.budgets or (k, 2 * k, 4 * k)
    temperatures = [float(t) for t in a.temperatures.split(",") if t.strip()]
    surrogates = tuple(x.strip() for x in a.surrogates.split(",") if x.strip())
    unknown = [x for x in surrogates if x not in SURROGATES]
    if unknown or not surrogates:
        raise BenchError(f"--surrogates {a.surrogates!r}: choose from {SURROGATES}")
    cells = []
    for seed in a.seeds:
        pool = inputs.load_prompts(
            src["target"], per_domain=a.prompts, max_len=64, seed=seed,
            preset=src["config"].get("embedded_preset", "tiny"),
        )  # fmt: skip
        prompts = [p for domain in sorted(pool) for p in pool[domain]]
        for c in a.concurrency:
            chosen = [prompts[(seed * 7919 + i) % len(prompts)] for i in range(max(a.prompts, c))]
            cap = max(max(budgets), max(a.batch_budgets)) - 1
            per_row = budgets if c == 1 else a.batch_budgets
            for m in tt.methods_at(c, a.topk, per_row, cap, surrogates):
                for t in temperatures:
                    cell = tt.run_cell(
                        target, drafter, chosen, m, concurrency=c, temperature=t, seed=seed,
                        max_new_tokens=a.max_new_tokens,
                    )  # fmt: skip
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
    summary = tt.summarise(cells)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tree_tau.json"), "w") as f:
        json.dump(
            {"cells": cells, "summary": summary, "topk": a.topk, "block_size": k}, f, indent=1
        )
    with open(os.path.join(a.out, "tree_tau.md"), "w") as f:
        f.write(tt.markdown(summary) + "\n")
    print(tt.markdown(summary))


if __name__ == "__main__":
    sys.exit(main())
