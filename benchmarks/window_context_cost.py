"""CPU cost of the drafter's context at a long context, with and without a sliding window.

One jitted `Drafter.draft` (the engine's draft forward) per configuration, on a context cache
filled to `--context` positions: median wall time of `--repeats` calls after one warm-up, the
context cache's allocated bytes, and the bytes of context keys/values one draft step reads
(a sliding layer reads only the W − 1 entries its window can see; the cache keeps its full
capacity, as the engine allocates and writes it).

    python benchmarks/window_context_cost.py --context 8192 --window 1024 \
        --out benchmarks/cpu/window_context_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from adaflash_jax.drafter.config import DrafterConfig  # noqa: E402
from adaflash_jax.drafter.model import Drafter  # noqa: E402
from adaflash_jax.model.presets import target_preset  # noqa: E402

# A drafter as wide as Qwen3-0.6B (for a 28-layer target), with a 32k vocab to keep the LM
# head small on CPU.
SHAPE = dict(
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)


def measure(layer_types, window, *, batch, context, repeats, block_size=16):
    target = target_preset("test", **SHAPE)
    cfg = DrafterConfig.for_target(
        target,
        mask_token_id=SHAPE["vocab_size"] - 1,
        num_layers=len(layer_types),
        block_size=block_size,
        length_head=False,
        layer_types=layer_types,
        sliding_window=window,
    )
    drafter = Drafter(cfg, rngs=nnx.Rngs(0))
    cache = drafter.init_context_cache(batch, context + block_size, ring_windows=False)
    keys = jax.random.split(jax.random.key(1), len(cache.layers))
    cache = cache.replace(
        layers=tuple(
            jax.tree.map(lambda x, key=key: jax.random.normal(key, x.shape, x.dtype), c)
            for key, c in zip(keys, cache.layers)
        ),
        lengths=jnp.full((batch,), context, jnp.int32),
    )
    store = [c.k_BxSxKvxDh for c in cache.layers]
    emb_VxD = jax.random.normal(jax.random.key(2), (SHAPE["vocab_size"], SHAPE["hidden_size"]))
    bonus_B = jnp.zeros((batch,), jnp.int32)
    step = nnx.jit(lambda d, c, b: d.draft(c, b, emb_VxD, emb_VxD.T).logits_BxKm1xV)
    step(drafter, cache, bonus_B).block_until_ready()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(drafter, cache, bonus_B).block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    entry_bytes = batch * cfg.num_key_value_heads * cfg.head_dim * 2 * store[0].dtype.itemsize
    read = sum(min(context, (cfg.layer_window(i) or context + 1) - 1) for i in range(len(store)))
    return {
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "draft_ms_median": round(statistics.median(times), 2),
        "draft_ms_min": round(min(times), 2),
        "cache_allocated_mib": round(sum(c.nbytes * 2 for c in store) / 2**20, 2),
        "context_read_per_step_mib": round(read * entry_bytes / 2**20, 2),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out")
    a = p.parse_args(argv)
    n = a.layers
    runs = {
        "full": ((("full_attention",) * n), None),
        f"sliding {a.window}, all layers": ((("sliding_attention",) * n), a.window),
        f"sliding {a.window}, last layer full": (
            ("sliding_attention",) * (n - 1) + ("full_attention",),
            a.window,
        ),
    }
    out = {"context": a.context, "batch": a.batch, "drafter_layers": n, "shape": SHAPE}
    out["jax"] = jax.__version__
    out["runs"] = {}
    for name, (types, window) in runs.items():
        out["runs"][name] = measure(
            types, window, batch=a.batch, context=a.context, repeats=a.repeats
        )
        print(name, json.dumps(out["runs"][name]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
