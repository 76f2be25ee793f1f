"""Data-side helpers of pretraining: tokenizer preparation, packing, host<->device moves,
and the per-domain held-out evaluation."""

from __future__ import annotations

import os

import jax
import numpy as np

from adaflash_jax.data.corpus import DOMAINS, Corpus
from adaflash_jax.data.pipeline import (
    PackedRows,
    pack_documents,
    positions_from_segments,
    tokenize_documents,
)
from adaflash_jax.data.tokenizer_train import load_tokenizer, save_tokenizer, train_tokenizer
from adaflash_jax.train.presets import PretrainConfig


def prepare_tokenizer(cfg: PretrainConfig, corpus: Corpus, out_dir: str, resume: bool):
    """Trains (and saves) the BPE on the train split; a resumed run reuses the saved one."""
    if resume and os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        return load_tokenizer(out_dir)
    tok = train_tokenizer(corpus.texts("train"), vocab_size=cfg.vocab_size)
    if jax.process_index() == 0:
        save_tokenizer(tok, out_dir, model_max_length=cfg.max_position_embeddings)
    return tok


def pack_train(cfg: PretrainConfig, corpus: Corpus, tok, eos_id: int) -> PackedRows:
    docs = tokenize_documents(tok, corpus.texts("train"), eos_id)
    return pack_documents(docs, cfg.seq_len, pad_id=eos_id, seed=cfg.seed)


def pack_eval(cfg: PretrainConfig, corpus: Corpus, tok, eos_id: int) -> dict[str, PackedRows]:
    """Held-out rows per domain, in corpus order, capped at cfg.eval_rows_per_domain."""
    out = {}
    for domain in DOMAINS:
        docs = tokenize_documents(tok, corpus.texts("eval", domain), eos_id)
        rows = pack_documents(docs, cfg.seq_len, pad_id=eos_id, seed=None)
        n = min(rows.num_rows, cfg.eval_rows_per_domain)
        out[domain] = PackedRows(rows.tokens_NxT1[:n], rows.segment_ids_NxT1[:n])
    return out


def to_device(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """This process's rows -> global arrays laid out as `sharding`."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's slice of a global batch that every process holds whole."""
    p, n = jax.process_index(), jax.process_count()
    b = next(iter(batch.values())).shape[0] // n
    return {k: v[p * b : (p + 1) * b] for k, v in batch.items()}


def host_params(params):
    """Params as host numpy arrays (gathered across processes when sharded over hosts)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(params, tiled=True)
    return jax.device_get(params)


def _eval_batches(rows: PackedRows, batch_size: int, pad_id: int):
    tokens, seg = rows.tokens_NxT1, rows.segment_ids_NxT1
    for start in range(0, rows.num_rows, batch_size):
        t, s = tokens[start : start + batch_size], seg[start : start + batch_size]
        if len(t) < batch_size:  # pad with empty rows (segment 0 is never counted)
            extra = batch_size - len(t)
            t = np.concatenate([t, np.full((extra, t.shape[1]), pad_id, np.int32)])
            s = np.concatenate([s, np.zeros((extra, s.shape[1]), np.int32)])
        yield {"tokens": t, "segment_ids": s, "positions": positions_from_segments(s)}


def evaluate_domains(eval_fn, params, eval_rows, batch_size, pad_id, sharding) -> dict:
    """{domain: {"loss": mean CE (nats) per predicted token, "tokens": count}}."""
    out = {}
    for domain, rows in eval_rows.items():
        total, count = 0.0, 0
        for batch in _eval_batches(rows, batch_size, pad_id):
            ce, n = eval_fn(params, to_device(local_rows(batch), sharding))
            total, count = total + float(ce), count + int(n)
        out[domain] = {"loss": total / max(count, 1), "tokens": count}
    return out
