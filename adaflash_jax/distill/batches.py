"""Sequence datasets on disk and the resumable batch iterator of the train loops.

Dimensions: M sequences, S sequence length, B global batch, N anchors, R recorded block
starts per sequence (on-policy data; −1 pads).

A dataset is one `.npz` (tokens, loss_mask, domain, optional `visited`) plus `meta.json`.
The iterator walks a fresh permutation each epoch and resamples anchors per (epoch, example),
so its whole state is one integer (batches served): checkpoint it and a resumed run sees the
same batches. Each process materialises only its own rows (per-host input sharding);
`jax.make_array_from_process_local_data` assembles the global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

from adaflash_jax.distill import fs
from adaflash_jax.distill.anchors import (
    ANCHOR_RULES,
    admissible_by_rule,
    example_rng,
    sample_anchors,
    sequence_mask,
)


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


_MAX_EPOCHS = 1_000_000  # the example stream is endless for any practical run


class Examples:
    """Random access to the endless, epoch-shuffled example stream: sample g is example
    perm_e[g mod M] of epoch e = g div M, with anchors drawn from (seed, e, example) by
    `anchor_rule` (see `distill.anchors`). Under the "sequence" rule the served loss mask is
    every non-padding token (those blocks learn the sequence's own tokens)."""

    def __init__(self, data: SequenceData, *, num_anchors, block_size, seed, anchor_rule):
        self.data, self.num_anchors, self.block_size = data, num_anchors, block_size
        self.seed, self.anchor_rule = seed, anchor_rule

    def __len__(self) -> int:
        return len(self.data) * _MAX_EPOCHS

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a few epochs, lives with the iterator
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.data))

    def __getitem__(self, g: int) -> dict[str, np.ndarray]:
        epoch, j = divmod(int(g), len(self.data))
        i = int(self._permutation(epoch)[j])
        d = self.data
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


class BatchIterator:
    """Endless batches {tokens, loss_mask, anchors, valid} of this process's rows.

    Global batch k holds samples kB … kB+B−1 of `Examples`; process p takes every P-th
    (samples kB + p, kB + p + P, …). Served by a grain `MapDataset` when grain is installed
    and by plain Python otherwise: identical batches, identical state `{"next_index": k}`.
    """

    def __init__(
        self,
        data: SequenceData,
        *,
        global_batch: int,
        num_anchors: int,
        block_size: int,
        seed: int,
        anchor_rule: str = "response",
        process_index: int = 0,
        process_count: int = 1,
        backend: str = "auto",
    ):
        if len(data) == 0:
            raise ValueError("cannot train on an empty dataset")
        if global_batch % process_count:
            raise ValueError(f"global batch {global_batch} does not split over {process_count}")
        if anchor_rule not in ANCHOR_RULES:
            raise ValueError(f"unknown anchor rule {anchor_rule!r}; choose from {ANCHOR_RULES}")
        if anchor_rule == "visited" and data.visited is None:
            raise ValueError("'visited' anchors need a dataset with recorded block starts")
        if backend not in ("auto", "grain", "python"):
            raise ValueError(f"backend must be auto, grain or python, got {backend!r}")
        self.source = Examples(
            data,
            num_anchors=num_anchors,
            block_size=block_size,
            seed=seed,
            anchor_rule=anchor_rule,
        )
        self.local = global_batch // process_count
        self.p, self.P = process_index, process_count
        self.fingerprint = {"examples": len(data), "seed": seed, "global_batch": global_batch}
        self.fingerprint["anchors"] = f"{anchor_rule}:{num_anchors}"
        self.next_index = 0
        self._grain = None
        if backend in ("auto", "grain"):
            try:
                import grain
            except ImportError:
                if backend == "grain":
                    raise
            else:
                ds = grain.MapDataset.source(self.source)[process_index::process_count]
                self._grain = ds.batch(self.local, drop_remainder=True)

    @property
    def backend(self) -> str:
        return "python" if self._grain is None else "grain"

    def get_state(self) -> dict:
        return {"next_index": self.next_index, **self.fingerprint}

    def set_state(self, state: dict) -> None:
        for key, want in self.fingerprint.items():
            if state.get(key) != want:
                raise ValueError(
                    f"data iterator state has {key}={state.get(key)!r}, this pipeline {want!r}: "
                    "the checkpoint belongs to another dataset or batch size"
                )
        self.next_index = int(state["next_index"])

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        k = self.next_index
        self.next_index += 1
        if self._grain is not None:
            return self._grain[k]
        rows = [self.source[(k * self.local + j) * self.P + self.p] for j in range(self.local)]
        return {key: np.stack([r[key] for r in rows]) for key in rows[0]}
