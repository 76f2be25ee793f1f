"""Plain decode throughput of a random-weight target: `python -m experiments.benchmark_decode`.

Each case runs the jitted generate loop twice after a warm-up compile: with N new tokens and
with 1 (prefill + first sample). Decode tokens/s = B·(N−1) / (t_N − t_1) on medians, so
prefill does not inflate it; end-to-end tokens/s = B·N / t_N is reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.decode.generate import generate_jit, prepare_batch, split_target
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.target import TargetLM

SHAPES: dict[str, Callable[[], TargetConfig]] = {
    "tiny": lambda: TargetConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}


def build_random_target(shape: str, *, dtype=jnp.float32, seed: int = 0) -> TargetLM:
    if shape not in SHAPES:
        raise SystemExit(f"unknown --config {shape!r}; choose from {sorted(SHAPES)}")
    return TargetLM(SHAPES[shape](), rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)


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
    graphdef, state = split_target(model)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.config.vocab_size, (batch, prompt_len)).tolist()

    def median_seconds(n: int) -> float:
        # No EOS ids: every row runs exactly n tokens. Same capacity for both lengths.
        prepared = prepare_batch(
            model.config, prompts, max_new_tokens=n, eos_ids=(), capacity=prompt_len + new_tokens
        )
        key = jax.random.key(0)
        run = lambda: generate_jit(graphdef, state, *prepared.arrays, key, **prepared.static)  # noqa: E731
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, action="append", help="repeatable (default: 1 and 8)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    main()
