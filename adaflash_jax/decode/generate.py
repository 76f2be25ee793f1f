"""Plain batched generation with the target: one jitted `lax.while_loop` over a pytree state.

Dimensions: B rows, Q padded prompt length, T max new tokens (static), S cache capacity,
V vocab.

Prompts are right-padded and prefilled in ONE target call (`num_new_B` = each row's prompt
length: padding is written but never committed); then one token per step per row. Rows stop
independently on any EOS id (kept) or their own max-new-tokens; a finished row rides along
with `num_new = 0`, so its cache never advances. Tokens are picked and committed as in the
speculative engine (`tokens.py`). The target travels as an `nnx.split` (graphdef, state)
pair: the program compiles once per (graphdef, B, Q, T, S, eos ids, greedy). RNG schedule
(the tests' Python-loop reference follows it): `rng, key = split(rng)` before every sample.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from adaflash_jax.decode.tokens import append_tokens, pick_tokens
from adaflash_jax.model.cache import Cache
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rows import RowLayout, constrain_rows

PROMPT_BUCKET = 16  # prompts pad to a multiple of this, so nearby lengths share a program


class GenerateError(ValueError):
    """A generation request the model cannot serve (bad ids, too long, empty prompt)."""


@struct.dataclass
class DecodeState:
    cache: Cache
    tokens_BxT: jax.Array  # generated tokens; slots past num_out_B hold -1
    num_out_B: jax.Array  # int32 tokens generated so far
    done_B: jax.Array  # bool: hit EOS or its max-new-tokens
    rng: jax.Array


def _commit(s: DecodeState, tok_B, active_B, max_new_B, eos_E) -> DecodeState:
    """Appends `tok_B` to active rows and updates their done flags."""
    one_B = jnp.ones_like(s.num_out_B)
    tokens_BxT, num_out_B, done_B = append_tokens(
        s.tokens_BxT, s.num_out_B, s.done_B, tok_B[:, None], one_B, active_B, max_new_B, eos_E
    )
    return s.replace(tokens_BxT=tokens_BxT, num_out_B=num_out_B, done_B=done_B)


@functools.partial(
    jax.jit,
    static_argnames=("max_new_tokens", "capacity", "eos_ids", "greedy", "nucleus", "rows"),
)
def generate_jit(
    target: tuple[nnx.GraphDef, nnx.State],
    prompt_BxQ: jax.Array,
    prompt_len_B: jax.Array,
    max_new_B: jax.Array,
    temperature_B: jax.Array,
    top_p_B: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    capacity: int,
    eos_ids: tuple[int, ...],
    greedy: bool,
    nucleus: bool = True,
    rows: RowLayout | None = None,
) -> DecodeState:
    """Prefill + while_loop decode; returns the final state (inputs validated by `generate`).
    With `rows` the batch (prompts, cache, outputs) is split over those mesh axes."""
    model = nnx.merge(*target)
    b = prompt_BxQ.shape[0]
    prompt_BxQ = constrain_rows(rows, prompt_BxQ, b)
    rows_B = jnp.arange(b)
    eos_E = jnp.asarray(eos_ids or (-1,), jnp.int32)
    top_p = top_p_B if nucleus else None  # None: no vocabulary sort when no row filters

    out = model(
        prompt_BxQ,
        cache=constrain_rows(rows, model.init_cache(b, capacity), b),
        num_new_B=prompt_len_B,
        compute_logits=False,
        rows=rows,
    )
    last_hidden_BxD = out.hidden_BxTxD[rows_B, prompt_len_B - 1]
    logits_BxV = model.logits(last_hidden_BxD[:, None])[:, 0]
    rng, key = jax.random.split(rng)
    first_B = pick_tokens(key, logits_BxV, temperature_B, top_p, greedy=greedy)
    s = DecodeState(
        cache=out.cache,
        tokens_BxT=jnp.full((b, max_new_tokens), -1, jnp.int32),
        num_out_B=jnp.zeros((b,), jnp.int32),
        done_B=jnp.zeros((b,), bool),
        rng=rng,
    )
    s = constrain_rows(rows, _commit(s, first_B, jnp.ones((b,), bool), max_new_B, eos_E), b)

    def step(s: DecodeState) -> DecodeState:
        active_B = ~s.done_B
        last_B = s.tokens_BxT[rows_B, s.num_out_B - 1]
        out = model(last_B[:, None], cache=s.cache, num_new_B=active_B.astype(jnp.int32), rows=rows)
        rng, key = jax.random.split(s.rng)
        tok_B = pick_tokens(key, out.logits_BxTxV[:, 0], temperature_B, top_p, greedy=greedy)
        s = s.replace(cache=out.cache, rng=rng)
        return constrain_rows(rows, _commit(s, tok_B, active_B, max_new_B, eos_E), b)

    return jax.lax.while_loop(lambda s: jnp.any(~s.done_B), step, s)


def _per_row(value, b: int, name: str) -> list:
    values = list(value) if isinstance(value, Sequence) else [value] * b
    if len(values) != b:
        raise GenerateError(f"{name} has {len(values)} entries for {b} prompts")
    return values


def prepare_batch(
    cfg: TargetConfig,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float | Sequence[float] = 0.0,
    top_p: float | Sequence[float] = 1.0,
    eos_ids: Sequence[int] | None = None,
    capacity: int | None = None,
) -> tuple[tuple[jax.Array, ...], dict]:
    """Checks every request against the model BEFORE any compute, then pads the batch.
    Returns `generate_jit`'s arrays (prompt_BxQ, prompt_len_B, max_new_B, temperature_B,
    top_p_B) and static keywords."""
    b = len(prompts)
    if b == 0:
        raise GenerateError("no prompts given")
    max_new = [int(m) for m in _per_row(max_new_tokens, b, "max_new_tokens")]
    temps = [float(t) for t in _per_row(temperature, b, "temperature")]
    top_ps = [float(p) for p in _per_row(top_p, b, "top_p")]
    lengths = [len(p) for p in prompts]
    for i, (prompt, n_new, t, p) in enumerate(zip(prompts, max_new, temps, top_ps)):
        if not prompt:
            raise GenerateError(f"prompt {i} is empty")
        bad = [int(x) for x in prompt if not 0 <= int(x) < cfg.vocab_size]
        if bad:
            raise GenerateError(
                f"prompt {i} has token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}"
            )
        if n_new < 1:
            raise GenerateError(f"max_new_tokens must be >= 1, got {n_new} for prompt {i}")
        if not t >= 0 or not 0 < p <= 1:
            raise GenerateError(f"prompt {i}: need temperature >= 0 and 0 < top_p <= 1")
        if len(prompt) + n_new > cfg.max_position_embeddings:
            raise GenerateError(
                f"prompt {i}: {len(prompt)} prompt + {n_new} new tokens exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings})"
            )
    n = max(max_new)
    q_pad = -(-max(lengths) // PROMPT_BUCKET) * PROMPT_BUCKET
    needed = max(length + m for length, m in zip(lengths, max_new))
    capacity = capacity if capacity is not None else q_pad + n
    if needed > capacity:
        raise GenerateError(f"cache capacity {capacity} is smaller than prompt + new ({needed})")

    prompt_BxQ = np.zeros((b, q_pad), np.int32)
    for i, prompt in enumerate(prompts):
        prompt_BxQ[i, : len(prompt)] = np.asarray(prompt, np.int32)
    eos = tuple(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids))
    arrays = tuple(jnp.asarray(x, jnp.int32) for x in (prompt_BxQ, lengths, max_new))
    arrays += (jnp.asarray(temps, jnp.float32), jnp.asarray(top_ps, jnp.float32))
    greedy, nucleus = all(t == 0 for t in temps), any(p < 1.0 for p in top_ps)
    static = dict(max_new_tokens=n, capacity=capacity, eos_ids=eos, greedy=greedy, nucleus=nucleus)
    return arrays, static


def generate(
    target: TargetLM, prompts: Sequence[Sequence[int]], *, seed: int = 0, **batch_kw
) -> list[list[int]]:
    """Generates for a batch of token-id prompts; returns each row's new tokens, ending at
    (and including) the first EOS or after its max-new-tokens. `batch_kw`: `prepare_batch`'s
    max_new_tokens, temperature (0: greedy), top_p (those three may be per row), eos_ids
    (default: the config's) and capacity."""
    arrays, static = prepare_batch(target.config, prompts, **batch_kw)
    final = generate_jit(nnx.split(target), *arrays, jax.random.key(seed), **static)
    tokens_BxT, num_out_B = jax.device_get((final.tokens_BxT, final.num_out_B))
    return [tokens_BxT[i, : num_out_B[i]].tolist() for i in range(len(prompts))]
