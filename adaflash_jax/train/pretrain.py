"""Pretraining the embedded target from scratch: corpus -> tokenizer -> packed batches ->
sharded train loop (orbax checkpoints, TensorBoard, progress bar) -> per-domain held-out
loss -> a plain HuggingFace directory.

Output directory layout:
  config.json, model.safetensors, generation_config.json,
  tokenizer.json, tokenizer_config.json, special_tokens_map.json   the HF checkpoint
  metrics.json      sizes, timings, per-domain eval loss (and ln V, the uniform model's loss)
  corpus/           metadata.json (provenance), docs_*.jsonl, prompts_{train,eval}.jsonl
  checkpoints/      orbax train state + data iterator state (resumable)
  tensorboard/      scalars
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from adaflash_jax.data.corpus import Corpus, build_corpus
from adaflash_jax.data.dialogue import EOS_TOKEN
from adaflash_jax.data.pipeline import PackedRows, batch_iterator
from adaflash_jax.data.tokenizer_train import special_token_ids, write_generation_config
from adaflash_jax.model.checkpoint import save_target
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.checkpointing import Checkpointer, PreemptionGuard
from adaflash_jax.train.lm_loss import jit_eval, lm_loss_fn
from adaflash_jax.train.mesh import make_mesh
from adaflash_jax.train.optimizer import (
    OptimizerConfig,
    check_skips,
    count_params,
    make_optimizer,
)
from adaflash_jax.train.presets import PretrainConfig
from adaflash_jax.train.pretrain_data import (
    evaluate_domains,
    host_params,
    pack_eval,
    pack_train,
    prepare_tokenizer,
    to_device,
)
from adaflash_jax.train.progress import Progress
from adaflash_jax.train.state import batch_sharding, create_train_state
from adaflash_jax.train.tensorboard import ScalarWriter
from adaflash_jax.train.train_step import make_train_step

log = logging.getLogger(__name__)
BATCH_KEYS = ("tokens", "segment_ids", "positions")


@dataclasses.dataclass
class Trainer:
    """Everything the loop needs, built once per run."""

    state: Any
    shardings: Any
    graphdef: Any
    step_fn: Any
    data_sharding: Any
    num_params: int


def build_trainer(cfg: PretrainConfig, vocab: int, eos_id: int, mesh: Mesh, total_steps: int):
    target_cfg = cfg.target_config(vocab, eos_id)
    dtype = jnp.dtype(cfg.compute_dtype)

    def model_fn(rngs):
        return TargetLM(target_cfg, rngs=rngs, dtype=dtype, param_dtype=jnp.float32)

    tx, schedule = make_optimizer(
        OptimizerConfig(
            lr=cfg.lr,
            total_steps=max(total_steps, cfg.warmup_steps + 1),
            warmup_steps=cfg.warmup_steps,
            final_lr_fraction=cfg.final_lr_fraction,
            weight_decay=cfg.weight_decay,
            clip_norm=cfg.clip_norm,
        )
    )
    state, shardings, graphdef = create_train_state(
        model_fn, tx, mesh=mesh, rules=TRAIN_RULES, seed=cfg.seed
    )
    data_sharding = batch_sharding(mesh, TRAIN_RULES, ndim=2, batch_size=cfg.batch_size)
    step_fn = make_train_step(
        lm_loss_fn(graphdef),
        tx,
        state_shardings=shardings,
        batch_shardings={k: data_sharding for k in BATCH_KEYS},
        schedules={"lr": schedule},
    )
    return Trainer(state, shardings, graphdef, step_fn, data_sharding, count_params(state.params))


def train_loop(
    cfg, trainer: Trainer, data_iter, checkpointer, writer, *, total_steps, stop_at_step, progress
):
    """Runs steps until total_steps (or a stop request); returns (status, losses, tok/s)."""
    state = trainer.state
    start = step = int(jax.device_get(state.step))
    losses: list[tuple[int, float]] = []
    status, tok_s, last_saved, bar_step = "done", 0.0, None, start
    with (
        PreemptionGuard() as guard,
        Progress(
            total=total_steps,
            initial=start,
            tokens_per_step=cfg.batch_size * cfg.seq_len,
            desc=f"pretrain {cfg.name}",
            enabled=progress and jax.process_index() == 0,
        ) as bar,
    ):
        while step < total_steps:
            state, metrics = trainer.step_fn(
                state, to_device(next(data_iter), trainer.data_sharding)
            )
            step += 1
            if checkpointer.save(step, state, data_iter):
                last_saved = step
            if step % cfg.log_every == 0 or step in (total_steps, start + 1):
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                losses.append((step - 1, m["loss"]))
                tok_s = bar.update(step - bar_step, loss=m["loss"])
                bar_step = step
                if step == start + 1:
                    bar.restart_clock()  # tokens/s without compile time
                skipped = check_skips(
                    "pretrain", state.opt_state, step, cfg.max_nonfinite_steps, last_saved
                )
                scalars = {"train/loss": m["loss"], "train/lr": m["lr"]}
                scalars["train/skipped_total"] = skipped
                writer.write(step, scalars | {"train/grad_norm": m["grad_norm"]})
            preempted = guard.should_stop or checkpointer.reached_preemption(step)
            if preempted or (stop_at_step is not None and step >= stop_at_step):
                status = "stopped"
                break
    if last_saved != step:
        checkpointer.save(step, state, data_iter, force=True)
    trainer.state = state
    return status, losses, tok_s


def run_pretrain(
    cfg: PretrainConfig,
    out_dir: str | os.PathLike,
    *,
    steps: int | None = None,
    resume: bool = False,
    mesh: Mesh | None = None,
    stop_at_step: int | None = None,
    keep_checkpoints: bool = True,
    progress: bool = True,
    corpus: Corpus | None = None,
) -> dict:
    """Trains `cfg` into `out_dir`; returns the metrics dict (also written to metrics.json).

    steps overrides cfg.steps (and the schedule's length). stop_at_step simulates a
    preemption: checkpoint at that step and return {"status": "stopped"} without exporting.
    keep_checkpoints=False deletes checkpoints/ after a successful export. `corpus` skips
    rebuilding it (it must be `build_corpus(cfg.corpus)`).
    """
    t_start = time.perf_counter()
    out_dir = os.path.abspath(os.fspath(out_dir))
    total_steps = steps or cfg.steps
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    if not resume and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise FileExistsError(
            f"{ckpt_dir} already holds checkpoints; pass resume=True (--resume) or a fresh out dir"
        )
    os.makedirs(out_dir, exist_ok=True)
    timings = {}
    corpus = corpus or build_corpus(cfg.corpus)
    if jax.process_index() == 0:
        corpus.write(os.path.join(out_dir, "corpus"))
    timings["corpus_s"] = time.perf_counter() - t_start

    t0 = time.perf_counter()
    tok = prepare_tokenizer(cfg, corpus, out_dir, resume)
    eos_id, vocab = special_token_ids(tok)[EOS_TOKEN], tok.get_vocab_size()
    train_rows = pack_train(cfg, corpus, tok, eos_id)
    eval_rows: dict[str, PackedRows] = pack_eval(cfg, corpus, tok, eos_id)
    timings["tokenizer_s"] = time.perf_counter() - t0

    mesh = mesh or make_mesh(data=-1)
    trainer = build_trainer(cfg, vocab, eos_id, mesh, total_steps)
    data_iter = batch_iterator(train_rows, global_batch=cfg.batch_size, seed=cfg.seed)
    checkpointer = Checkpointer(ckpt_dir, save_every=cfg.save_every, keep=cfg.keep_checkpoints)
    if resume and checkpointer.latest_step() is not None:
        abstract = jax.eval_shape(lambda s: s, trainer.state)
        trainer.state, _ = checkpointer.restore(abstract, trainer.shardings)
        checkpointer.restore_data(data_iter)
        log.info("resumed from step %d", int(jax.device_get(trainer.state.step)))

    t0 = time.perf_counter()
    with checkpointer, ScalarWriter(os.path.join(out_dir, "tensorboard")) as writer:
        status, losses, tok_s = train_loop(
            cfg,
            trainer,
            data_iter,
            checkpointer,
            writer,
            total_steps=total_steps,
            stop_at_step=stop_at_step,
            progress=progress,
        )
        timings["train_s"] = time.perf_counter() - t0
        result = {
            "preset": cfg.name,
            "status": status,
            "step": int(jax.device_get(trainer.state.step)),
            "num_params": trainer.num_params,
            "vocab_size": vocab,
            "uniform_loss_ln_v": math.log(vocab),
            "train_losses": losses,
            "tokens_per_s": tok_s,
            "train_rows": train_rows.num_rows,
            "mesh": dict(mesh.shape),
            "timings": timings,
        }
        if status != "done":
            return result
        t0 = time.perf_counter()
        eval_fn = jit_eval(
            trainer.graphdef,
            param_shardings=trainer.shardings.params,
            batch_shardings={k: trainer.data_sharding for k in BATCH_KEYS},
        )
        result["eval"] = evaluate_domains(
            eval_fn, trainer.state.params, eval_rows, cfg.batch_size, eos_id, trainer.data_sharding
        )
        writer.write(
            result["step"], {f"eval/{d}_loss": v["loss"] for d, v in result["eval"].items()}
        )
        timings["eval_s"] = time.perf_counter() - t0

    params = host_params(trainer.state.params)
    if jax.process_index() == 0:
        save_target(nnx.merge(trainer.graphdef, params), out_dir)
        write_generation_config(out_dir, eos_id)
        if not keep_checkpoints:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    timings["total_s"] = time.perf_counter() - t_start
    result["corpus"] = corpus.metadata["stats"]
    result["corpus_fingerprint"] = corpus.metadata["fingerprint"]
    if jax.process_index() == 0:
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(result, f, indent=2)
    return result
