"""Decode benchmarks. Three modes:

python -m experiments.benchmark_decode                       # plain generate loop, random tiny
python -m experiments.benchmark_decode --slots 1,4,16 [--target DIR --drafter DIR]
python -m experiments.benchmark_decode --shape qwen3-8b --batches 1,8,32,64,128 --widths 1,2,4,8,16

Loop mode (`bench/loop_timing.py`): the plain generate loop's decode and end-to-end tokens/s.
Slots mode (`bench/decode_timing.py`): plain vs speculative decoding through the same
continuous-batching engine at each slot count (tokens/s, τ, ratio measured in the same run;
default: random target with an untrained drafter, so τ ≈ 1 and speculative is slower).
Shape mode (GPU, `bench/shape_bench.py`): random bf16 weights of a named shape; the plain
decode step at B=1 against the weight-read floor (goal <= 1.5x), the verify table per batch
and width (docs/design.md §7) and, with --draft-layers, the drafter block forward per batch;
--cost-table (with --draft-layers) then times the engine's own loop programs
(`bench.step_cost`) into the cost table that the goodput policy and
experiments.project_throughput read.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from adaflash_jax.bench import shape_bench as sb
from adaflash_jax.bench.decode_timing import compare_slots, slots_table
from adaflash_jax.bench.loop_timing import (
    CPU_SHAPES,
    bench_models,
    bench_plain,
    build_random_target,
    plain_table,
)
from adaflash_jax.cli import int_list, one_line_errors
from adaflash_jax.model.presets import target_preset


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="micro", choices=CPU_SHAPES)
    p.add_argument("--batch", type=int, action="append", help="repeatable (default: 1 and 8)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    s = p.add_argument_group("slots mode: plain vs speculative through the engine")
    s.add_argument("--slots", type=int_list, help="comma list of slot counts, e.g. 1,4,16")
    s.add_argument("--target", help="HF target dir (default: random --config target)")
    s.add_argument("--drafter", help="drafter dir (default: an untrained drafter)")
    s.add_argument("--policies", default="fixed", help="comma list of fixed/adaflash/goodput")
    s.add_argument("--requests", type=int, help="requests per slot count (default: 2 x slots)")
    g = p.add_argument_group("shape mode: random-weight timings of a named shape (GPU)")
    g.add_argument("--shape", help="e.g. qwen3-8b (see adaflash_jax/model/presets.py)")
    g.add_argument("--batches", type=int_list, default="1,8,32,64,128")
    g.add_argument("--widths", type=int_list, default="1,2,4,8,16")
    g.add_argument("--context", type=int, default=1024)
    g.add_argument("--iters", type=int, default=10)
    g.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM TB/s (H200: 4.3)")
    g.add_argument("--draft-layers", type=int, default=0, help="also time a drafter (0: no)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--draft-batches", type=int_list, help="default: --batches")
    g.add_argument("--cost-table", help="write the engine's cost table JSON here")
    a = p.parse_args(argv)
    if a.cost_table and not a.draft_layers:
        p.error("--cost-table needs --draft-layers (the engine drafts)")
    return a


def main(argv=None) -> None:
    args = parse(argv)
    with one_line_errors():
        if args.shape:
            return shape_mode(args)
        if args.slots:
            return slots_mode(args)
        loop_mode(args)


def loop_mode(args) -> None:
    model = build_random_target(args.config, dtype=getattr(jnp, args.dtype))
    rows = [
        bench_plain(model, batch=b, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                    repeats=args.repeats)
        for b in args.batch or [1, 8]
    ]  # fmt: skip
    print(f"config={args.config} dtype={args.dtype} backend={jax.default_backend()}")
    print(plain_table(rows))
    _write(args.json, {"config": args.config, "dtype": args.dtype, "rows": rows})


def _write(path: str | None, obj: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def slots_mode(args) -> None:
    target, drafter = bench_models(
        args.target, args.drafter, shape=args.config, dtype=getattr(jnp, args.dtype)
    )
    rows = compare_slots(
        target, drafter, args.slots, prompt_len=args.prompt_len,
        new_tokens=args.new_tokens, policies=args.policies.split(","), requests=args.requests,
    )  # fmt: skip
    print(f"backend={jax.default_backend()} block={drafter.config.block_size} "
          f"new_tokens={args.new_tokens}")  # fmt: skip
    print(slots_table(rows))
    _write(args.json, {"mode": "slots", "rows": rows})


def _progress(path: str | None, report: dict, line: str) -> None:
    """A progress line, and the JSON so far (a cut-short run keeps it)."""
    print(line, flush=True)
    _write(path, report)


def shape_mode(args) -> None:
    cfg, report = target_preset(args.shape), {}
    log = functools.partial(_progress, args.json, report)
    target, drafter = sb.shape_tables(
        cfg, args.shape, batches=args.batches, widths=args.widths,
        context=args.context, iters=args.iters, bandwidth_tbs=args.bandwidth_tbs,
        draft_layers=args.draft_layers, block_size=args.block_size,
        draft_batches=args.draft_batches,
        report=report, log=log,
    )  # fmt: skip
    print("\nverify (target forward over W new tokens per row), median ms, context "
          f"{args.context}:\n" + sb.markdown_grid(report["rows"], report["floor_ms"]))  # fmt: skip
    if report["decode_b1"]:
        print(sb.decode_summary(report["decode_b1"]))
    log("done")
    if args.cost_table:
        table = sb.engine_cost_table(
            target, drafter, rows=args.batches, capacity=args.context,
            widths=args.widths, rounds=max(1, args.iters // 4), label=args.shape,
        )  # fmt: skip
        table.save(args.cost_table)
        print(f"wrote {args.cost_table}")


if __name__ == "__main__":
    main()
