"""The plain decoder's rate on eagerly built random CPU-sized targets, and the untrained
drafter the slots comparison drafts with when no trained one is given.

The plain decoder (the engine without a drafter, one slot per row) runs after a warm-up
compile with N new tokens and with 1 (prefill and the first sample): decode tokens/s =
B·(N−1) / (t_N − t_1) on medians, so prefill does not inflate it; end-to-end tokens/s =
B·N / t_N is reported too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM

# Eagerly built random targets (CPU sizes); GPU shapes go through `bench/shape_bench.py`.
# "micro-moe" has micro's active parameters per token (a mixture of experts against its
# dense twin).
CPU_SHAPES = ("test", "micro", "tiny", "micro-moe", "micro-hybrid")  # model/presets.py names


def build_random_target(shape: str, *, dtype=jnp.float32, seed: int = 0) -> TargetLM:
    if shape not in CPU_SHAPES:
        raise ValueError(f"unknown random target {shape!r}; choose from {list(CPU_SHAPES)}")
    return TargetLM(target_preset(shape), rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)


def untrained_drafter(cfg: TargetConfig, dtype) -> Drafter:
    """A one-layer, block-8 drafter of the target's shape with random weights (τ ≈ 1)."""
    dcfg = DrafterConfig.for_target(
        cfg, mask_token_id=cfg.vocab_size - 1, num_layers=1, block_size=8, num_features=2
    )
    return Drafter(dcfg, rngs=nnx.Rngs(1), dtype=dtype, param_dtype=dtype)


def bench_models(target_dir: str | None, drafter_dir: str | None, *, shape: str, dtype):
    """(target, drafter): the target of an HF directory, else a random one of `shape`; the
    drafter of an export (checked against the target), else an untrained one."""
    if target_dir:
        from adaflash_jax.model.checkpoint import load_target

        target = load_target(target_dir, dtype=dtype)
    else:
        target = build_random_target(shape, dtype=dtype)
    if not drafter_dir:
        return target, untrained_drafter(target.config, dtype)
    from adaflash_jax.drafter.checkpoint import load_drafter

    drafter = load_drafter(drafter_dir, dtype=dtype)
    drafter.config.validate_against(target.config)
    return target, drafter


def time_callable(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds per call, after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def _median_seconds(engine: SpeculativeEngine, prompts, n: int, repeats: int):
    requests = [(p, n) for p in prompts]  # no EOS ids: every row runs exactly n tokens
    return statistics.median(time_callable(lambda: engine.generate(requests), repeats))


def bench_plain(model: TargetLM, *, batch: int, prompt_len: int, new_tokens: int, repeats: int):
    """One row: the loop's median seconds, prefill seconds and decode / end-to-end rates."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.config.vocab_size, (batch, prompt_len)).tolist()
    capacity = prompt_len + new_tokens  # the same for every n
    engine = SpeculativeEngine(model, None, slots=batch, capacity=capacity, eos_ids=())
    t_full = _median_seconds(engine, prompts, new_tokens, repeats)
    t_one = _median_seconds(engine, prompts, 1, repeats)
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


def plain_table(rows: list[dict]) -> str:
    """`bench_plain` rows as a fixed-width table."""
    lines = [
        f"{'mode':>6} {'B':>4} {'prompt':>6} {'new':>5} {'median s':>9} {'decode tok/s':>13}"
        f" {'e2e tok/s':>10}"
    ]
    for r in rows:
        lines.append(
            f"{r['mode']:>6} {r['batch']:>4} {r['prompt_len']:>6} {r['new_tokens']:>5} "
            f"{r['median_s']:>9.4f} {r['decode_tok_s']:>13.1f} {r['end_to_end_tok_s']:>10.1f}"
        )
    return "\n".join(lines)
