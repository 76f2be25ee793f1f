"""Continuous batching over a fixed number of slots: the host-side scheduler and public API.

The device runs a loop program of jitted steps (`programs.run_loop`) until an active slot
finishes; the host then harvests finished slots, prefills the next queued requests into the
free ones (one jitted prefill per group, prompt lengths and row counts padded to powers of
two to bound compiles) and continues until the queue is empty and every slot is done. A
policy that may skip drafting (goodput) says which of the engine's two loop programs runs
next (`loops.py`).

    engine = SpeculativeEngine(target, drafter, slots=4, capacity=512, policy=AdaFlashPolicy())
    results = engine.generate([(prompt_ids, max_new_tokens), ...])   # list[Result]
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.decode import programs
from adaflash_jax.decode.drafting import EngineDrafter
from adaflash_jax.decode.loops import DRAFTED, UNDRAFTED
from adaflash_jax.decode.policy import FixedPolicy, LengthPolicy, PolicyError, Slots
from adaflash_jax.decode.state import EngineSpec, SpecState, Undrafted, bucket_set
from adaflash_jax.decode.tree import TreeShape
from adaflash_jax.drafter.hf_config import ACCEPT_FILE
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rows import RowLayout, fetch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16)
# packed verify's token buckets: B × these mean tokens per row, below the widest bucket
DEFAULT_ROW_FILLS = (1, 2, 3, 4, 6, 8, 12)
VERIFY_LAYOUTS = ("padded", "packed")
NO_LIMIT = 2**30


class EngineError(ValueError):
    """A request or engine setting the models cannot serve (checked before any compute)."""


@dataclasses.dataclass(frozen=True)
class Result:
    output_ids: list[int]  # generated tokens, ending at (and including) an EOS if one came
    accepted: list[int]  # accepted drafts per verify step
    widths: list[int]  # verify width per step: the batch's bucket (padded), its own (packed)
    requested_widths: list[int]  # the policy's width for this row per step (0: undrafted)
    steps: int  # verify steps (the first token comes from the prefill, not a step)
    tau: float  # mean tokens committed per verify step (accepted + 1); nan without steps
    finish_reason: str  # "eos" or "length"


NO_ACCEPT_OUTPUT = (
    "the policy (estimator 'head') or the tree (surrogate 'head') reads per-position acceptance "
    "from the length head, but this "
    f"drafter has no accept_probs output: its acceptance part ({ACCEPT_FILE}) is missing, e.g. "
    "after a transformers save_pretrained, or was never trained (draft.accept_dim = 0). "
    "Re-attach it with `python -m experiments.export RUN --out DIR` from the run's checkpoint"
)


def has_accept_output(drafter) -> bool:
    return drafter.length_head is not None and drafter.length_head.has_accept_output


def check_tree(tree: TreeShape, drafter, verify: str, acceptance) -> None:
    """Refuses, by name, what a tree engine cannot honour."""
    if drafter is None:
        raise EngineError("a draft tree needs a drafter")
    if verify != "packed":
        raise EngineError(f"draft trees verify packed (verify='packed'), not {verify!r}")
    if acceptance is not None:
        raise EngineError(
            "draft trees accept by their walk; a token-wise acceptance rule is for chains"
        )


def _pow2_at_least(n: int, cap: int) -> int:  # n >= 1
    return min(1 << (n - 1).bit_length(), cap)


def token_bucket_set(slots: int, buckets: Sequence[int], fills=DEFAULT_ROW_FILLS):
    """Packed verify's token buckets: `slots` × each mean fill below the widest bucket, and
    `slots` × the widest (every row at full width) last."""
    widest = max(buckets)
    return tuple(sorted({slots * int(f) for f in fills if 1 <= f < widest} | {slots * widest}))


class SpeculativeEngine:
    """Speculative (or, with `drafter=None`, plain) decoding over `slots` continuous-batching
    slots. One compiled loop program per (slots, bucket set, policy, sampling mode). With
    `rows` the slots' state is split over those mesh axes (`sharding.rows`). `verify`
    (default: packed for a tree, else padded): "padded" runs every row at the bucket of the
    widest request, "packed" only each row's own tokens, padded to a token bucket
    (`token_buckets`, default `token_bucket_set`).
    `pending_steps`: the undrafted steps whose drafter-context entries one batched pass
    commits (`undrafted.py`; only a policy that may skip drafting runs them). `tree`: each
    row verifies a draft tree of that shape instead of a chain (`tree.py`; packed verify,
    a policy that serves trees: fixed or tree-batch)."""

    def __init__(
        self,
        target: TargetLM,
        drafter: EngineDrafter | None,
        *,
        slots: int,
        capacity: int,
        block_size: int | None = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        policy: LengthPolicy | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_ids: Sequence[int] | None = None,
        acceptance: Callable | None = None,
        rows: RowLayout | None = None,
        verify: str | None = None,
        token_buckets: Sequence[int] | None = None,
        pending_steps: int = 32,
        tree: TreeShape | None = None,
    ):
        cfg = target.config
        verify = verify or ("packed" if tree is not None else "padded")
        if verify not in VERIFY_LAYOUTS:
            raise EngineError(f"verify must be one of {VERIFY_LAYOUTS}, got {verify!r}")
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
        if tree is not None:
            check_tree(tree, drafter, verify, acceptance)
        if drafter is None or policy is None:
            policy = FixedPolicy()  # plain decoding: width 1 = K, nothing to choose
        if drafter is not None:
            drafter.config.validate_against(cfg)
            if block_size is not None and block_size != drafter.config.block_size:
                if block_size < 2:
                    raise EngineError(f"block_size must be >= 2, got {block_size}")
                drafter = nnx.clone(drafter)
                drafter.config = dataclasses.replace(drafter.config, block_size=block_size)
        k = 1 if drafter is None else drafter.config.block_size
        self.target, self.drafter, self.policy = target, drafter, policy
        self.slots, self.capacity, self.block_size = slots, capacity, k
        self.buckets = bucket_set(buckets, k)
        self.token_buckets = ()
        if verify == "packed" and drafter is not None:
            widest = self.buckets if tree is None else (tree.row_width,)  # a row's most tokens
            self.token_buckets = tuple(
                sorted(set(map(int, token_buckets or token_bucket_set(slots, widest))))
            )
            if self.token_buckets[0] < 1 or self.token_buckets[-1] < slots * max(widest):
                raise EngineError(
                    f"token buckets {self.token_buckets} must be >= 1 and reach slots × a "
                    f"row's most tokens = {slots * max(widest)}"
                )
        self.seed = seed
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.eos_ids = tuple(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids))
        if drafter is not None:
            try:
                policy.validate(
                    buckets=self.buckets,
                    has_length_head=drafter.length_head is not None,
                    fills=tuple(p / slots for p in self.token_buckets),
                    tree=tree,
                )
            except PolicyError as e:
                raise EngineError(str(e)) from None
            head_surrogate = tree is not None and tree.surrogate == "head"
            if (policy.needs_accept_head or head_surrogate) and not has_accept_output(drafter):
                raise EngineError(NO_ACCEPT_OUTPUT)
        self.spec = EngineSpec(
            block_size=k,
            buckets=self.buckets,
            token_buckets=self.token_buckets,
            greedy=self.temperature == 0.0,
            nucleus=self.top_p < 1.0,
            feature_layers=() if drafter is None else tuple(drafter.config.target_layer_ids),
            policy=policy,
            acceptance=acceptance,
            rows=rows,
            pending=pending_steps if drafter is not None and policy.may_skip else 0,
            tree=tree,
        )
        # what the policy sizes its state by
        self.policy_slots = Slots(
            count=slots, block_size=k, tree_nodes=None if tree is None else tree.nodes
        )
        self.first_program = UNDRAFTED if drafter is not None and policy.may_skip else DRAFTED
        # (graphdef, state) per model: the form the jitted programs take them in
        self.models = (nnx.split(target), None if drafter is None else nnx.split(drafter))
        # the policy state the latest `generate` ended with (None: none, or a stateless policy)
        self.learnt = None
        self.last_run: dict = {}  # loop steps and probes of the latest `generate`
        self._program = self.first_program  # the loop program `run` continues with

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
        # the last step starts at most at position prompt + max_new − 2 and writes K entries
        need = len(prompt) + max_new + self.block_size - 1
        if need > self.capacity:
            raise EngineError(
                f"request {i}: prompt {len(prompt)} + max_new {max_new} + block {self.block_size}"
                f" − 1 = {need} exceeds the cache capacity {self.capacity}"
            )

    # ---- device calls ---------------------------------------------------------------------
    def init_state(self, seed: int) -> SpecState:
        """All slots free (done); buffers are `capacity` long (a request never outgrows it).
        The policy's state starts from what the latest `generate` ended with (`learnt`)."""
        b, cap, drafter = self.slots, self.capacity, self.drafter

        def blank_BxS():  # one buffer per field: the state is donated, and a buffer may not be
            return jnp.full((b, cap), -1, jnp.int32)  # donated twice in one call

        state = SpecState(
            target_cache=self.target.init_cache(b, cap),
            context_cache=None if drafter is None else drafter.init_context_cache(b, cap),
            bonus_B=jnp.zeros((b,), jnp.int32),
            out_BxS=blank_BxS(),
            num_out_B=jnp.zeros((b,), jnp.int32),
            max_new_B=jnp.zeros((b,), jnp.int32),
            done_B=jnp.ones((b,), bool),
            started_B=jnp.zeros((b,), bool),
            eos_E=jnp.asarray(self.eos_ids or (-1,), jnp.int32),
            steps_B=jnp.zeros((b,), jnp.int32),
            accepted_BxS=blank_BxS(),
            width_BxS=blank_BxS(),
            request_BxS=blank_BxS(),
            probes=jnp.zeros((), jnp.int32),
            verified=jnp.zeros((), jnp.int32),
            computed=jnp.zeros((), jnp.int32),
            undrafted=Undrafted.create(
                batch=b,
                block_size=self.block_size,
                nodes=self.policy_slots.nodes if self.spec.pending else 0,  # probes: skip arm
                pending=self.spec.pending,
                feature_dim=len(self.spec.feature_layers) * self.target.config.hidden_size,
                dtype=self.target.dtype,
            ),
            policy_state=self.policy.init(self.policy_slots, self.learnt),
            temperature=jnp.asarray(self.temperature, jnp.float32),
            top_p=jnp.asarray(self.top_p, jnp.float32),
            rng=jax.random.key(seed),
        )
        return state if self.spec.rows is None else self.spec.rows.place(state, b)

    def prefill(self, state, assignments):
        """assignments: list of (slot, prompt, max_new) started in one padded call."""
        rows = _pow2_at_least(len(assignments), self.slots)
        q = _pow2_at_least(max(len(a[1]) for a in assignments), self.capacity)
        q = max(q, min(16, self.capacity))
        slots_I = np.full((rows,), self.slots, np.int32)  # padding rows → dropped
        prompt_IxQ = np.zeros((rows, q), np.int32)
        len_I = np.ones((rows,), np.int32)
        max_new_I = np.ones((rows,), np.int32)
        for j, (slot, prompt, max_new) in enumerate(assignments):
            slots_I[j], len_I[j], max_new_I[j] = slot, len(prompt), max_new
            prompt_IxQ[j, : len(prompt)] = prompt
        arrays = (slots_I, prompt_IxQ, len_I, max_new_I)
        return programs.prefill_slots(
            *self.models, state, *map(jnp.asarray, arrays), spec=self.spec.prefill_spec
        )

    def run(self, state, *, stop_on_finish: bool, max_steps: int = NO_LIMIT):
        """Device loops until no slot is active, `max_steps` ran or (if `stop_on_finish`) a
        slot finished; when a loop exits because the policy wants another of its programs,
        that one continues. Returns (state, steps run, device loops called, host done_B)."""
        total, calls = 0, 0
        while True:
            state, steps, finished, nxt = programs.run_loop(
                *self.models,
                state,
                jnp.asarray(stop_on_finish),
                jnp.asarray(max_steps - total, jnp.int32),
                spec=self.spec,
                program=self._program,
            )
            steps, finished, nxt, done_B = fetch((steps, finished, nxt, state.done_B))
            total, calls = total + int(steps), calls + 1
            stopped = (stop_on_finish and finished > 0) or bool(np.all(done_B))
            if int(nxt) == self._program or stopped or total >= max_steps:
                return state, total, calls, done_B
            self._program = int(nxt)

    # ---- host scheduler -------------------------------------------------------------------
    def generate(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[Result]:
        """Decodes every (prompt_ids, max_new_tokens) request; results in request order."""
        requests = [(list(map(int, p)), int(m)) for p, m in requests]
        for i, (prompt, max_new) in enumerate(requests):
            self.check_request(i, prompt, max_new)
        state = self.init_state(self.seed)
        self._program = self.first_program
        queue = collections.deque(range(len(requests)))
        free = list(range(self.slots))
        owner: dict[int, int] = {}  # slot → request index
        results: list[Result | None] = [None] * len(requests)
        loop_steps = 0
        while queue or owner:
            starts = []
            while queue and free:
                slot, i = free.pop(0), queue.popleft()
                owner[slot] = i
                starts.append((slot, *requests[i]))
            if starts:
                state = self.prefill(state, starts)
            state, steps, _, done_B = self.run(state, stop_on_finish=bool(queue))
            loop_steps += steps
            finished = [slot for slot in owner if done_B[slot]]
            if finished:
                self._harvest(state, finished, owner, results)
                free = sorted(free + finished)
        # what the next call's policy state starts from (None: the policy keeps nothing)
        self.learnt = state.policy_state if jax.tree.leaves(state.policy_state) else None
        # probes: drafter forwards that verified nothing; verified / computed: the tokens the
        # verify steps asked for and the tokens the target ran for them
        probes, verified, computed = map(int, fetch((state.probes, state.verified, state.computed)))
        self.last_run = {
            "loop_steps": loop_steps,
            "probes": probes,
            "verified_tokens": verified,
            "computed_tokens": computed,
        }
        return results

    def _harvest(self, state, slots, owner, results):
        out, n_out, steps = fetch((state.out_BxS, state.num_out_B, state.steps_B))
        acc, width, req = fetch((state.accepted_BxS, state.width_BxS, state.request_BxS))
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
