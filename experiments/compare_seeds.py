"""Run the distillation job for several seeds and compare the methods' τ over seeds.

    python -m experiments.compare_seeds --seeds 0,1,2 --out runs/seeds \
        --set "stage2.methods=('adaflash', 'sft', 'fkl', 'stage1_long')"

Every other argument goes to `python -m experiments.distill` unchanged (one process per seed,
run directory OUT/seed<S>; an existing finished run is reused). Writes OUT/seeds.json and
OUT/seeds.md: τ per domain, mean τ and cross-domain CV per method as mean ± std over seeds,
and the ratio goals (adaflash / sft, adaflash / stage1_long) paired per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from adaflash_jax.cli import exit_status, int_list


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int_list, default="0,1,2", help="comma-separated seeds")
    p.add_argument("--out", required=True, help="directory for the runs and the comparison")
    args, distill_args = p.parse_known_args(argv)
    return exit_status(run, args, distill_args)


def run(args, distill_args: list[str]) -> int:
    from adaflash_jax.distill import seeds as S

    run_dirs = [os.path.join(args.out, f"seed{s}") for s in args.seeds]
    for seed, run_dir in zip(args.seeds, run_dirs, strict=True):
        if os.path.isfile(os.path.join(run_dir, "report.json")):
            continue
        cmd = [sys.executable, "-m", "experiments.distill", "--seed", str(seed)]
        cmd += ["--run-dir", run_dir, "--no-progress", *distill_args]
        print(f"seed {seed}: {' '.join(cmd[1:])}", flush=True)
        code = subprocess.call(cmd)
        if code:
            print(f"error: seed {seed} exited with {code}", file=sys.stderr)
            return code
    agg = S.aggregate(S.load_reports(run_dirs))
    with open(os.path.join(args.out, "seeds.json"), "w") as f:
        json.dump(agg, f, indent=2)
    text = S.markdown(agg)
    with open(os.path.join(args.out, "seeds.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
