"""Stage runners: stage 1, head init, and the stage-2 collect ⇄ train rounds.

Stage 2 follows the reference loop (docs/design.md §4.2): round r takes `prompts_per_round` prompts
of the stage-2 pool that no earlier round used (the pool is disjoint from stage 1's prompts
unless `stage2.pool = "stage1"`), collects them with the CURRENT drafter, trains on that
buffer with anchors drawn uniformly over each response, and drops it. The accepted lengths
seen while collecting are logged (the round's τ), never used to pick training positions
(except in the opt-in "visited" anchors ablation).

Every stage trains from given drafter params with its own optimizer and checkpoint
directory (`<run>/ckpt/<stage>`); restarting a stage resumes from its latest checkpoint
(data position and stage-2 round included), and a finished stage restores instantly. The
frozen target travels inside each stage's state and is donated with it, so `Trainer.frozen`
is refreshed from the returned state after every run.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from adaflash_jax.distill import calibration, collect, steps
from adaflash_jax.distill.batches import SequenceData, batch_iterator
from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.context import Context
from adaflash_jax.distill.loop import StageRun, restore_or_start, run_stage
from adaflash_jax.distill.regenerate import build_sequences
from adaflash_jax.distill.schedule import stage2_name
from adaflash_jax.distill.stage_config import STAGE2_OBJECTIVE
from adaflash_jax.distill.state import new_train_state
from adaflash_jax.sharding.rows import RowLayout
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.checkpointing import Checkpointer
from adaflash_jax.train.optimizer import OptimizerConfig, skip_counts

# (step kind, optimizer, mesh, models, batch) → (tx, schedules, jitted step), process-wide,
# so a second run in the same process (tests, resumes) does not compile again.
_COMPILED: dict[tuple, tuple] = {}
REPLAY_BATCH = 16  # fixed, so collection and evaluation share one replay program


@dataclasses.dataclass(frozen=True)
class Stage2Pool:
    """The prompts stage-2 rounds draw from; `sequences` holds the target's greedy responses
    (the replay collector's input), absent for the engine collector, which decodes itself."""

    prompt_ids: list[list[int]]
    domain: np.ndarray  # [M] int32 index into `domains`
    domains: tuple[str, ...]
    sequences: SequenceData | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @classmethod
    def of(cls, data: SequenceData, prompt_ids) -> Stage2Pool:
        return cls(list(prompt_ids), data.domain, data.domains, data)


def _adamw(lr: float, spec, **kw) -> OptimizerConfig:
    """A constant-lr AdamW group of a stage spec with `weight_decay`, `b2`, `decay_all`."""
    return OptimizerConfig(
        lr=lr,
        schedule="constant",
        weight_decay=spec.weight_decay,
        b2=spec.b2,
        decay_all=spec.decay_all,
        clip_norm=None,
        **kw,
    )


def stage_optimizer(cfg: RunConfig, kind: str, total: int | None = None):
    """(per-group optimizer configs, global clip norm of the draft model) of a stage: what
    `steps.make_optimizer` takes. A group left out is frozen (stage 1 trains the drafter, head
    init the length head and acceptance net, stage 2 all three). `total` overrides stage 1's
    step count (the `stage1_long` baseline). Public so tools that compile a run's steps
    (`adaflash_jax.aot`) build the same optimizer as the trainer."""
    if kind == "stage1":
        s1 = cfg.stage1
        total = s1.steps if total is None else total
        opt = OptimizerConfig(
            lr=s1.lr,
            schedule="cosine",
            total_steps=max(total, 1),
            warmup_steps=int(s1.warmup_fraction * total),
            final_lr_fraction=s1.final_lr_fraction,
            weight_decay=s1.weight_decay,
            clip_norm=None,
        )
        return {"drafter": opt}, s1.clip_norm
    if kind == "head_init":
        opt = _adamw(cfg.head_init.lr, cfg.head_init)
        return {"head": opt, "accept": opt}, cfg.head_init.clip_norm
    if kind != "stage2":
        raise ValueError(f"unknown stage {kind!r}; choose from {steps.KINDS}")
    s2 = cfg.stage2
    head = _adamw(s2.head_lr, s2)
    return {"drafter": _adamw(s2.lr, s2), "head": head, "accept": head}, s2.clip_norm


def step_spec(
    cfg: RunConfig, drafter_cfg, kind: str, divergence: str = "rkl", mesh=None
) -> steps.StepSpec:
    """The `StepSpec` a run trains `kind` with (the loss and attention knobs come from `cfg`;
    on a `mesh` the batch's rows stay split over its batch axes inside the models)."""
    return steps.StepSpec(
        kind=kind,
        block_size=drafter_cfg.block_size,
        gamma=drafter_cfg.loss_gamma,
        feature_layers=drafter_cfg.target_layer_ids,
        divergence=divergence,
        loss_chunk=cfg.loss_chunk,
        attention=cfg.train_attention,
        attention_chunk=cfg.attention_chunk,
        rows=RowLayout.of(mesh, TRAIN_RULES, cfg.batch_size),
    )


def head_phases(cfg: RunConfig, r: int, buffer: int) -> list[tuple[int, float]]:
    """Stage-2 round r's steps as (last step, whether the length head learns): with
    `stage2.head_fit="fresh"` the head learns during the first pass over the round's `buffer`
    sequences only (whole batches of sequences the drafter has not trained on yet)."""
    s2 = cfg.stage2
    start, end = r * s2.steps_per_round, (r + 1) * s2.steps_per_round
    if s2.head_fit == "all":
        return [(end, 1.0)]
    fresh = min(max(1, buffer // cfg.batch_size), s2.steps_per_round)
    return [(start + fresh, 1.0), (end, 0.0)]


class Trainer:
    def __init__(self, ctx: Context, mesh, target_split, drafter_graphdef, *, writer, guard):
        self.ctx, self.cfg, self.mesh = ctx, ctx.cfg, mesh
        self.t_graph, self.frozen = target_split
        self.d_graph = drafter_graphdef
        self.writer, self.guard = writer, guard
        self.bsh = steps.batch_shardings(mesh, TRAIN_RULES, self.cfg.batch_size)
        self.histories: dict[str, list[dict]] = {}
        self.skipped: dict[str, int] = {}  # stage → non-finite steps skipped

    # ---- plumbing --------------------------------------------------------------------------
    @property
    def target_split(self):
        return self.t_graph, self.frozen

    def _spec(self, kind: str, divergence: str = "rkl") -> steps.StepSpec:
        return step_spec(self.cfg, self.ctx.drafter_cfg, kind, divergence, self.mesh)

    def _checkpointer(self, name: str) -> Checkpointer:
        c = self.cfg.checkpoint
        return Checkpointer(
            self.ctx.path("ckpt", name), save_every=c.every, keep=c.keep, async_save=c.async_save
        )

    def _iterator(
        self, data: SequenceData, seed: int, anchor_rule: str = "response", num_anchors=None
    ):
        return batch_iterator(
            data,
            global_batch=self.cfg.batch_size,
            num_anchors=num_anchors or self.cfg.num_anchors,
            block_size=self.ctx.drafter_cfg.block_size,
            seed=seed,
            anchor_rule=anchor_rule,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    def _begin(self, name, kind, params, groups, clip, divergence="rkl"):
        # Stages with the same step and optimizer (the stage-2 methods that differ only in
        # their runtime loss knobs) reuse one jitted step: one compilation.
        key = (kind, divergence, clip, tuple(sorted((k, repr(v)) for k, v in groups.items())))
        key += (self.mesh, self.d_graph, self.t_graph, self.cfg.batch_size, self.cfg.loss_chunk)
        key += (self.cfg.train_attention, self.cfg.attention_chunk)
        if key not in _COMPILED:
            tx, schedules = steps.make_optimizer(groups, clip_norm=clip)
            _COMPILED[key] = (tx, schedules, None)
        tx, schedules, fn = _COMPILED[key]
        state, shardings = new_train_state(
            params, self.frozen, tx, mesh=self.mesh, rules=TRAIN_RULES, seed=self.cfg.seed
        )
        ckpt = self._checkpointer(name)
        state, extra = restore_or_start(ckpt, state, shardings)
        if fn is None:
            spec = self._spec(kind, divergence)
            fn = steps.jit_step(
                steps.make_step(spec, self.d_graph, self.t_graph, tx, schedules),
                state_shardings=shardings,
                batch_shardings_=self.bsh,
            )
            _COMPILED[key] = (tx, schedules, fn)
        return state, extra, ckpt, fn

    def _run(self, name, fn, state, it, total, ckpt, extra=None, knobs=None):
        run = StageRun(
            name=name,
            step_fn=fn,
            put=lambda b: steps.put_batch(b, self.bsh, knobs),
            batches=it,
            total_steps=total,
            tokens_per_step=self.cfg.batch_size * self.cfg.seq_len,
            log_every=self.cfg.log_every,
            writer=self.writer,
            progress=self.ctx.progress,
            max_skips=self.cfg.max_nonfinite_steps,
        )
        try:
            state, hist = run_stage(run, state, ckpt=ckpt, guard=self.guard, extra=extra)
        finally:
            self.frozen = state.frozen
        self.histories.setdefault(name, []).extend(hist)
        self.skipped[name] = int(jax.device_get(skip_counts(state.opt_state)[1]))
        return state

    def _fixed_data_stage(self, name, kind, params, groups, total, it_args, clip):
        if total == 0:
            return params
        state, _, ckpt, fn = self._begin(name, kind, params, groups, clip)
        it = self._iterator(*it_args)
        if ckpt.restored_step is not None:
            ckpt.restore_data(it)
        with ckpt:
            state = self._run(name, fn, state, it, total, ckpt)
        return state.params

    # ---- stages ----------------------------------------------------------------------------
    def stage1(self, params, data: SequenceData, *, name: str = "stage1", total=None):
        """Decayed CE on the regenerated data; `total` steps (default stage1.steps) over one
        warm-up + cosine schedule (`stage1_long` runs it for `schedule.stage1_long_steps`)."""
        total = self.cfg.stage1.steps if total is None else total
        groups, clip = stage_optimizer(self.cfg, "stage1", total)
        it_args = (data, self.cfg.seed)
        return self._fixed_data_stage(name, "stage1", params, groups, total, it_args, clip)

    def head_init(self, params, data: SequenceData, *, name: str = "head_init"):
        """The length head (and its optional acceptance network) fitted with the drafter
        frozen, on `head_init.num_anchors` blocks per sequence drawn by `head_init.anchors`."""
        h = self.cfg.head_init
        groups, clip = stage_optimizer(self.cfg, "head_init")
        it_args = (data, self.cfg.seed, h.anchors, h.num_anchors)
        return self._fixed_data_stage(name, "head_init", params, groups, h.steps, it_args, clip)

    def stage2(self, method: str, params, pool: Stage2Pool, *, calibrate=None, points=()):
        """`rounds` × (collect new prompts with the current drafter → train
        `steps_per_round`); with a `calibrate` (`calibration.Calibration`), round r's drafter
        is measured at `points[r]` (the schedule's points)."""
        s2 = self.cfg.stage2
        total = s2.rounds * s2.steps_per_round
        if total == 0:
            return params, []
        name = stage2_name(method)
        groups, clip = stage_optimizer(self.cfg, "stage2")
        divergence, alpha = STAGE2_OBJECTIVE[method]
        knobs = {
            "alpha": s2.alpha if alpha is None else alpha,
            "tau": s2.tau,
            "temperature": s2.temperature,
        }
        state, extra, ckpt, fn = self._begin(name, "stage2", params, groups, clip, divergence)
        taus = []
        with ckpt:
            for r in range(s2.rounds):
                end = (r + 1) * s2.steps_per_round
                if int(jax.device_get(state.step)) >= end:
                    continue
                data = self.collected(method, r, state.params, pool)
                taus.append(data.meta["tau"])
                if self.writer is not None:
                    tau = data.meta["tau"]
                    scalars = {f"{name}/collect_tau_{d}": v for d, v in tau.items()}
                    scalars[f"{name}/collect_tau"] = float(np.nanmean(list(tau.values())))
                    self.writer.write(r * s2.steps_per_round, scalars)
                it = self._iterator(data, self.cfg.seed + 1000 * (r + 1), s2.anchors)
                if extra.get("round") == r:  # resumed mid-round: the round's data position
                    ckpt.restore_data(it)
                for stop, head_on in head_phases(self.cfg, r, len(data)):
                    if int(jax.device_get(state.step)) < stop:
                        phase = {**knobs, "head_on": head_on}
                        state = self._run(name, fn, state, it, stop, ckpt, {"round": r}, phase)
                if calibrate is not None:
                    calibration.measure(calibrate, state.params, points[r])
        return state.params, taus

    # ---- on-policy data --------------------------------------------------------------------
    def round_rows(self, pool_size: int, r: int) -> np.ndarray:
        """Round r's rows of the pool: consecutive slices of one seeded permutation, so rounds
        never share a prompt until the pool is exhausted (then it wraps)."""
        n = self.cfg.stage2.prompts_per_round
        perm = np.random.default_rng([self.cfg.seed, 7]).permutation(pool_size)
        return perm[(r * n + np.arange(n)) % pool_size]

    def collected(self, method, r, params, pool: Stage2Pool) -> SequenceData:
        """Round r's on-policy trajectories (saved, so a resumed round reuses them)."""
        path = self.ctx.path("stage2", method, f"round{r}")
        if SequenceData.exists(path):
            return SequenceData.load(path)
        rows = self.round_rows(len(pool), r)
        if self.cfg.stage2.collector == "replay":
            sub = pool.sequences.subset(rows)
            trajs = self.replay(params, sub, f"collect {method} round {r}")
        else:
            prompts = [pool.prompt_ids[i] for i in rows]
            # a sampled collection draws round r's text from its own stream (seed, r)
            seed = self.cfg.seed + 1000 * (r + 1)
            sub, trajs = self.engine_rollouts(
                params, prompts, pool.domain[rows], pool.domains, seed=seed
            )
        data = collect.with_visited(sub, trajs)
        data = dataclasses.replace(data, meta={**data.meta, "round": r})
        if jax.process_index() == 0:
            data.save(path)
        return data

    def replay(self, params, data: SequenceData, desc: str, *, head: bool = False):
        """Greedy replay of the drafter `params` over `data`'s responses (one compiled
        program for collection, evaluation and calibration: a fixed `REPLAY_BATCH`)."""
        dc = self.ctx.drafter_cfg
        return collect.replay(
            (self.d_graph, params),
            self.target_split,
            data,
            block_size=dc.block_size,
            feature_layers=dc.target_layer_ids,
            span=self.cfg.data.max_new_tokens,
            batch_size=REPLAY_BATCH,
            desc=desc,
            progress=self.ctx.progress,
            head=head,
        )

    def engine_rollouts(self, params, prompt_ids, domain_ids, domains, temperature=None,
                        slots=None, seed=None):  # fmt: skip
        from flax import nnx

        s2 = self.cfg.stage2
        target = nnx.merge(self.t_graph, self.frozen)
        drafter = nnx.merge(self.d_graph, params)
        temp = s2.collect_temperature if temperature is None else temperature
        slots = slots or s2.collect_slots
        responses, trajs = collect.engine_collect(
            target,
            drafter,
            prompt_ids,
            max_new_tokens=self.cfg.data.max_new_tokens,
            slots=slots,
            temperature=temp,
            seed=self.cfg.seed if seed is None else seed,
            eos_ids=self.ctx.eos_ids,
            rows=RowLayout.of(self.mesh, TRAIN_RULES, slots),  # slots split over chips
        )
        sub = build_sequences(
            prompt_ids,
            responses,
            domain_ids,
            seq_len=self.cfg.seq_len,
            pad_id=self.ctx.pad_id,
            domains=domains,
        )
        return sub, trajs


def evaluate(trainer: Trainer, params, data: SequenceData, prompt_ids) -> dict[str, float]:
    """τ per domain of a drafter on the held-out set (greedy)."""
    cfg = trainer.cfg
    if cfg.eval.backend == "replay":
        return collect.tau_by_domain(data, trainer.replay(params, data, "evaluate"))
    sub, trajs = trainer.engine_rollouts(
        params, prompt_ids, data.domain, data.domains, temperature=0.0, slots=cfg.eval.slots
    )
    return collect.tau_by_domain(sub, trajs)
