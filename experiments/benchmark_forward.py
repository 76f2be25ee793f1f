"""Verify/decode forward timing of a random-weight target of a named shape (GPU figures).

python -m experiments.benchmark_forward --shape qwen3-8b --batches 1,8,32 --widths 1,2,4,16
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from adaflash_jax.bench.forward_timing import make_verify_fn, random_target, time_forward
from adaflash_jax.bench.shapes import weight_bytes
from adaflash_jax.cli import int_list, one_line_errors
from adaflash_jax.model.presets import target_preset


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--batches", type=int_list, default="1")
    p.add_argument("--widths", type=int_list, default="1,2,4,8,16")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM bandwidth for the floor")
    p.add_argument("--json", default=None, help="write rows to this path")
    a = p.parse_args(argv)
    with one_line_errors():
        run(a)


def run(a) -> None:
    cfg = target_preset(a.shape)
    graphdef, state = random_target(cfg, jnp.bfloat16)
    floor_ms = weight_bytes(cfg) / (a.bandwidth_tbs * 1e12) * 1e3
    print(f"{a.shape} on {jax.devices()[0].device_kind}: weight-read floor {floor_ms:.2f} ms")
    verify_fn = make_verify_fn(graphdef)
    rows = []
    for b in a.batches:
        for w in a.widths:
            r = time_forward(
                graphdef, state, cfg, batch=b, width=w, context=a.context, iters=a.iters,
                verify_fn=verify_fn,
            )  # fmt: skip
            r["floor_ms"] = floor_ms
            rows.append(r)
            print(
                f"B={b:4d} T={w:3d}  median {r['median_ms']:8.2f} ms  "
                f"({r['median_ms'] / floor_ms:5.2f}x floor)  first call {r['first_call_s']:.1f} s",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "device": jax.devices()[0].device_kind, "rows": rows}, f)


if __name__ == "__main__":
    main()
