"""Compile a run's programs for a Cloud TPU slice WITHOUT a TPU; print per-chip HBM and the
compiler's estimates (FLOPs, step time, MFU, decode step against the weight-read floor).

  python -m experiments.tpu_compile --config experiments/configs/qwen3_8b_v5p.py --topology v5p-64
  python -m experiments.tpu_compile --config C --topology v5e-8 --serve --cost-table T.json
  python -m experiments.tpu_compile --config C --topology v5p-8 --serve --dense-twin  # hybrid C
  python -m experiments.tpu_compile --config C --topology v5e-8 --serve --rows 1 --no-msa
  python -m experiments.tpu_compile --config C --topology v5e-8 --serve --fills 8 --trees 4x7,4x15

Needs libtpu: `pip install "jax[tpu]==<jax version>"` (the test extras install it). --serve
compiles decoding with tensor-parallel weights over the whole slice instead of the run's
programs; --dense-twin replaces a hybrid target by its twin with every layer full attention
(what the recurrent state's rollback is measured against); --no-msa also compiles each
decode program with XLA's memory-space assignment off and reports that estimate beside the
default one: XLA's cost analysis counts the copies that prefetch weights into on-chip VMEM
as bytes accessed on top of the read that consumes them (aot/report.py). Exit 0: everything
fits; 1: a program does not fit (or the compiler refused it); 2: bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

from adaflash_jax.cli import int_list, tree_shape

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "tiny.py")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="a file defining get_config()")
    p.add_argument("--topology", required=True, help="v5p-64 | v5e-256 | v6e-64 | v5p:2x2x1 ...")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument(
        "--only",
        type=lambda s: tuple(s.split(",")),
        help="train,generate,prefill,engine,draft (the default), and on request target "
        "(the target's training forward alone), plain (the engine's plain step)",
    )
    p.add_argument("--serve", action="store_true", help="tensor-parallel decoding table")
    p.add_argument("--rows", type=int_list, default=(1, 8, 32, 64, 128), help="--serve row counts")
    p.add_argument(
        "--widths", type=int_list, help="verify widths of the engine steps (default: all buckets)"
    )
    p.add_argument("--capacity", type=int, default=1024, help="--serve cache capacity")
    p.add_argument(
        "--fills", type=int_list, default=(), help="--serve: packed verify at token buckets rows·f"
    )
    p.add_argument(
        "--trees",
        type=lambda t: tuple(tree_shape(x) for x in t.split(",") if x.strip()),
        default=(),
        help="--serve: draft-tree steps, TOPKxNODES list (every row its whole tree)",
    )
    p.add_argument(
        "--dense-twin",
        action="store_true",
        help="a hybrid target's dense twin: every layer full attention (rollback's baseline)",
    )
    p.add_argument(
        "--no-msa",
        action="store_true",
        help="decode programs: also XLA's estimate with memory-space assignment off (no VMEM "
        "prefetch copies counted; twice the compile time)",
    )
    p.add_argument(
        "--no-nonfinite-guard",
        action="store_true",
        help="train steps without the non-finite guard (only to measure what it costs)",
    )
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--cost-table", help="--serve: write the verify-cost table (goodput format)")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling needs no device backend
    from adaflash_jax.cli import exit_status

    # ValueError: what the engine's and programs' settings still raise for a bad --widths
    return exit_status(compile_and_report, args, also={ValueError: 2})


def compile_and_report(args) -> int:
    from adaflash_jax.aot import programs, report, session
    from adaflash_jax.aot.topology import parse_slice
    from adaflash_jax.distill.config_file import load_config
    from adaflash_jax.distill.overrides import override
    from adaflash_jax.model.config import ConfigError

    if bad := [kv for kv in args.set if "=" not in kv]:
        raise ConfigError(f"--set needs FIELD=VALUE, got {bad}")
    known = programs.GROUPS + programs.EXTRA_GROUPS
    if bad := sorted(set(args.only or ()) - set(known)):
        raise ConfigError(f"--only takes {known}, got {bad}")
    sets = dict(kv.split("=", 1) for kv in args.set)
    cfg = override(load_config(args.config), sets)
    sl = parse_slice(args.topology)
    if args.serve:
        figs, data = session.compile_serve(
            cfg, sl, rows=args.rows, capacity=args.capacity, widths=args.widths,
            overrides=sets, twin=args.dense_twin, fills=args.fills, no_msa=args.no_msa,
            trees=args.trees,
        )  # fmt: skip
    else:
        figs, data = session.compile_run(
            cfg, sl, groups=args.only or programs.GROUPS, widths=args.widths,
            overrides=sets, twin=args.dense_twin, no_msa=args.no_msa,
            nonfinite_guard=not args.no_nonfinite_guard,
        )  # fmt: skip
    name = cfg.name + (" (dense twin)" if args.dense_twin else "")
    name += " (no non-finite guard)" if args.no_nonfinite_guard else ""
    print("\n".join(report.header(f"{name} on {sl.name}", sl.chip, data["mesh"])))
    print(report.table(figs, sl.chip))
    if args.json:
        report.write_json(args.json, data)
    if args.serve and args.cost_table:
        model = f"{cfg.name} target + drafter, capacity {args.capacity}, {data['topology']}"
        programs.cost_table(figs, device=data["topology"], model=model).save(args.cost_table)
    return 0 if all(f.fits for f in figs) else 1


if __name__ == "__main__":
    sys.exit(main())
