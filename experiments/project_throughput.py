"""PROJECT throughput vs concurrency for a target whose weights are not here (e.g. Qwen3-8B on
one H200) from measured acceptance traces and a step-cost table. Prints a projection, not a
measurement.

python -m experiments.project_throughput --traces bench_out/bench_traces.json
python -m experiments.project_throughput --traces T.json --cost benchmarks/h200/qwen3_8b_table.json
python -m experiments.project_throughput --traces T.json --cost-from-traces   # own device
python -m experiments.project_throughput --traces T.json --cost benchmarks/tpu/v5e8_cost.json

A cost table comes from `experiments.benchmark` (bench_traces.json), `benchmark_decode --shape
... --draft-layers N --cost-table T.json` (the engine's loop programs timed on a GPU) or,
as compiler estimates, `python -m experiments.tpu_compile --serve --cost-table T.json`
(compiler estimates of the engine's plain, draft and verify steps; the header says so).

Default costs: the H200 Qwen3-8B-shape bare-forward timings in benchmarks/h200/ (default XLA
flags) and docs/design.md §7's draft cost. See adaflash_jax/bench/projection.py for the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from adaflash_jax.cli import exit_status, int_list

H200_DEFAULT = [
    os.path.join("benchmarks", "h200", name)
    for name in ("qwen3_8b_b1_default.json", "qwen3_8b_table.json", "qwen3_8b_b32.json")
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", required=True, help="bench_traces.json of experiments.benchmark")
    p.add_argument("--cost", action="append", default=[], help="cost JSON (repeatable, merged)")
    p.add_argument("--cost-from-traces", action="store_true", help="the bench's own cost table")
    p.add_argument("--draft-ms", help="BATCH:MS pairs, e.g. 1:2.6,128:16 (overrides the files)")
    p.add_argument("--concurrency", type=int_list, help="comma list (default: the cost rows)")
    p.add_argument("--threshold", type=int, default=48, help="adaflash rule threshold")
    p.add_argument("--domain", help="only this domain's traces (default: all pooled)")
    p.add_argument("--json", help="write the projected rows here")
    p.add_argument("--md", help="write the markdown table here")
    a = p.parse_args(argv)
    from adaflash_jax.bench import cost_model as cm

    if a.cost_from_traces and a.cost:
        p.error("--cost-from-traces and --cost measure different devices")
    try:
        draft = cm.parse_draft_ms(a.draft_ms) if a.draft_ms else None
    except cm.CostError as e:
        p.error(str(e))
    return exit_status(project, a, draft)


def _traces(a):
    """(acceptance, the cost table recorded beside it or None): a malformed file is a
    CostError (adaflash_jax/cli.py: bad data)."""
    from adaflash_jax.bench import cost_model as cm
    from adaflash_jax.bench import projection as pj
    from adaflash_jax.io.cost_table import VerifyCostTable

    try:
        acceptance = pj.load_acceptance(a.traces, domain=a.domain)
        if not a.cost_from_traces:
            return acceptance, None
        with open(a.traces) as f:
            tables = list(json.load(f)["cost_tables"].values())
        return acceptance, VerifyCostTable.from_json(tables[0]) if tables else None
    except cm.CostError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        what = f"{type(e).__name__}: {e}"
        raise cm.CostError(f"{a.traces}: not a bench_traces.json ({what})") from None


def project(a, draft) -> int:
    from adaflash_jax.bench import cost_model as cm
    from adaflash_jax.bench import projection as pj

    acceptance, table = _traces(a)
    if not any(len(x.full_accepted) for x in acceptance.values()):
        raise cm.CostError(f"{a.traces} has no fixed-policy (full block) traces")
    m = cm.Measurements()
    if a.cost_from_traces:
        if table is None:
            raise cm.CostError(f"{a.traces} holds no cost table (no goodput method ran)")
        cm.add_table(m, table, f"{a.traces} (measured on {table.device})")
    for path in a.cost or ([] if a.cost_from_traces else H200_DEFAULT):
        cm.read_cost_json(path, m)
    widths = {1} | {w for x in acceptance.values() for w in x.buckets}
    cost = cm.build(m, widths, draft_ms=draft)
    rows = pj.project(cost, acceptance, a.concurrency or list(cost.rows), threshold=a.threshold)
    header = [
        "# PROJECTION — not a measurement",
        "",
        "Output tokens/s at saturated concurrency B (ratio to projected plain decoding),",
        "from measured acceptance and step costs from elsewhere (measured, unless a source",
        "says compiler estimates):",
        f"- step costs: {'; '.join(pj.cost_source(s) if s in a.cost else s for s in m.sources)}",
        f"- draft cost ms by batch: {dict(zip(cost.draft_rows, cost.draft_ms))}",
        *(f"- filled: {n}" for n in cost.notes),
    ]
    for name, acc in acceptance.items():
        header.append(
            f"- acceptance of {name!r} (K={acc.block_size}): {len(acc.full_accepted)} full-block "
            f"row-steps, {len(acc.rule_requested)} active-rule row-steps"
        )
    if not any(len(x.rule_requested) for x in acceptance.values()):
        header.append(
            f"- adaflash rule above {a.threshold} rows: no active-rule steps in the traces "
            "(run the benchmark with adaflash:adaflash:threshold=0), so not projected there"
        )
    header.append("- goodput here = the best static width per B (see projection.py)")
    text = pj.markdown(rows, header)
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"projection": True, "header": header, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
