"""Input pipeline: tokenize, pack documents into fixed-length rows, serve shuffled batches.

Dimensions: N packed rows, T sequence length (rows hold T+1 tokens: T inputs plus the
shifted targets), B global batch, b = B / P per-process batch, P processes.

Packing concatenates documents (each ending in EOS) and cuts the stream into rows; a
segment id per token (0 = padding) lets attention and the loss stay inside one document,
and positions restart at every document start.

Order: epoch e visits the rows in a permutation seeded by (seed, e); global sample g of the
endless stream is row perm_e[g % N] with e = g // N. Global batch k is samples kB..kB+B-1,
and process p takes every P-th of them. The stream is served by grain when it is installed
(prefetching, checkpointable `DatasetIterator`) and by a pure-python iterator otherwise;
both produce identical batches and the same state `{"next_index": k, ...}`, so a run
checkpointed on a machine with grain resumes on one without it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

_MAX_EPOCHS = 1_000_000  # the stream is "endless": far more epochs than any run uses


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


class _EpochShuffledRows:
    """Random-access view of the endless, epoch-permuted stream of packed rows."""

    def __init__(self, rows: PackedRows, seed: int):
        self.rows, self.seed = rows, seed

    def __len__(self) -> int:
        return self.rows.num_rows * _MAX_EPOCHS

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs, lives with the run
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.rows.num_rows)

    def __getitem__(self, g: int) -> dict[str, np.ndarray]:
        epoch, i = divmod(int(g), self.rows.num_rows)
        r = self._permutation(epoch)[i]
        return {"tokens": self.rows.tokens_NxT1[r], "segment_ids": self.rows.segment_ids_NxT1[r]}


def _finish(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**batch, "positions": positions_from_segments(batch["segment_ids"])}


def _stack(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([s[k] for s in samples]) for k in samples[0]}


class BatchIterator:
    """Per-process batches {"tokens", "segment_ids", "positions"} of shape [b, T+1]."""

    def __init__(self, rows, *, global_batch, seed, process_index, process_count, backend):
        if global_batch % process_count:
            raise ValueError(
                f"global_batch {global_batch} is not divisible by process_count {process_count}"
            )
        self._source = _EpochShuffledRows(rows, seed)
        self._local = global_batch // process_count
        self._p, self._P = process_index, process_count
        self._fingerprint = {"num_rows": rows.num_rows, "seed": seed, "global_batch": global_batch}
        self.backend = backend
        self._next = 0
        self._grain_iter = None
        if backend == "grain":
            import grain

            ds = grain.MapDataset.source(self._source)[process_index::process_count]
            ds = ds.batch(self._local, drop_remainder=True).map(_finish)
            options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
            self._grain_iter = iter(ds.to_iter_dataset(options))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._grain_iter is not None:
            return next(self._grain_iter)
        k, b, P = self._next, self._local, self._P
        samples = [self._source[(k * b + i) * P + self._p] for i in range(b)]
        self._next += 1
        return _finish(_stack(samples))

    def get_state(self) -> dict:
        if self._grain_iter is not None:
            k = int(self._grain_iter.get_state()["next_index"])
        else:
            k = self._next
        return {"next_index": k, **self._fingerprint}

    def set_state(self, state: dict) -> None:
        for key, want in self._fingerprint.items():
            if state.get(key) != want:
                raise ValueError(
                    f"data iterator state has {key}={state.get(key)!r} but this pipeline has "
                    f"{want!r}; the checkpoint belongs to a different dataset or batch size"
                )
        k = int(state["next_index"])
        if self._grain_iter is not None:
            self._grain_iter.set_state({"next_index": k})
        else:
            self._next = k


def grain_available() -> bool:
    try:
        import grain  # noqa: F401
    except ImportError:
        return False
    return True


def batch_iterator(
    rows: PackedRows,
    *,
    global_batch: int,
    seed: int,
    process_index: int | None = None,
    process_count: int | None = None,
    backend: str = "auto",
) -> BatchIterator:
    """backend: "grain", "python", or "auto" (grain when installed)."""
    if backend not in ("auto", "grain", "python"):
        raise ValueError(f"backend must be 'auto', 'grain' or 'python', got {backend!r}")
    if backend == "auto":
        backend = "grain" if grain_available() else "python"
    elif backend == "grain" and not grain_available():
        raise ImportError(
            "backend='grain' requested but grain is not installed (pip install grain)"
        )
    if process_index is None or process_count is None:
        import jax

        process_index, process_count = jax.process_index(), jax.process_count()
    return BatchIterator(
        rows,
        global_batch=global_batch,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
        backend=backend,
    )
