"""The one batch-iterator design of every train loop (pretraining and distillation): grain.

Dimensions: M examples, B global batch, b = B / P per-process batch, P processes.

The global stream is grain's: `shuffle` (a fresh permutation of the M examples every epoch,
seeded by (seed, epoch)) then `repeat` for EPOCHS epochs; global sample g is therefore example
perm_e[g mod M] of epoch e = g div M. An optional `draw(g, example)` turns each sample
into its training record (distillation draws anchors there, per (seed, epoch, example)).
Process p takes every P-th sample of the stream (samples kB + p, kB + p + P, … make its
part of global batch k), so the global batch does not depend on the process count; grain
batches b of them and prefetches on threads.

The iterator is grain's `DatasetIterator`: its state (the next batch index) is saved and
restored by grain's orbax handler (`train.checkpointing`), one file per process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grain

EPOCHS = 1_000_000  # "endless" for any run (an unbounded repeat overflows len() on tiny data)
# Threads that read and batch ahead of the train step, and how many batches they keep ready.
READ_THREADS = 2
PREFETCH_BATCHES = 4


def batch_iterator(
    source: Sequence,
    *,
    global_batch: int,
    seed: int,
    process_index: int,
    process_count: int,
    draw: Callable[[int, object], dict] | None = None,
    finish: Callable[[dict], dict] | None = None,
) -> grain.DatasetIterator:
    """Endless per-process batches of `source` (random access), as described above.

    `draw(g, element)` maps the g-th sample of the global stream to its record (default:
    the element itself); `finish(batch)` adds batch-level fields after stacking.
    """
    if len(source) == 0:
        raise ValueError("cannot train on an empty dataset")
    if global_batch % process_count:
        raise ValueError(
            f"global batch {global_batch} does not split over {process_count} processes"
        )
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(EPOCHS)
    if draw is not None:
        ds = ds.map_with_index(draw)
    ds = ds[process_index::process_count].batch(global_batch // process_count)
    if finish is not None:
        ds = ds.map(finish)
    options = grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=PREFETCH_BATCHES)
    return iter(ds.to_iter_dataset(options))
