"""Continuous batching over a fixed number of slots: the host-side scheduler and public API.

The device runs `run_loop` (a `lax.while_loop` of jitted steps) until an active slot
finishes; the host then harvests finished slots, prefills the next queued requests into the
free ones (one jitted prefill per group, prompt lengths and row counts padded to small bucket
sets to bound compiles) and continues until the queue is empty and every slot is done.

    engine = SpeculativeEngine(target, drafter, slots=4, capacity=512, policy="goodput")
    results = engine.generate([(prompt_ids, max_new_tokens), ...])   # list[Result]
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.decode import speculative as sp
from adaflash_jax.decode import step_cost
from adaflash_jax.decode.policies import FixedPolicy, PolicyError, make_policy
from adaflash_jax.decode.verify_cost import VerifyCostTable
from adaflash_jax.drafter.checkpoint import ACCEPT_FILE

DEFAULT_BUCKETS = (1, 2, 4, 8, 16)
NO_LIMIT = 2**30


class EngineError(ValueError):
    """A request or engine setting the models cannot serve (checked before any compute)."""


@dataclasses.dataclass(frozen=True)
class Result:
    output_ids: list[int]  # generated tokens, ending at (and including) an EOS if one came
    accepted: list[int]  # accepted drafts per verify step
    widths: list[int]  # batch verify width (bucket the target ran) per step
    requested_widths: list[int]  # the width the policy asked for this row per step; 0 marks
    # an undrafted (plain) step of a skip_draft policy
    steps: int  # verify steps (the first token comes from the prefill, not a step)
    tau: float  # mean tokens committed per verify step (accepted + 1); nan without steps
    finish_reason: str  # "eos" or "length"


NO_ACCEPT_OUTPUT = (
    "the policy reads per-position acceptance from the length head (estimator 'head'), but "
    "this drafter has no accept_probs output: its acceptance part "
    f"({ACCEPT_FILE}) is missing, e.g. after a transformers "
    "save_pretrained, or was never trained (draft.accept_dim = 0). Re-attach it with "
    "`python -m experiments.export RUN --out DIR` from the run's checkpoint"
)


def has_accept_output(drafter) -> bool:
    head = getattr(drafter, "length_head", None)
    return bool(getattr(head, "has_accept_output", False))


def _pow2_at_least(n: int, cap: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return min(p, cap)


class SpeculativeEngine:
    """Speculative (or, with `drafter=None`, plain) decoding over `slots` continuous-batching
    slots. One compiled step program per (slots, bucket set, policy, sampling mode)."""

    def __init__(
        self,
        target,
        drafter,
        *,
        slots: int,
        capacity: int,
        block_size: int | None = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        policy="fixed",
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_ids: Sequence[int] | None = None,
        cost_table: VerifyCostTable | str | None = None,
        acceptance: Callable | None = None,
        cache_dir: str | None = None,
        policy_kwargs: dict | None = None,
        pending_steps: int = sp.PENDING_STEPS,
    ):
        cfg = target.config
        if slots < 1:
            raise EngineError(f"slots must be >= 1, got {slots}")
        if pending_steps < 1:
            raise EngineError(f"pending_steps must be >= 1, got {pending_steps}")
        if capacity > cfg.max_position_embeddings:
            raise EngineError(
                f"cache capacity {capacity} exceeds the target's max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        if not temperature >= 0 or not 0 < top_p <= 1:
            raise EngineError(f"need temperature >= 0 and 0 < top_p <= 1: {temperature}, {top_p}")
        if drafter is not None:
            drafter.config.validate_against(cfg)
            if block_size is not None and block_size != drafter.config.block_size:
                if block_size < 2:
                    raise EngineError(f"block_size must be >= 2, got {block_size}")
                drafter = nnx.clone(drafter)
                drafter.config = dataclasses.replace(drafter.config, block_size=block_size)
            k = drafter.config.block_size
        else:
            k = 1
        self.target, self.drafter = target, drafter
        self.slots, self.capacity, self.block_size = slots, capacity, k
        self.buckets = sp.bucket_set(buckets, k)
        self.seed = seed
        # undrafted steps between batched drafter-context passes (skip_draft policies only)
        self.pending_steps = int(pending_steps)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.eos_ids = tuple(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids))
        self.acceptance = acceptance
        self._tdef, self._tstate = nnx.split(target)
        self._ddef, self._dstate = nnx.split(drafter) if drafter is not None else (None, None)
        self.last_run: dict = {}  # loop steps / device calls / probes of the latest `generate`
        # acceptance learnt by earlier `generate` calls (skip_draft policies; see init_state)
        self.adaptation: sp.Adaptation | None = None
        goodput_kwargs = None  # set when goodput's table is measured on this engine below
        if drafter is None:
            policy = FixedPolicy()  # plain decoding: width 1 = K, nothing to choose
        elif isinstance(policy, str):
            kwargs = dict(policy_kwargs or {})
            if isinstance(cost_table, (str, os.PathLike)):
                cost_table = VerifyCostTable.load(cost_table)
            if policy == "goodput" and cost_table is None:
                goodput_kwargs = kwargs
                # checks the options, buckets and head outputs before the calibration compute
                self._set_policy(make_policy(policy, cost=self._unit_table(), **kwargs))
                policy = FixedPolicy()  # until the calibrated table exists
            else:
                policy = make_policy(policy, cost=cost_table, **kwargs)
        self._set_policy(policy)
        if goodput_kwargs is not None:
            table = step_cost.load_or_calibrate_engine(
                self, estimator=goodput_kwargs.get("estimator", "confidence"), cache_dir=cache_dir
            )
            self._set_policy(make_policy("goodput", cost=table, **goodput_kwargs))

    def _unit_table(self) -> VerifyCostTable:
        n = len(self.buckets)
        return VerifyCostTable(
            rows=(self.slots,), widths=self.buckets, verify_ms=((1.0,) * n,), draft_ms=(0.0,)
        )

    def _set_policy(self, policy) -> None:
        """Validates `policy` for this engine and builds the static spec around it."""
        drafter = self.drafter
        has_head = drafter is not None and getattr(drafter, "length_head", None) is not None
        if drafter is not None:
            try:
                policy.validate(buckets=self.buckets, slots=self.slots, has_length_head=has_head)
            except PolicyError as e:
                raise EngineError(str(e)) from None
        self.policy = policy
        self.spec = sp.EngineSpec(
            block_size=self.block_size,
            buckets=self.buckets,
            greedy=self.temperature == 0.0,
            nucleus=self.top_p < 1.0,
            feature_layers=tuple(drafter.config.target_layer_ids) if drafter is not None else (),
            policy=policy,
            acceptance=self.acceptance,
            use_length_head=drafter is not None and policy.needs_length_head,
            use_accept_head=drafter is not None and getattr(policy, "needs_accept_head", False),
        )
        if self.spec.use_accept_head and not has_accept_output(drafter):
            raise EngineError(NO_ACCEPT_OUTPUT)
        self._undrafted_spec = dataclasses.replace(self.spec, undrafted_mode=True)
        self._drafting = not self.spec.skip_draft

    # ---- validation -----------------------------------------------------------------------
    def check_request(self, i: int, prompt: Sequence[int], max_new: int) -> None:
        v = self.target.config.vocab_size
        if len(prompt) == 0:
            raise EngineError(f"request {i}: empty prompt")
        bad = [int(t) for t in prompt if not 0 <= int(t) < v]
        if bad:
            raise EngineError(f"request {i}: token ids outside the vocabulary [0, {v}): {bad[:5]}")
        if max_new < 1:
            raise EngineError(f"request {i}: max_new_tokens must be >= 1, got {max_new}")
        need = len(prompt) + max_new + self.block_size
        if need > self.capacity:
            raise EngineError(
                f"request {i}: prompt {len(prompt)} + max_new {max_new} + block {self.block_size}"
                f" = {need} exceeds the cache capacity {self.capacity}"
            )

    # ---- device calls ---------------------------------------------------------------------
    def init_state(self, seed: int) -> sp.SpecState:
        """A fresh state; a skip_draft engine starts it from what earlier `generate` calls
        learnt (`adaptation`)."""
        return sp.init_state(
            self.target,
            self.drafter,
            slots=self.slots,
            capacity=self.capacity,
            eos_ids=self.eos_ids,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=seed,
            pending=self.pending_steps if self.spec.skip_draft else 0,
            adaptation=self.adaptation if self.spec.skip_draft else None,
        )

    def reset_adaptation(self) -> None:
        """Forgets what earlier `generate` calls learnt: the next starts with a probe."""
        self.adaptation = None

    def _models(self):
        return self._tdef, self._tstate, self._ddef, self._dstate

    def _prefill(self, state, assignments):
        """assignments: list of (slot, prompt, max_new) started in one padded call."""
        rows = _pow2_at_least(len(assignments), self.slots)
        p = _pow2_at_least(max(len(a[1]) for a in assignments), self.capacity)
        p = max(p, min(16, self.capacity))
        slots_R = np.full((rows,), self.slots, np.int32)  # padding rows → dropped
        prompt_RxP = np.zeros((rows, p), np.int32)
        len_R = np.ones((rows,), np.int32)
        max_new_R = np.ones((rows,), np.int32)
        for j, (slot, prompt, max_new) in enumerate(assignments):
            slots_R[j], len_R[j], max_new_R[j] = slot, len(prompt), max_new
            prompt_RxP[j, : len(prompt)] = prompt
        return sp.prefill_slots(
            *self._models(),
            state,
            jnp.asarray(slots_R),
            jnp.asarray(prompt_RxP),
            jnp.asarray(len_R),
            jnp.asarray(max_new_R),
            spec=self.spec,
        )

    def run(self, state, *, stop_on_finish: bool, max_steps: int = NO_LIMIT):
        """Device loops until no slot is active, `max_steps` ran or (if `stop_on_finish`) a
        slot finished. A skip_draft policy's drafted and undrafted steps are two programs:
        when a loop exits because the policy wants the other kind, the other one continues.
        Returns (state, steps run, device loops called, host copy of done_B)."""
        total, calls = 0, 0
        while True:
            spec = self._undrafted_spec if not self._drafting else self.spec
            state, steps, finished, wants = sp.run_loop(
                *self._models(),
                state,
                jnp.asarray(stop_on_finish),
                jnp.asarray(max_steps - total, jnp.int32),
                spec=spec,
            )
            steps, finished, wants, done_B = jax.device_get((steps, finished, wants, state.done_B))
            total, calls = total + int(steps), calls + 1
            switch = bool(wants) != self._drafting
            stopped = (stop_on_finish and finished > 0) or bool(np.all(done_B))
            if not switch or stopped or total >= max_steps:
                return state, total, calls, done_B
            self._drafting = bool(wants)

    # ---- host scheduler -------------------------------------------------------------------
    def generate(self, requests: Sequence[tuple[Sequence[int], int]], *, seed=None) -> list:
        """Decodes every (prompt_ids, max_new_tokens) request; results in request order."""
        requests = [(list(map(int, p)), int(m)) for p, m in requests]
        for i, (prompt, max_new) in enumerate(requests):
            self.check_request(i, prompt, max_new)
        state = self.init_state(self.seed if seed is None else seed)
        # a skip_draft policy starts in the undrafted program, which probes first (one drafter
        # forward) when nothing is learnt yet: a run drafts only where the estimates say so
        self._drafting = not self.spec.skip_draft
        queue = collections.deque(range(len(requests)))
        free = list(range(self.slots))
        owner: dict[int, int] = {}  # slot → request index
        results: list[Result | None] = [None] * len(requests)
        loop_steps, calls = 0, 0
        while queue or owner:
            starts = []
            while queue and free:
                slot, i = free.pop(0), queue.popleft()
                owner[slot] = i
                starts.append((slot, *requests[i]))
            if starts:
                state = self._prefill(state, starts)
            state, steps, n_calls, done_B = self.run(state, stop_on_finish=bool(queue))
            loop_steps, calls = loop_steps + steps, calls + n_calls
            finished = [slot for slot in owner if done_B[slot]]
            if finished:
                self._harvest(state, finished, owner, results)
                free.extend(finished)
                free.sort()
        if self.spec.skip_draft:
            # a serving engine keeps adapting across calls: the next starts from this prior
            self.adaptation = sp.Adaptation.of(state) or self.adaptation
        self.last_run = {
            "loop_steps": loop_steps,
            "device_loops": calls,
            "probes": int(jax.device_get(state.probes)),  # estimate-only drafter forwards
        }
        return results

    def _harvest(self, state, slots, owner, results):
        out, n_out, acc, width, req, steps = jax.device_get(
            (
                state.out_BxC,
                state.num_out_B,
                state.accepted_BxC,
                state.width_BxC,
                state.request_BxC,
                state.steps_B,
            )
        )
        eos = set(self.eos_ids)
        for slot in slots:
            i = owner.pop(slot)
            ids = out[slot, : n_out[slot]].tolist()
            n = int(steps[slot])
            results[i] = Result(
                output_ids=ids,
                accepted=acc[slot, :n].tolist(),
                widths=width[slot, :n].tolist(),
                requested_widths=req[slot, :n].tolist(),
                steps=n,
                tau=float(np.mean(acc[slot, :n]) + 1.0) if n else math.nan,
                finish_reason="eos" if ids and ids[-1] in eos else "length",
            )
