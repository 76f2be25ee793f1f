"""Compile a run's programs for a Cloud TPU slice WITHOUT a TPU; print per-chip HBM and the
compiler's estimates (FLOPs, step time, MFU, decode step against the weight-read floor).

  python -m experiments.tpu_compile --config experiments/configs/qwen3_8b_v5p.py --topology v5p-64
  python -m experiments.tpu_compile --config C --topology v5e-8 --serve --cost-table T.json
  python -m experiments.tpu_compile --config C --topology v5p-8 --serve --dense-twin  # hybrid C

Needs libtpu: `pip install "jax[tpu]==<jax version>"` (the test extras install it). --serve
compiles decoding with tensor-parallel weights over the whole slice instead of the run's
programs; --dense-twin replaces a hybrid target by its twin with every layer full attention
(what the recurrent state's rollback is measured against). Exit 0: everything fits; 1: a
program does not fit (or the compiler refused it); 2: bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "tiny.py")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


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
    p.add_argument("--rows", type=_ints, default=(1, 8, 32, 64, 128), help="--serve row counts")
    p.add_argument(
        "--widths", type=_ints, help="verify widths of the engine steps (default: all buckets)"
    )
    p.add_argument("--capacity", type=int, default=1024, help="--serve cache capacity")
    p.add_argument(
        "--fills", type=_ints, default=(), help="--serve: packed verify at token buckets rows·f"
    )
    p.add_argument(
        "--dense-twin",
        action="store_true",
        help="a hybrid target's dense twin: every layer full attention (rollback's baseline)",
    )
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--cost-table", help="--serve: write the verify-cost table (goodput format)")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling needs no device backend

    from adaflash_jax.aot import programs, report, session
    from adaflash_jax.aot.topology import parse_slice
    from adaflash_jax.distill.config_file import load_config
    from adaflash_jax.distill.overrides import override
    from adaflash_jax.model.config import ConfigError

    try:
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
                overrides=sets, twin=args.dense_twin, fills=args.fills,
            )  # fmt: skip
        else:
            figs, data = session.compile_run(
                cfg, sl, groups=args.only or programs.GROUPS, widths=args.widths,
                overrides=sets, twin=args.dense_twin,
            )  # fmt: skip
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = cfg.name + (" (dense twin)" if args.dense_twin else "")
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
