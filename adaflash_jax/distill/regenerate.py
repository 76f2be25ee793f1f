"""Responses regenerated greedily by the target, stored as a reusable sequence dataset.

Dimensions: M prompts, P padded prompt length, R max new tokens, S training sequence length.

The drafter must imitate the target, not a dataset's authors (docs/design.md §4.1), so every
training response is the target's own greedy continuation, produced by the project's plain
decoder (`decode.generate`: the engine without a drafter, `batch_size` slots continuously
batched). A sequence is prompt + response (EOS kept), truncated to S and padded; the loss
mask covers response tokens only. Every chunk runs on the same slots and capacity, so the
loop program compiles once.

The dataset directory records a fingerprint of everything that determines its content
(target, prompts, lengths); a later run with the same fingerprint reuses it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from adaflash_jax.decode.generate import generate
from adaflash_jax.distill.batches import SequenceData
from adaflash_jax.sharding.rows import RowLayout

CHUNK_BATCHES = 4  # prompts per progress update, in batches of slots


def fingerprint(target_id: str, prompt_ids: Sequence[Sequence[int]], **knobs) -> str:
    h = hashlib.sha256(target_id.encode())
    h.update(json.dumps(knobs, sort_keys=True).encode())
    for p in prompt_ids:
        h.update(np.asarray(p, np.int32).tobytes() + b"|")
    return h.hexdigest()[:16]


def generate_greedy(
    target_split,
    target_cfg,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    eos_ids: Sequence[int],
    progress: bool = True,
    rows: RowLayout | None = None,
) -> list[list[int]]:
    """Greedy responses (EOS included when reached) on `batch_size` slots."""
    from tqdm.auto import tqdm

    del target_cfg  # the merged target carries it
    target = nnx.merge(*target_split)
    capacity = max(len(p) for p in prompt_ids) + max_new_tokens
    b = batch_size * CHUNK_BATCHES
    out: list[list[int]] = []
    starts = range(0, len(prompt_ids), b)
    for start in tqdm(starts, desc="regenerate", disable=not progress or jax.process_index()):
        chunk = list(prompt_ids[start : start + b])
        out += generate(
            target,
            chunk,
            max_new_tokens=max_new_tokens,
            eos_ids=eos_ids,
            capacity=capacity,
            slots=batch_size,
            rows=rows,
        )
    return out


def build_sequences(
    prompt_ids: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    domain_ids: Sequence[int],
    *,
    seq_len: int,
    pad_id: int,
    domains: Sequence[str],
    meta: dict | None = None,
) -> SequenceData:
    """prompt + response per row, padded/truncated to `seq_len`, mask on the response."""
    m = len(prompt_ids)
    tokens = np.full((m, seq_len), pad_id, np.int32)
    mask = np.zeros((m, seq_len), bool)
    for i, (p, r) in enumerate(zip(prompt_ids, responses, strict=True)):
        row = (list(p) + list(r))[:seq_len]
        tokens[i, : len(row)] = row
        mask[i, len(p) : len(row)] = True
    return SequenceData(
        tokens=tokens,
        loss_mask=mask,
        domain=np.asarray(domain_ids, np.int32),
        domains=tuple(domains),
        meta=dict(meta or {}),
    )


def regenerate_dataset(
    path: str,
    target_split,
    target_cfg,
    prompt_ids: Sequence[Sequence[int]],
    domain_names: Sequence[str],
    *,
    target_id: str,
    max_new_tokens: int,
    seq_len: int,
    batch_size: int,
    eos_ids: Sequence[int],
    pad_id: int,
    progress: bool = True,
    rows: RowLayout | None = None,
) -> SequenceData:
    """Loads the dataset at `path` if its fingerprint matches, else regenerates and saves it.

    Every process generates (the program is SPMD); process 0 writes.
    """
    domains = tuple(dict.fromkeys(domain_names))
    fp = fingerprint(target_id, prompt_ids, max_new=max_new_tokens, seq_len=seq_len)
    if SequenceData.exists(path):
        data = SequenceData.load(path)
        if data.meta.get("fingerprint") == fp:
            return data
    responses = generate_greedy(
        target_split,
        target_cfg,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        eos_ids=eos_ids,
        progress=progress,
        rows=rows,
    )
    data = build_sequences(
        prompt_ids,
        responses,
        [domains.index(d) for d in domain_names],
        seq_len=seq_len,
        pad_id=pad_id,
        domains=domains,
        meta={
            "fingerprint": fp,
            "target": target_id,
            "max_new_tokens": max_new_tokens,
            "prompt_lengths": [len(p) for p in prompt_ids],
            "response_lengths": [len(r) for r in responses],
            # responses with no token but an EOS: trained on as they are, counted in the report
            "empty_responses": sum(all(t in eos_ids for t in r) for r in responses),
        },
    )
    if jax.process_index() == 0:
        data.save(path)
    return data
