"""Plain batched generation: the speculative engine without a drafter (the one plain decoder).

Dimensions: B rows.

Every prompt is checked against the model before any compute, then decoded by
`SpeculativeEngine(target, None)`: one prefill per admitted group, then one target token per
row per step (the engine's plain step), each row stopping on any EOS id (kept) or its own
max-new-tokens. `slots` rows run at once (default: one per prompt), continuous batching the
rest; temperature and top-p apply to every row alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaflash_jax.decode.slots import EngineError, SpeculativeEngine
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rows import RowLayout


class GenerateError(ValueError):
    """A generation request the model cannot serve (bad ids, too long, empty prompt)."""


def _per_row(value, b: int, name: str) -> list[int]:
    values = list(value) if isinstance(value, Sequence) else [value] * b
    if len(values) != b:
        raise GenerateError(f"{name} has {len(values)} entries for {b} prompts")
    return [int(v) for v in values]


def check_requests(cfg, prompts, max_new: list[int], temperature, top_p) -> None:
    """Raises GenerateError naming the first request the model cannot serve."""
    if not prompts:
        raise GenerateError("no prompts given")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, Sequence):
            raise GenerateError(f"{name} is one number for the batch, got {value!r}")
    if not temperature >= 0 or not 0 < top_p <= 1:
        raise GenerateError(f"need temperature >= 0 and 0 < top_p <= 1: {temperature}, {top_p}")
    for i, (prompt, n_new) in enumerate(zip(prompts, max_new)):
        if not prompt:
            raise GenerateError(f"prompt {i} is empty")
        bad = [int(x) for x in prompt if not 0 <= int(x) < cfg.vocab_size]
        if bad:
            raise GenerateError(
                f"prompt {i} has token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}"
            )
        if n_new < 1:
            raise GenerateError(f"max_new_tokens must be >= 1, got {n_new} for prompt {i}")
        if len(prompt) + n_new > cfg.max_position_embeddings:
            raise GenerateError(
                f"prompt {i}: {len(prompt)} prompt + {n_new} new tokens exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings})"
            )


def generate(
    target: TargetLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    capacity: int | None = None,
    slots: int | None = None,
    rows: RowLayout | None = None,
) -> list[list[int]]:
    """Each prompt's new tokens, ending at (and including) the first EOS or after its
    max-new-tokens (one number, or one per prompt). `capacity`: cache entries per row
    (default: the longest prompt + new tokens); `rows`: the slots split over mesh axes."""
    prompts = [list(map(int, p)) for p in prompts]
    max_new = _per_row(max_new_tokens, len(prompts), "max_new_tokens")
    check_requests(target.config, prompts, max_new, temperature, top_p)
    needed = max(len(p) + m for p, m in zip(prompts, max_new))
    if capacity is not None and needed > capacity:
        raise GenerateError(f"cache capacity {capacity} is smaller than prompt + new ({needed})")
    engine = SpeculativeEngine(
        target,
        None,
        slots=slots or len(prompts),
        capacity=capacity or needed,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        eos_ids=eos_ids,
        rows=rows,
    )
    try:
        results = engine.generate(list(zip(prompts, max_new)))
    except EngineError as e:
        raise GenerateError(str(e)) from None
    return [r.output_ids for r in results]
