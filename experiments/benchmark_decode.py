"""Decode benchmarks. Three modes:

python -m experiments.benchmark_decode                       # plain generate loop, random tiny
python -m experiments.benchmark_decode --slots 1,4,16 [--target DIR --drafter DIR]
python -m experiments.benchmark_decode --shape qwen3-8b --batches 1,8,32,64,128 --widths 1,2,4,8,16

Loop mode: the jitted generate loop runs twice after a warm-up compile, with N new tokens and
with 1 (prefill + first sample). Decode tokens/s = B·(N−1) / (t_N − t_1) on medians, so
prefill does not inflate it; end-to-end tokens/s = B·N / t_N is reported too.
Slots mode: plain vs speculative decoding through the same continuous-batching engine at each
slot count (tokens/s, τ, ratio measured in the same run; default: random tiny target with an
untrained drafter, so τ ≈ 1 and speculative is slower — honest, not a goal).
Shape mode (GPU): random bf16 weights of a named shape; the plain decode step at B=1 against
the weight-read floor (goal <= 1.5x), the verify table per batch and width (docs/design.md §7) and,
with --draft-layers, the drafter block forward per batch; --cost-table (with --draft-layers)
then times the engine's own loop programs (`bench.step_cost`) into the cost table that the
goodput policy and experiments.project_throughput read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.cli import one_line_errors
from adaflash_jax.decode.generate import generate_jit, prepare_batch
from adaflash_jax.distill.shapes import slot_capacity
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM

# Eagerly built random targets (CPU sizes); GPU shapes go through `--shape`. "micro-moe" has
# micro's active parameters per token (a mixture of experts against its dense twin).
CPU_SHAPES = ("test", "micro", "tiny", "micro-moe", "micro-hybrid")  # model/presets.py names


def build_random_target(shape: str, *, dtype=jnp.float32, seed: int = 0) -> TargetLM:
    if shape not in CPU_SHAPES:
        raise SystemExit(f"unknown --config {shape!r}; choose from {list(CPU_SHAPES)}")
    return TargetLM(target_preset(shape), rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)


def time_callable(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds per call, after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def bench_plain(model: TargetLM, *, batch: int, prompt_len: int, new_tokens: int, repeats: int):
    target = nnx.split(model)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.config.vocab_size, (batch, prompt_len)).tolist()

    def median_seconds(n: int) -> float:
        # No EOS ids: every row runs exactly n tokens. Same capacity for both lengths.
        arrays, static = prepare_batch(
            model.config, prompts, max_new_tokens=n, eos_ids=(), capacity=prompt_len + new_tokens
        )
        key = jax.random.key(0)
        run = lambda: generate_jit(target, *arrays, key, **static)  # noqa: E731
        return statistics.median(time_callable(run, repeats))

    t_full, t_one = median_seconds(new_tokens), median_seconds(1)
    decode_s = max(t_full - t_one, 1e-9)
    return {
        "mode": "plain",
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "median_s": t_full,
        "prefill_s": t_one,
        "decode_tok_s": batch * (new_tokens - 1) / decode_s,
        "end_to_end_tok_s": batch * new_tokens / t_full,
    }


def print_table(rows: list[dict]) -> None:
    print(
        f"{'mode':>6} {'B':>4} {'prompt':>6} {'new':>5} {'median s':>9} {'decode tok/s':>13}"
        f" {'e2e tok/s':>10}"
    )
    for r in rows:
        print(
            f"{r['mode']:>6} {r['batch']:>4} {r['prompt_len']:>6} {r['new_tokens']:>5} "
            f"{r['median_s']:>9.4f} {r['decode_tok_s']:>13.1f} {r['end_to_end_tok_s']:>10.1f}"
        )


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
    s.add_argument("--slots", help="comma list of slot counts, e.g. 1,4,16")
    s.add_argument("--target", help="HF target dir (default: random --config target)")
    s.add_argument("--drafter", help="drafter dir (default: an untrained drafter)")
    s.add_argument("--policies", default="fixed", help="comma list of fixed/adaflash/goodput")
    s.add_argument("--requests", type=int, help="requests per slot count (default: 2 x slots)")
    g = p.add_argument_group("shape mode: random-weight timings of a named shape (GPU)")
    g.add_argument("--shape", help="e.g. qwen3-8b (see adaflash_jax/model/presets.py)")
    g.add_argument("--batches", default="1,8,32,64,128")
    g.add_argument("--widths", default="1,2,4,8,16")
    g.add_argument("--context", type=int, default=1024)
    g.add_argument("--iters", type=int, default=10)
    g.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM TB/s (H200: 4.3)")
    g.add_argument("--draft-layers", type=int, default=0, help="also time a drafter (0: no)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--draft-batches", help="default: --batches")
    g.add_argument("--cost-table", help="write the engine's cost table JSON here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    with one_line_errors():
        if args.shape:
            return shape_mode(args)
        if args.slots:
            return slots_mode(args)
    model = build_random_target(args.config, dtype=getattr(jnp, args.dtype))
    rows = [
        bench_plain(
            model,
            batch=b,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
        )
        for b in args.batch or [1, 8]
    ]
    print(f"config={args.config} dtype={args.dtype} backend={jax.default_backend()}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "dtype": args.dtype, "rows": rows}, f, indent=2)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def slots_mode(args) -> None:
    from adaflash_jax.bench import decode_timing as bench

    dtype = getattr(jnp, args.dtype)
    if args.target:
        from adaflash_jax.model.checkpoint import load_target

        target = load_target(args.target, dtype=dtype)
    else:
        target = build_random_target(args.config, dtype=dtype)
    if args.drafter:
        from adaflash_jax.drafter.checkpoint import load_drafter

        drafter = load_drafter(args.drafter, dtype=dtype)
        drafter.config.validate_against(target.config)
    else:
        drafter = untrained_drafter(target.config, dtype)
    k = drafter.config.block_size
    capacity = slot_capacity(args.prompt_len, args.new_tokens, k)
    rows = []
    for slots in _ints(args.slots):
        n = args.requests or 2 * slots
        reqs = bench.random_requests(
            target.config.vocab_size, n, prompt_len=(8, args.prompt_len), max_new=args.new_tokens
        )
        plain = bench.time_plain(target, reqs, slots=slots, capacity=capacity)
        rows.append(plain)
        for policy in args.policies.split(","):
            spec = bench.time_speculative(
                target, drafter, reqs, slots=slots, capacity=capacity, policy=policy
            )
            spec["ratio_to_plain"] = spec["tokens_per_s"] / plain["tokens_per_s"]
            rows.append(spec)
    print(f"backend={jax.default_backend()} block={k} new_tokens={args.new_tokens}")
    print(f"{'slots':>5} {'method':>12} {'policy':>8} {'tok/s':>9} {'ratio':>6} {'tau':>5} "
          f"{'width':>5} {'step ms':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['slots']:>5} {r['method']:>12} {r['policy'] or '-':>8} "
              f"{r['tokens_per_s']:>9.1f} {r.get('ratio_to_plain', 1.0):>6.2f} {r['tau']:>5.2f} "
              f"{r['mean_verify_width']:>5.2f} {r['step_ms']:>8.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "slots", "rows": rows}, f, indent=2)


def untrained_drafter(cfg: TargetConfig, dtype):
    from adaflash_jax.drafter.config import DrafterConfig
    from adaflash_jax.drafter.model import Drafter

    dcfg = DrafterConfig.for_target(
        cfg, mask_token_id=cfg.vocab_size - 1, num_layers=1, block_size=8, num_features=2
    )
    return Drafter(dcfg, rngs=nnx.Rngs(1), dtype=dtype, param_dtype=dtype)


def shape_mode(args) -> None:
    from adaflash_jax.bench import shape_bench as sb
    from adaflash_jax.bench.forward_timing import random_target

    if args.cost_table and not args.draft_layers:
        raise SystemExit("--cost-table needs --draft-layers (the engine drafts)")
    cfg = target_preset(args.shape)
    device = jax.devices()[0].device_kind
    floor = sb.floor_ms(cfg, args.bandwidth_tbs)
    print(f"{args.shape} on {device}: weight-read floor {floor:.2f} ms", flush=True)
    t0 = time.perf_counter()
    graphdef, state = random_target(cfg, jnp.bfloat16)
    print(f"random bf16 weights in {time.perf_counter() - t0:.1f} s", flush=True)
    batches, widths = _ints(args.batches), _ints(args.widths)
    rows, draft_rows, summary = [], [], {}
    out = {"shape": args.shape, "device": device, "context": args.context, "floor_ms": floor,
           "decode_b1": summary, "rows": rows, "draft_rows": draft_rows}  # fmt: skip

    def log(line: str) -> None:  # progress, and the JSON so far (a cut-short run keeps it)
        print(line, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    sb.verify_table(graphdef, state, cfg, batches=batches, widths=widths, context=args.context,
                    iters=args.iters, log=log, rows=rows)  # fmt: skip
    if args.draft_layers:
        dgraph, dstate = sb.random_drafter(cfg, layers=args.draft_layers,
                                           block_size=args.block_size)  # fmt: skip
        kw = dict(context=args.context, iters=args.iters, log=log, rows=draft_rows)
        batches_d = _ints(args.draft_batches or args.batches)
        sb.draft_times(graphdef, state, dgraph, dstate, batches=batches_d, **kw)
    decode = [r for r in rows if r["batch"] == 1 and r["width"] == 1]
    print(
        "\nverify (target forward over W new tokens per row), median ms, context "
        f"{args.context}:\n" + sb.markdown_grid(rows, floor)
    )
    if decode:
        ratio = decode[0]["median_ms"] / floor
        met = "met" if ratio <= sb.DECODE_GOAL else "NOT met"
        summary.update(decode_b1_ms=decode[0]["median_ms"], floor_ms=floor, ratio=ratio)
        print(f"plain decode step at B=1: {decode[0]['median_ms']:.2f} ms = {ratio:.2f}x the "
              f"floor (goal <= {sb.DECODE_GOAL}x: {met})")  # fmt: skip
    log("done")
    if args.cost_table:
        write_cost_table(args, cfg, (graphdef, state), (dgraph, dstate))


def write_cost_table(args, cfg, target_pair, drafter_pair) -> None:
    """The engine's cost table (`bench.step_cost.measure`: its loop program per verify
    width, the plain loop and the draft forward) at --batches, a cache of --context."""
    from adaflash_jax.bench.step_cost import measure

    table = measure(
        nnx.merge(*target_pair),
        nnx.merge(*drafter_pair),
        rows=_ints(args.batches),
        capacity=args.context,
        buckets=_ints(args.widths),
        rounds=max(1, args.iters // 4),
    )
    table = dataclasses.replace(table, model=f"{args.shape} random bf16; {table.model}")
    table.save(args.cost_table)
    print(f"wrote {args.cost_table}")


if __name__ == "__main__":
    main()
