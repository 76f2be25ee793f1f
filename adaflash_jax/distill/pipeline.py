"""The whole distillation job (docs/design.md §4): regenerate → stage 1 → head init → stage 2 rounds
(AdaFlash and its comparisons, equal compute) → τ per domain → export → report.

Run directory layout:
  config.json, drafter_config.json, report.json, tau.png, losses.png, config_changes.jsonl
  data/{train,eval}/           regenerated greedy responses (reused when fingerprints match)
  ckpt/<stage>/                orbax checkpoints per stage (resume point)
  stage2/<method>/round<r>/    on-policy trajectories of each round
  export/<method>/             HF DFlash/AdaFlash drafters, README.md (adaflash: the product)
  tb/                          TensorBoard scalars
Re-running with the same run directory resumes: finished stages restore from their final
checkpoint, an interrupted stage continues from its latest one. A resume keeps config.json's
recipe: another one is refused or recorded in config_changes.jsonl (`distill/resume.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.distill import calibration, resume, schedule
from adaflash_jax.distill import prompts as P
from adaflash_jax.distill import report as R
from adaflash_jax.distill.batches import SequenceData
from adaflash_jax.distill.config import ConfigError, RunConfig
from adaflash_jax.distill.context import Context, encode_prompts, prepare
from adaflash_jax.distill.evaluation import extra_evaluations
from adaflash_jax.distill.export import (
    describe_run_export,
    export_drafter,
    prompt_format,
    save_drafter_config,
)
from adaflash_jax.distill.loop import Preempted
from adaflash_jax.distill.regenerate import regenerate_dataset
from adaflash_jax.distill.stages import Stage2Pool, Trainer, evaluate
from adaflash_jax.distill.state import fresh_drafter, load_drafter_sharded
from adaflash_jax.io import fs
from adaflash_jax.model.checkpoint import load_target
from adaflash_jax.sharding.rows import RowLayout
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.checkpointing import PreemptionGuard
from adaflash_jax.train.tensorboard import ScalarWriter, read_scalars

log = logging.getLogger(__name__)

__all__ = ["Preempted", "run", "run_prepared"]


def _dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


@dataclasses.dataclass(frozen=True)
class Datasets:
    train: SequenceData  # stage 1 and head init: the target's greedy responses
    eval: SequenceData  # held-out τ
    train_ids: P.Encoded  # ids per prompt, with the counts cut to / skipped over max_prompt_len
    eval_ids: P.Encoded
    pool: Stage2Pool | None  # what stage-2 rounds draw from
    stage2_ids: P.Encoded | None = None  # the "fresh" pool's prompts, when encoded


def _encode(ctx: Context, prompts, split: str) -> tuple[P.Encoded, list]:
    """(ids, the prompts kept): with `data.long_prompts="skip"` prompts over the budget are
    left out; a split left with none is refused."""
    ids = encode_prompts(ctx.cfg, ctx.tokenizer, prompts)
    if prompts and not ids:
        raise ConfigError(
            f"all {len(prompts)} {split} prompts are longer than data.max_prompt_len "
            f"{ctx.cfg.data.max_prompt_len} and data.long_prompts='skip' leaves none: raise "
            "data.max_prompt_len or set data.long_prompts='truncate'"
        )
    return ids, [prompts[i] for i in ids.kept]


def _regenerated(ctx: Context, target_split, split: str, ids, prompts, rows) -> SequenceData:
    cfg = ctx.cfg
    return regenerate_dataset(
        f"{cfg.data.regen_dir or ctx.path('data')}/{split}",
        target_split,
        ctx.target_cfg,
        ids,
        [p.domain for p in prompts],
        target_id=os.path.abspath(ctx.target_dir),
        max_new_tokens=cfg.data.max_new_tokens,
        seq_len=cfg.seq_len,
        batch_size=cfg.data.regen_batch,
        eos_ids=ctx.eos_ids,
        pad_id=ctx.pad_id,
        progress=ctx.progress,
        rows=rows,
    )


def _datasets(ctx: Context, target_split, mesh) -> Datasets:
    """Train and eval sets regenerated (or reused), and the stage-2 pool: the "fresh" pool's
    target responses are regenerated once for the replay collector (greedy, so they are
    exactly what every round's speculative decoding commits); the engine collector decodes
    the prompts itself each round."""
    train_ids, train_prompts = _encode(ctx, ctx.train_prompts, "train")
    eval_ids, eval_prompts = _encode(ctx, ctx.eval_prompts, "eval")
    rows = RowLayout.of(mesh, TRAIN_RULES, ctx.cfg.data.regen_batch)  # batch split over chips
    train = _regenerated(ctx, target_split, "train", train_ids, train_prompts, rows)
    evals = _regenerated(ctx, target_split, "eval", eval_ids, eval_prompts, rows)
    pool, ids = None, None
    if ctx.cfg.stage2.pool == "stage1":
        pool = Stage2Pool.of(train, train_ids)
    elif ctx.stage2_prompts:
        ids, prompts = _encode(ctx, ctx.stage2_prompts, "stage-2")
        if ctx.cfg.stage2.collector == "replay":
            pool = Stage2Pool.of(_regenerated(ctx, target_split, "stage2", ids, prompts, rows), ids)
        else:
            names = [p.domain for p in prompts]
            domains = tuple(dict.fromkeys(names))
            domain = np.asarray([domains.index(d) for d in names], np.int32)
            pool = Stage2Pool(ids, domain, domains)
    return Datasets(train, evals, train_ids, eval_ids, pool, ids)


def _write_config(ctx: Context, allow_config_change: bool) -> None:
    """config.json (a resume with another recipe is refused or recorded: `distill.resume`),
    then drafter_config.json."""
    resume.check_and_record(
        ctx.run_dir, ctx.cfg, allow_change=allow_config_change, write=ctx.is_main
    )
    if ctx.is_main:
        save_drafter_config(ctx.drafter_cfg, ctx.run_dir)


def run(
    cfg: RunConfig,
    *,
    run_dir: str | None = None,
    progress: bool = True,
    allow_config_change: bool = False,
) -> dict:
    """Validates, then runs everything; returns the report (also written to report.json).
    `allow_config_change`: resume a run directory whose config.json differs from `cfg` in
    fields not declared safe (`distill.resume`), recording the change."""
    from adaflash_jax.train.mesh import maybe_initialize_distributed

    d = cfg.distributed
    maybe_initialize_distributed(
        init_timeout_s=d.init_timeout_s,
        heartbeat_timeout_s=d.heartbeat_timeout_s,
        shutdown_timeout_s=d.shutdown_timeout_s,
    )
    t0 = time.perf_counter()
    ctx = prepare(cfg, run_dir=run_dir, progress=progress)
    ctx = dataclasses.replace(ctx, progress=progress)
    return run_prepared(ctx, t0=t0, allow_config_change=allow_config_change)


PROCESSES_FILE = "processes.json"


def check_process_count(ctx: Context) -> None:
    """A run directory resumes only with the process count that wrote it (grain's checkpoint
    handler keeps one input position per process): another count is refused at start, naming
    both; the first start records it."""
    path, now = ctx.path(PROCESSES_FILE), jax.process_count()
    if fs.exists(path):
        was = json.loads(fs.read_text(path))["process_count"]
        if was != now:
            raise ConfigError(
                f"run directory {ctx.run_dir} was written by {was} processes and this run has "
                f"{now}: resume it with {was} processes (the checkpoints hold one input "
                "position per process), or start a new --run-dir"
            )
    elif ctx.is_main:
        fs.write_text(path, json.dumps({"process_count": now}))


def run_prepared(
    ctx: Context, *, t0: float | None = None, allow_config_change: bool = False
) -> dict:
    t0 = time.perf_counter() if t0 is None else t0
    cfg = ctx.cfg
    check_process_count(ctx)
    _write_config(ctx, allow_config_change)
    if ctx.is_main:
        print(f"run directory: {ctx.run_dir}", flush=True)
    timings: dict[str, float] = {}

    def mark(name, since):  # a phase's seconds (a stage-2 method's steps add up)
        timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - since, 2)
        return time.perf_counter()

    mesh = ctx.mesh()
    dtype = _dtype(cfg.compute_dtype)
    t = time.perf_counter()
    target = load_target(ctx.target_dir, dtype=dtype, mesh=mesh, rules=TRAIN_RULES)
    target_split = nnx.split(target, nnx.Param)
    del target
    data = _datasets(ctx, target_split, mesh)
    t = mark("regenerate", t)

    dc = ctx.drafter_cfg
    if cfg.draft.init_from is not None:
        _, d_graph, params = load_drafter_sharded(
            cfg.draft.init_from,
            mesh=mesh,
            rules=TRAIN_RULES,
            seed=cfg.seed,
            dtype=dtype,
            accept_dim=dc.length_head.accept_dim,
        )
    else:
        d_graph, params = fresh_drafter(
            dc, mesh=mesh, rules=TRAIN_RULES, seed=cfg.seed, dtype=dtype
        )
    with ScalarWriter(ctx.path("tb")) as writer, PreemptionGuard() as guard:
        trainer = Trainer(ctx, mesh, target_split, d_graph, writer=writer, guard=guard)
        results = _train_and_evaluate(ctx, trainer, params, data, mark, t)
    report = _report(ctx, results, timings, time.perf_counter() - t0, data)
    if ctx.is_main:
        R.plot_losses(ctx.path("losses.png"), read_scalars(ctx.path("tb")))
    return report


def _calibration(ctx: Context, trainer: Trainer, data: Datasets):
    """What the length head's calibration is measured with, or None (not measured)."""
    if not ctx.cfg.eval.head_calibration:
        return None
    return calibration.Calibration(
        replay=trainer.replay,
        data=data.eval,
        block_size=ctx.drafter_cfg.block_size,
        directory=ctx.path(calibration.DIRECTORY),
        is_main=ctx.is_main,
    )


def _step(trainer: Trainer, step: schedule.Step, params, data: Datasets, calibrate, taus):
    """Runs one schedule step from `params` → its params (a stage-2 method's collection τ
    per round into `taus`), its calibration points measured with `calibrate`."""
    if step.kind == "stage1":
        return trainer.stage1(params, data.train, name=step.name, total=step.total)
    if step.kind == "stage2":
        params, taus[step.method] = trainer.stage2(
            step.method, params, data.pool, calibrate=calibrate, points=step.points
        )
        return params
    params = trainer.head_init(params, data.train, name=step.name)
    if calibrate is not None:
        for point in step.points:
            calibration.measure(calibrate, params, point)
    return params


def _train(ctx, trainer, params, data: Datasets, mark, t):
    """The run's schedule (distill/schedule.py), track by track → ({drafter: final params},
    {stage-2 method: collection τ per round}, t)."""
    calibrate = _calibration(ctx, trainer, data)
    finals = {schedule.INIT: params}
    collect_tau = {}
    for track in schedule.tracks(ctx.cfg):
        params = finals[track.start]
        for step in track.steps:
            params = _step(trainer, step, params, data, calibrate, collect_tau)
            t = mark(step.phase, t)
        finals[track.drafter] = params
    del finals[schedule.INIT]
    return finals, collect_tau, t


def _train_and_evaluate(ctx, trainer, params, data: Datasets, mark, t):
    cfg = ctx.cfg
    finals, collect_tau, t = _train(ctx, trainer, params, data, mark, t)
    tau = {m: evaluate(trainer, p, data.eval, data.eval_ids) for m, p in finals.items()}
    t = mark("evaluate", t)
    extra = extra_evaluations(ctx, trainer, finals, tau, data.eval, data.eval_ids)
    if extra:
        t = mark("evaluate_extra", t)  # sampled τ, τ by position
    d_graph = trainer.d_graph
    fmt = prompt_format(cfg.data)
    exports = {
        m: export_drafter(d_graph, p, ctx.path("export", m), prompt_format=fmt)
        for m, p in finals.items()
    }
    mark("export", t)
    return {
        "tau": tau,
        "extra_tau": extra,
        "collect_tau": collect_tau,
        "exports": exports,
        "final_metrics": {k: (v[-1] if v else {}) for k, v in trainer.histories.items()},
        "nonfinite_skipped": dict(trainer.skipped),
    }


def data_issues(ctx: Context, data: Datasets) -> dict:
    """What the run dropped or changed in its data, never silently: broken prompt-file lines
    skipped, prompts over `data.max_prompt_len` cut to it (their last tokens kept) or
    skipped (`data.long_prompts`), regenerated responses with nothing but an EOS."""
    encoded = {"train": data.train_ids, "eval": data.eval_ids}
    if data.stage2_ids is not None:
        encoded["stage2"] = data.stage2_ids
    return {
        "broken_lines_skipped": {path: list(lines) for path, lines in ctx.skipped_lines.items()},
        "prompts_truncated": {split: ids.truncated for split, ids in encoded.items()},
        "prompts_skipped": {split: ids.skipped for split, ids in encoded.items()},
        "empty_responses": {
            "train": data.train.meta.get("empty_responses"),
            "eval": data.eval.meta.get("empty_responses"),
        },
    }


def _report(ctx: Context, results, timings, wall_s, data: Datasets) -> dict:
    tau = results["tau"]
    extra = results["extra_tau"]
    if ctx.cfg.eval.head_calibration:
        extra = {**extra, "head_calibration": calibration.collected(ctx)}
    report = {
        "tau": tau,
        "summary": R.summarise(tau),
        **R.extra_summaries(extra),
        "wall_s": round(wall_s, 2),
        "stage_seconds": timings,
        "collect_tau": results["collect_tau"],
        "final_metrics": results["final_metrics"],
        "nonfinite_skipped": results["nonfinite_skipped"],
        "exports": results["exports"],
        "product": results["exports"].get("adaflash"),
        "run_dir": ctx.run_dir,
        "target": ctx.target_dir,
        "devices": jax.device_count(),
        "mesh": list(ctx.mesh_shape),
        "data_issues": data_issues(ctx, data),
        "train_sequences": len(data.train),
        "stage2_pool": len(data.pool) if data.pool is not None else 0,
        "eval_sequences": {
            d: int((data.eval.domain == i).sum()) for i, d in enumerate(data.eval.domains)
        },  # fmt: skip
        "config": dataclasses.asdict(ctx.cfg),
    }
    if ctx.is_main:
        R.write_json(ctx.path("report.json"), report)
        for method in results["exports"]:  # each export's README quotes its τ
            describe_run_export(
                ctx.path("export", method), ctx.drafter_cfg, run_dir=ctx.run_dir, method=method
            )
        R.plot_tau(ctx.path("tau.png"), tau, extra.get("tau_sampled"))
        print("\n" + R.table(tau), flush=True)
        print(R.extra_tables(extra), end="", flush=True)
        print(f"\nwall time {report['wall_s']:.1f}s; report: {ctx.path('report.json')}", flush=True)
    return report
