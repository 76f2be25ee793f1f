"""Sequence datasets on disk and the resumable batch iterator of the train loops.

Dimensions: M sequences, S sequence length, B global batch, N anchors, R recorded block
starts per sequence (on-policy data; −1 pads).

A dataset is one `.npz` (tokens, loss_mask, domain, optional `visited`) plus `meta.json`.
The iterator walks a fresh permutation each epoch and resamples anchors per (epoch, example),
so its whole state is two integers: checkpoint them and a resumed run sees the same batches.
Every process computes the global index list and materialises only its own rows (per-host
input sharding); `jax.make_array_from_process_local_data` assembles the global batch.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from adaflash_jax.distill import fs
from adaflash_jax.distill.anchors import example_rng, sample_anchors


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


class BatchIterator:
    """Endless batches {tokens, loss_mask, anchors, valid} of this process's rows."""

    def __init__(
        self,
        data: SequenceData,
        *,
        global_batch: int,
        num_anchors: int,
        block_size: int,
        seed: int,
        on_policy_anchors: bool = False,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if len(data) == 0:
            raise ValueError("cannot train on an empty dataset")
        if global_batch % process_count:
            raise ValueError(f"global batch {global_batch} does not split over {process_count}")
        if on_policy_anchors and data.visited is None:
            raise ValueError("on-policy anchors need a dataset with recorded block starts")
        self.data = data
        self.global_batch, self.num_anchors, self.block_size = global_batch, num_anchors, block_size
        self.seed, self.on_policy = seed, on_policy_anchors
        per = global_batch // process_count
        self.rows = slice(process_index * per, (process_index + 1) * per)
        self.epoch, self.position = 0, 0

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def set_state(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.data))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        order = []  # (epoch, example) for every row of the global batch
        perm = self._permutation(self.epoch)
        for _ in range(self.global_batch):
            order.append((self.epoch, int(perm[self.position])))
            self.position += 1
            if self.position == len(self.data):
                self.epoch, self.position = self.epoch + 1, 0
                perm = self._permutation(self.epoch)
        rows = order[self.rows]
        d = self.data
        anchors, valid = zip(
            *(
                sample_anchors(
                    d.loss_mask[i],
                    self.num_anchors,
                    self.block_size,
                    example_rng(self.seed, epoch, i),
                    candidates=d.visited[i] if self.on_policy else None,
                )
                for epoch, i in rows
            )
        )
        idx = np.array([i for _, i in rows])
        return {
            "tokens": d.tokens[idx].astype(np.int32),
            "loss_mask": d.loss_mask[idx].astype(bool),
            "anchors": np.stack(anchors),
            "valid": np.stack(valid),
        }
