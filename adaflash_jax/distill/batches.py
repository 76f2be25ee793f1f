"""Sequence datasets on disk (local or gs://) and the distillation batches.

Dimensions: M sequences, S sequence length, B global batch, N anchors, R recorded block
starts per sequence (on-policy data; −1 pads).

A dataset is one `.npz` (tokens, loss_mask, domain, optional `visited`) plus `meta.json`.
Batches come from the shared grain pipeline (`data.loader`): a fresh permutation each
epoch, anchors resampled per (seed, epoch, example); grain's iterator state is what the
checkpoint stores, so a resumed run sees the same batches. Each process materialises only
its own rows (per-host input sharding); `jax.make_array_from_process_local_data`
assembles the global batch.
"""

from __future__ import annotations

import dataclasses
import json

import grain
import numpy as np

from adaflash_jax.data import loader
from adaflash_jax.distill.anchors import (
    ANCHOR_RULES,
    admissible_by_rule,
    example_rng,
    sample_anchors,
    sequence_mask,
)
from adaflash_jax.io import fs


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceData:
    tokens: np.ndarray  # [M, S] int32
    loss_mask: np.ndarray  # [M, S] bool: response tokens
    domain: np.ndarray  # [M] int32 index into `domains`
    domains: tuple[str, ...] = ()
    visited: np.ndarray | None = None  # [M, R] int32 block starts seen on-policy, −1 pad
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        m, s = self.tokens.shape
        if self.loss_mask.shape != (m, s):
            raise ValueError(f"loss_mask shape {self.loss_mask.shape} != tokens {(m, s)}")
        if self.domain.shape != (m,):
            raise ValueError(f"domain shape {self.domain.shape} != ({m},)")
        if self.visited is not None and self.visited.shape[0] != m:
            raise ValueError("visited must have one row per sequence")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def subset(self, rows) -> SequenceData:
        """The given rows (recorded block starts included), same domains, no meta."""
        rows = np.asarray(rows)
        visited = None if self.visited is None else self.visited[rows]
        return SequenceData(
            tokens=self.tokens[rows],
            loss_mask=self.loss_mask[rows],
            domain=self.domain[rows],
            domains=self.domains,
            visited=visited,
        )

    def save(self, path: str) -> None:
        """Arrays first, meta.json last: a directory with meta.json is complete."""
        arrays = dict(tokens=self.tokens, loss_mask=self.loss_mask, domain=self.domain)
        if self.visited is not None:
            arrays["visited"] = self.visited
        fs.save_npz(f"{path}/data.npz", **arrays)
        meta = {**self.meta, "domains": list(self.domains)}
        fs.write_text(f"{path}/meta.json", json.dumps(meta, indent=1))

    @classmethod
    def load(cls, path: str) -> SequenceData:
        if not fs.exists(f"{path}/meta.json"):
            raise FileNotFoundError(f"no complete sequence dataset at {path} (meta.json missing)")
        meta = json.loads(fs.read_text(f"{path}/meta.json"))
        arrays = fs.load_npz(f"{path}/data.npz")
        domains = tuple(meta.pop("domains", ()))
        return cls(**arrays, domains=domains, meta=meta)

    @staticmethod
    def exists(path: str) -> bool:
        return fs.exists(f"{path}/meta.json")


class Examples:
    """Training records of the example stream (`data.loader`): the g-th sample, example i
    of epoch e = g div M, gets anchors drawn from (seed, e, i) by `anchor_rule` (see
    `distill.anchors`). Under the "sequence" rule the served loss mask is every non-padding
    token (those blocks learn the sequence's own tokens)."""

    def __init__(self, data: SequenceData, *, num_anchors, block_size, seed, anchor_rule):
        self.data, self.num_anchors, self.block_size = data, num_anchors, block_size
        self.seed, self.anchor_rule = seed, anchor_rule

    def __call__(self, g: int, i: int) -> dict[str, np.ndarray]:
        epoch, d = int(g) // len(self.data), self.data
        visited = d.visited[i] if self.anchor_rule == "visited" else None
        ok = admissible_by_rule(d.loss_mask[i], self.block_size, self.anchor_rule, visited)
        anchors, valid = sample_anchors(ok, self.num_anchors, example_rng(self.seed, epoch, i))
        mask = d.loss_mask[i] if self.anchor_rule != "sequence" else sequence_mask(d.loss_mask[i])
        return {
            "tokens": d.tokens[i].astype(np.int32),
            "loss_mask": mask.astype(bool),
            "anchors": anchors,
            "valid": valid,
        }


def batch_iterator(
    data: SequenceData,
    *,
    global_batch: int,
    num_anchors: int,
    block_size: int,
    seed: int,
    anchor_rule: str = "response",
    process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """Endless batches {tokens, loss_mask, anchors, valid} of this process's rows: global
    batch k holds samples kB … kB+B−1 of the stream, process p every P-th of them."""
    if anchor_rule not in ANCHOR_RULES:
        raise ValueError(f"unknown anchor rule {anchor_rule!r}; choose from {ANCHOR_RULES}")
    if anchor_rule == "visited" and data.visited is None:
        raise ValueError("'visited' anchors need a dataset with recorded block starts")
    examples = Examples(
        data, num_anchors=num_anchors, block_size=block_size, seed=seed, anchor_rule=anchor_rule
    )
    return loader.batch_iterator(
        range(len(data)),
        global_batch=global_batch,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
        draw=examples,
    )
