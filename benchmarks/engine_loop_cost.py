"""XLA's cost analysis of the engine's loop programs on the CPU backend: one step's FLOPs and
bytes accessed (a while loop's body is counted once), plain and drafted, per slot count.

Deterministic for a given jax and code, so two checkouts compare exactly where CPU timing is
noisy (BENCHMARKS.md §15). Run from a checkout, or against another one's package:

    python benchmarks/engine_loop_cost.py --config tiny --slots 1,16
    PYTHONPATH=/path/to/other/checkout python benchmarks/engine_loop_cost.py ...
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
from flax import nnx

from adaflash_jax.decode import programs
from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM


def loop_cost(target, drafter, slots: int, capacity: int, width: int) -> dict:
    """One step of the engine's first loop program, pinned to verify width `width`."""
    engine = SpeculativeEngine(target, drafter, slots=slots, capacity=capacity, buckets=(width,))
    state = engine.init_state(0)
    stop, steps = jnp.asarray(False), jnp.asarray(10, jnp.int32)
    lowered = programs.run_loop.lower(
        *engine.models, state, stop, steps, spec=engine.spec, program=0
    )
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="tiny", help="a model/presets.py target name")
    p.add_argument("--slots", default="1,16")
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--block-size", type=int, default=8)
    args = p.parse_args(argv)
    cfg = target_preset(args.config)
    target = TargetLM(cfg, rngs=nnx.Rngs(0))
    dcfg = DrafterConfig.for_target(
        cfg, mask_token_id=cfg.vocab_size - 1, num_layers=1, block_size=args.block_size,
        num_features=2,
    )  # fmt: skip
    drafter = Drafter(dcfg, rngs=nnx.Rngs(1))
    for slots in map(int, args.slots.split(",")):
        for name, d, width in (("plain", None, 1), ("drafted", drafter, args.block_size)):
            row = {"config": args.config, "slots": slots, "step": name}
            print(json.dumps(row | loop_cost(target, d, slots, args.capacity, width)))


if __name__ == "__main__":
    main()
