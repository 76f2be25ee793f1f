"""Throughput vs concurrency of plain, DFlash-style and AdaFlash decoding (issue 6).

python -m experiments.benchmark --run-dir runs/tiny-...          # a distill run's exports
python -m experiments.benchmark --target DIR --stage1 DIR --adaflash DIR --out bench/
python -m experiments.benchmark --micro --out /tmp/b            # tiny random models, seconds

Methods (--methods, comma list): plain, DRAFTER:POLICY[:key=value,...] with DRAFTER a name
of the run dir's exports (stage1, adaflash, sft) or of --drafter NAME=DIR, POLICY one of
fixed / adaflash / goodput / tree-batch; options joined by '+', e.g. adaflash:goodput:tree=4x15
(draft trees, TOPKxNODES) or adaflash:tree-batch:tree=4x31+mean_nodes=7. Concurrency
defaults: 1,4,16,64 on CPU, 1,32,64,128 otherwise.
Writes bench.json, bench_traces.json (per-step acceptance for experiments.project_throughput),
bench.md, throughput.png and tau.png under --out.
"""

from __future__ import annotations

import argparse
import os
import sys

from adaflash_jax.bench.methods import DEFAULT_METHODS, BenchError, parse_method
from adaflash_jax.cli import exit_status, int_list


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", help="distill run directory (finds target and exports)")
    p.add_argument("--target", help="HF target directory")
    p.add_argument("--stage1", help="stage-1 (DFlash-style) drafter export")
    p.add_argument("--adaflash", help="AdaFlash drafter export")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--micro", action="store_true", help="tiny random models, tiny settings")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--concurrency", type=int_list, help="comma list (default: by backend)")
    p.add_argument("--domains", default="", help="comma list (default: all)")
    p.add_argument("--prompts-per-domain", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--max-prompt-len", type=int)
    p.add_argument("--prompts", help="prompt file instead of the embedded eval prompts")
    p.add_argument("--preset", help="embedded preset of the prompts (default: the run's)")
    p.add_argument("--adaflash-threshold", type=int, default=48)
    p.add_argument("--goodput-estimator", default="confidence")
    p.add_argument("--cost-table", help="cost-table JSON for goodput (default: measured)")
    p.add_argument("--buckets", type=int_list, default="1,2,4,8,16")
    p.add_argument("--repeats", type=int, default=2, help="interleaved timed rounds (fastest kept)")
    p.add_argument("--requests-per-slot", type=float, default=1.0, help="requests >= this x c")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: by backend")
    p.add_argument("--out", default="bench_out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    return exit_status(run, parse(argv))


def run(a) -> None:
    import jax
    import jax.numpy as jnp

    from adaflash_jax.bench import inputs, report
    from adaflash_jax.bench import throughput_bench as tb
    from adaflash_jax.io.cost_table import VerifyCostTable

    if a.micro:
        src = inputs.micro_setup(os.path.join(a.out, "micro_models"))
    elif a.run_dir:
        src = inputs.from_run_dir(a.run_dir)
    elif a.target:
        src = {"target": a.target, "drafters": {}, "config": {}}
    else:
        raise BenchError("give --run-dir, --target (with drafters) or --micro")
    for name, path in (("stage1", a.stage1), ("adaflash", a.adaflash)):
        if path:
            src["drafters"][name] = path
    for kv in a.drafter:
        name, _, path = kv.partition("=")
        if not path:
            raise BenchError(f"--drafter needs NAME=DIR, got {kv!r}")
        src["drafters"][name] = path
    small = (
        dict(per_domain=2, new=6, prompt=16) if a.micro else dict(per_domain=16, new=64, prompt=64)
    )
    settings = tb.BenchSettings(
        concurrencies=a.concurrency or tb.default_concurrency(),
        prompts_per_domain=a.prompts_per_domain or small["per_domain"],
        max_new_tokens=a.max_new_tokens or small["new"],
        max_prompt_len=a.max_prompt_len or small["prompt"],
        buckets=a.buckets,
        adaflash_threshold=a.adaflash_threshold,
        goodput_estimator=a.goodput_estimator,
        repeats=a.repeats,
        requests_per_slot=a.requests_per_slot,
    )
    methods = [parse_method(m) for m in a.methods.split(",") if m.strip()]
    wanted = {m.drafter for m in methods if m.drafter is not None}
    missing = sorted(wanted - set(src["drafters"]))
    if missing:
        raise BenchError(f"methods need drafters {missing}; have {sorted(src['drafters'])}")
    src["drafters"] = {n: p for n, p in src["drafters"].items() if n in wanted}
    cpu = jax.default_backend() == "cpu"
    dtype = getattr(jnp, a.dtype or ("float32" if cpu else "bfloat16"))
    target, drafters = inputs.load_models(src["target"], src["drafters"], dtype=dtype)
    data = src["config"].get("data", {})
    prompts = inputs.load_prompts(
        src["target"],
        per_domain=settings.prompts_per_domain,
        max_len=settings.max_prompt_len,
        preset=a.preset or src["config"].get("embedded_preset", "tiny"),
        prompt_file=a.prompts or data.get("eval_prompts"),
        chat_template=bool(data.get("chat_template", False)),
        domains=tuple(d for d in a.domains.split(",") if d),
    )
    tables = {}
    if a.cost_table:
        try:
            table = VerifyCostTable.load(a.cost_table)
        except (ValueError, KeyError, TypeError) as e:
            raise BenchError(f"--cost-table {a.cost_table}: {e}") from None
        tables = {name: table for name in drafters}
    bench = tb.ThroughputBench(target, drafters, prompts, methods, settings, cost_tables=tables)

    def save(partial):  # after every concurrency level: a cut-short run keeps those
        partial.meta["inputs"] = {"target": src["target"], "drafters": src["drafters"]}
        return report.write_outputs(partial, a.out)

    result = bench.run(on_level=save)
    paths = save(result)
    print(report.markdown([r for r in result.rows if r["domain"] == "all"], result.meta))
    print("wrote " + ", ".join(paths.values()))


if __name__ == "__main__":
    sys.exit(main())
