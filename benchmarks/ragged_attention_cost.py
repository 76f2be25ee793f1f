"""Verify attention on one v5e chip (deviceless compile, COMPILER ESTIMATES): XLA's
`attend_cached` against the Pallas kernel `model/ragged_attention.py`.

For the XLA form, XLA's cost analysis (bytes accessed) of the compiled
program. A Pallas kernel is a custom call whose cost XLA does not model (it reports what the
kernel declares), so for the kernel the script prints the cache bytes its grid fetches,
counted from the block specs: each row's ⌈length / Ts⌉ tiles of keys and values (ANALYTIC,
not a measurement). Both at the rows' mean committed length `--fill` × capacity.

    python benchmarks/ragged_attention_cost.py --capacity 1024,4096 --fill 0.25,1.0 \
        --out benchmarks/tpu/issue39/ragged_attention_cost.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from adaflash_jax.aot.topology import parse_slice, slice_devices  # noqa: E402
from adaflash_jax.model.layers import attend_cached  # noqa: E402
from adaflash_jax.model.ragged_attention import ragged_attend_cached, tile_for  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--width", type=int, default=16, help="W: a row's verify tokens")
    p.add_argument("--heads", default="16,8,128", help="H,Kv,Dh")
    p.add_argument("--capacity", default="1024,4096")
    p.add_argument("--fill", default="0.25,1.0", help="mean committed length / capacity")
    p.add_argument("--topology", default="v5e-1")
    p.add_argument("--out")
    a = p.parse_args(argv)
    h, kv, dh = (int(x) for x in a.heads.split(","))
    b, w = a.rows, a.width
    dev = slice_devices(parse_slice(a.topology))[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    rows = []
    for s in (int(x) for x in a.capacity.split(",")):
        args = (arg((b, w, h, dh)), arg((b, s, kv, dh)), arg((b, s, kv, dh)),
                arg((b,), jnp.int32), arg((b, w, kv, dh)), arg((b, w, kv, dh)),
                arg((b, w, w), bool))  # fmt: skip
        cost = jax.jit(attend_cached).lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        jax.jit(ragged_attend_cached).lower(*args).compile()  # Mosaic compiles it
        ts = tile_for(s)
        for fill in (float(x) for x in a.fill.split(",")):
            length = max(1, int(fill * s))
            tiles = math.ceil(length / ts)
            kernel_bytes = 2 * b * tiles * ts * kv * dh * 2  # k and v, bf16
            row = {
                "capacity": s,
                "mean_length": length,
                "tile": ts,
                "xla_bytes_accessed": cost.get("bytes accessed"),
                "kernel_cache_bytes_fetched_analytic": kernel_bytes,
            }
            rows.append(row)
            print(json.dumps(row))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"settings": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
