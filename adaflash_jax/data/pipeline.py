"""Input pipeline: tokenize, pack documents into fixed-length rows, serve shuffled batches.

Dimensions: N packed rows, T sequence length (rows hold T+1 tokens: T inputs plus the
shifted targets), B global batch, b = B / P per-process batch, P processes.

Packing concatenates documents (each ending in EOS) and cuts the stream into rows; a
segment id per token (0 = padding) lets attention and the loss stay inside one document,
and positions restart at every document start.

Order: the shared grain pipeline (`data.loader`): epoch e visits the rows in a fresh
permutation, global batch k is samples kB..kB+B-1 of the stream, and process p takes every
P-th of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from adaflash_jax.data import loader


@dataclasses.dataclass(frozen=True)
class PackedRows:
    tokens_NxT1: np.ndarray  # int32
    segment_ids_NxT1: np.ndarray  # int32, 0 = padding

    @property
    def num_rows(self) -> int:
        return self.tokens_NxT1.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens_NxT1.shape[1] - 1

    @property
    def num_target_tokens(self) -> int:
        seg = self.segment_ids_NxT1
        return int(((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).sum())


def tokenize_documents(tokenizer, texts: Sequence[str], eos_id: int) -> list[np.ndarray]:
    """Token ids per document, each ending in exactly one EOS."""
    out = []
    for enc in tokenizer.encode_batch(list(texts)):
        ids = enc.ids
        if not ids or ids[-1] != eos_id:
            ids = [*ids, eos_id]
        out.append(np.asarray(ids, np.int32))
    return out


def pack_documents(
    docs: Sequence[np.ndarray], seq_len: int, *, pad_id: int, seed: int | None = 0
) -> PackedRows:
    """Concatenate (optionally shuffled) documents and cut into rows of seq_len + 1 tokens."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if not docs:
        raise ValueError("pack_documents got no documents")
    order = (
        np.arange(len(docs)) if seed is None else np.random.default_rng(seed).permutation(len(docs))
    )
    stream = np.concatenate([docs[i] for i in order])
    segments = np.concatenate([np.full(len(docs[i]), n + 1, np.int32) for n, i in enumerate(order)])
    width = seq_len + 1
    rows = -(-len(stream) // width)
    pad = rows * width - len(stream)
    tokens = np.concatenate([stream, np.full(pad, pad_id, np.int32)]).reshape(rows, width)
    seg = np.concatenate([segments, np.zeros(pad, np.int32)]).reshape(rows, width)
    return PackedRows(tokens_NxT1=tokens, segment_ids_NxT1=seg)


def positions_from_segments(segment_ids_BxT: np.ndarray) -> np.ndarray:
    """Position of each token inside its document fragment (restarts at segment changes)."""
    t = segment_ids_BxT.shape[-1]
    idx = np.broadcast_to(np.arange(t, dtype=np.int32), segment_ids_BxT.shape)
    start = np.ones_like(segment_ids_BxT, dtype=bool)
    start[..., 1:] = segment_ids_BxT[..., 1:] != segment_ids_BxT[..., :-1]
    last_start = np.maximum.accumulate(np.where(start, idx, 0), axis=-1)
    return (idx - last_start).astype(np.int32)


class _Rows:
    """Random access to the packed rows, one {"tokens", "segment_ids"} record each."""

    def __init__(self, rows: PackedRows):
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.num_rows

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"tokens": self.rows.tokens_NxT1[i], "segment_ids": self.rows.segment_ids_NxT1[i]}


def _finish(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**batch, "positions": positions_from_segments(batch["segment_ids"])}


def batch_iterator(
    rows: PackedRows,
    *,
    global_batch: int,
    seed: int,
    process_index: int | None = None,
    process_count: int | None = None,
):
    """Per-process batches {"tokens", "segment_ids", "positions"} of shape [b, T+1], from
    the shared grain pipeline (`data.loader`); its iterator state is what checkpoints keep."""
    if process_index is None or process_count is None:
        import jax

        process_index, process_count = jax.process_index(), jax.process_count()
    return loader.batch_iterator(
        _Rows(rows),
        global_batch=global_batch,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
        finish=_finish,
    )
