"""Times the target's cached forward (decode / verify) at given batch sizes and widths.

Dimensions: B batch rows, T new tokens per row (verify width), C context already cached.

The weights are random (initialised on device, never on the host). Each timed call runs T
new tokens per row against a cache holding C tokens, then rolls the cache back, exactly as a
verify step does, so repeated calls measure the same work.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.target import TargetLM


def random_target(cfg: TargetConfig, dtype=jnp.bfloat16, seed: int = 0):
    """(graphdef, state) of a random-weight target, materialised leaf by leaf on device."""
    abstract = nnx.eval_shape(
        lambda: TargetLM(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)
    )
    return random_state(abstract, seed)


def random_state(abstract_module, seed: int):
    """(graphdef, state) with N(0, 0.02) weights, initialised leaf by leaf on the device.

    Leaf-by-leaf: one jitted init of a 36-layer model compiles for minutes on the GPU."""
    graphdef, abstract_state = nnx.split(abstract_module)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(abstract_state))))
    state = jax.tree.map(
        lambda s: (0.02 * jax.random.normal(next(keys), s.shape, jnp.float32)).astype(s.dtype),
        abstract_state,
    )
    return graphdef, state


def make_verify_fn(graphdef):
    """jit(state, cache, tokens) → (greedy next tokens [B, T], cache rolled back)."""

    def verify(state, cache, tokens_BxT):
        model = nnx.merge(graphdef, state)
        out = model(tokens_BxT, cache=cache, compute_logits=False)
        next_BxT = jnp.argmax(model.logits(out.hidden_BxTxD), axis=-1)
        return next_BxT, out.cache.with_lengths(cache.lengths)

    return jax.jit(verify, donate_argnums=(1,))


def time_forward(
    graphdef,
    state,
    cfg: TargetConfig,
    *,
    batch: int,
    width: int,
    context: int,
    iters: int = 20,
    warmup: int = 3,
    dtype=jnp.bfloat16,
    verify_fn=None,
) -> dict:
    verify_fn = verify_fn or make_verify_fn(graphdef)
    capacity = context + 32
    model_cache = nnx.merge(graphdef, state).init_cache(batch, capacity, dtype)
    cache = model_cache.with_lengths(jnp.full((batch,), context, jnp.int32))
    tokens = jax.random.randint(jax.random.key(1), (batch, width), 0, cfg.vocab_size)
    t0 = time.perf_counter()
    out, cache = verify_fn(state, cache, tokens)
    out.block_until_ready()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        out, cache = verify_fn(state, cache, tokens)
    out.block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out, cache = verify_fn(state, cache, tokens)
        out.block_until_ready()
        times.append(time.perf_counter() - t0)
    del cache
    return {
        "batch": batch,
        "width": width,
        "context": context,
        "median_ms": float(np.median(times) * 1e3),
        "min_ms": float(np.min(times) * 1e3),
        "first_call_s": compile_s,
    }
