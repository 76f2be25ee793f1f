"""Jitted speculative decoding over a fixed set of slots (DESIGN §5).

Dimensions: B slots, K block size, W verify width (a bucket), V vocab, C cache capacity
(also the per-slot output / statistics buffer length), R rows prefilled together, P padded
prompt length, nD concatenated target features, E eos ids, U pending-context positions.

Invariants of a live slot b (one request):
- `bonus_B[b]` is the last committed token. Neither its target K/V nor its target features
  exist yet: `target_cache.lengths[b] == context_cache.lengths[b]` == its position.
- One step drafts K−1 tokens after the bonus, asks the policy for a width, runs the target on
  [bonus, d_1..d_{W−1}] at a bucket width W chosen by `lax.switch` (one compiled program for
  every width), accepts n drafts, commits n + 1 tokens (drafts + a new bonus), rolls the
  target cache back to old + n + 1 and appends the n + 1 verified positions' features to the
  drafter context.
- Finished and free slots ride along masked: nothing they compute is committed.
- A policy with a "don't speculate" arm (`skip_draft`) runs two loop programs: drafted steps
  (`EngineSpec.undrafted_mode` False) and undrafted ones (True): a plain decoding step that
  also appends the committed token's features to the drafter context, recorded as requested
  width 0. Each loop exits when the policy wants the other kind of step and the host
  switches programs, so no step pays for a conditional around the drafter (nor for the cache
  copies XLA makes around conditionally updated buffers).
- Undrafted steps defer the drafter context: they park the committed token's target features
  in a pending buffer of U positions per row (`pending_BxUxnD`, `pending_B` of them held), so
  `context_cache.lengths + pending_B == target_cache.lengths`. The buffer is projected into the
  context in one batched pass (`flush_pending`) when a drafted program starts and whenever it
  fills. Projecting one position per step cost the undrafted step 13 % of a plain step on
  the CPU at one slot (tiny target); one pass per U steps amortises the fixed costs.
- The undrafted program refreshes the rows' acceptance estimates every `probe_interval` steps
  with one drafter forward and no verify (`probe`), between runs of steps (a conditional
  there, not in every step), and leaves only when drafting pays again. It asks the policy
  only between runs (after a probe, a flush or a finished row): nothing the decision reads
  changes within a run. A verified drafted
  step as the probe would cost two program switches besides the verify.
- Each row's estimates are calibrated (a ↦ a^γ) to its own realised acceptance
  (`calibration.py`): drafted steps feed it, and so do probes, graded against the tokens the
  undrafted steps commit after them.
The plain path (`drafter is None`) uses the same state and scheduler with width 1.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from adaflash_jax.decode import acceptance, calibration
from adaflash_jax.decode.policies import FixedPolicy, PolicyInput
from adaflash_jax.decode.verify import pad_width, verify_forward, write_new_entries
from adaflash_jax.model.kv_cache import KVCache

PRIOR_RATE = 0.2  # EMA weight of one drafted step's mean estimate in a fresh request's prior


@struct.dataclass
class SpecState:
    target_cache: KVCache
    context_cache: KVCache | None  # drafter context (None on the plain path)
    bonus_B: jax.Array  # int32 last committed token
    out_BxC: jax.Array  # int32 generated tokens, -1 past num_out
    num_out_B: jax.Array  # int32
    max_new_B: jax.Array  # int32
    done_B: jax.Array  # bool: finished or free
    eos_E: jax.Array  # int32 eos ids (-1 pads, never matches)
    steps_B: jax.Array  # int32 verify steps of the slot's current request
    accepted_BxC: jax.Array  # int32 accepted drafts per step, -1 past steps
    width_BxC: jax.Array  # int32 batch verify width (bucket) per step
    request_BxC: jax.Array  # int32 the row's requested width per step (0: undrafted step)
    accept_est_BxKm1: jax.Array  # float32 acceptance estimate of the row's latest draft
    accept_prior_Km1: jax.Array  # float32 EMA of rows' estimates (negative: no forward yet)
    # float32 log of the estimates' calibration exponent γ: per row, and over all rows (a
    # fresh request's start); see calibration.py
    accept_log_gamma_B: jax.Array
    accept_log_gamma: jax.Array
    probe_drafts_BxKm1: jax.Array  # int32 greedy drafts of the row's latest probe
    probe_at_B: jax.Array  # int32 the row's output length at that probe
    probe_live_B: jax.Array  # bool: that probe is of the row's current request, not graded yet
    undrafted: jax.Array  # int32 scalar: undrafted steps since the estimates were refreshed
    probes: jax.Array  # int32 scalar: estimate-only drafter forwards (`probe`) so far
    probe_due_at: jax.Array  # int32 scalar: `undrafted` count at which the next probe is due
    # undrafted steps' target features not yet in the drafter context (None unless skip_draft)
    pending_BxUxnD: jax.Array | None
    pending_B: jax.Array  # int32 positions held per row
    temperature: jax.Array  # float32 scalar
    top_p: jax.Array  # float32 scalar
    rng: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """Everything static about a compiled engine (hashable: a jit static argument)."""

    block_size: int  # K (1 on the plain path)
    buckets: tuple[int, ...]  # ascending verify widths, the last == K
    greedy: bool
    nucleus: bool  # top_p < 1: sample through the sorted nucleus filter
    feature_layers: tuple[int, ...]
    policy: object = FixedPolicy()
    acceptance: Callable | None = None  # None → greedy_accept / rejection_accept
    use_length_head: bool = False
    use_accept_head: bool = False  # policy reads `length_head.accept_probs` [B, K−1]
    undrafted_mode: bool = False  # this program runs undrafted steps (skip_draft policies)

    @property
    def skip_draft(self) -> bool:
        """The policy may run undrafted (plain) steps (see `policies.GoodputPolicy`)."""
        return bool(getattr(self.policy, "skip_draft", False))

    def __post_init__(self):
        # A serving engine's buckets end at K (`bucket_set`). One whose largest bucket W is
        # below K verifies at most W tokens per step: a program pinned to one width, which is
        # how `adaflash_jax.aot` compiles the step once per width for its cost estimates.
        b = list(self.buckets)
        if not b or b != sorted(set(b)) or b[0] < 1 or b[-1] > self.block_size:
            raise ValueError(f"buckets {self.buckets} must ascend within [1, K={self.block_size}]")

    @property
    def prefill_spec(self) -> EngineSpec:
        """Only what the prefill depends on, so engines that differ in policy, buckets or
        acceptance share prefill programs."""
        return dataclasses.replace(
            self,
            buckets=(self.block_size,),
            policy=None,
            acceptance=None,
            use_length_head=False,
            use_accept_head=False,
            undrafted_mode=False,
        )

    def top_p(self, s: SpecState):
        return s.top_p if self.nucleus else None

    @property
    def accept_fn(self):
        if self.acceptance is not None:
            return self.acceptance
        return acceptance.greedy_accept if self.greedy else acceptance.rejection_accept


def bucket_set(buckets, block_size: int) -> tuple[int, ...]:
    """The requested buckets clipped below K, with K itself always present."""
    return tuple(sorted({int(b) for b in buckets if 1 <= int(b) < block_size} | {block_size}))


def _block_size(drafter) -> int:
    return 1 if drafter is None else drafter.config.block_size


PENDING_STEPS = 32  # U: undrafted steps whose features wait for one batched context pass


@dataclasses.dataclass(frozen=True)
class Adaptation:
    """What a skip_draft engine learnt about acceptance over all its rows (host copies): the
    fresh-request prior [K−1] and the engine-wide log γ. A new state can start from it."""

    accept_prior_Km1: tuple[float, ...]
    accept_log_gamma: float

    @classmethod
    def of(cls, s: SpecState) -> Adaptation | None:
        prior, log_gamma = jax.device_get((s.accept_prior_Km1, s.accept_log_gamma))
        if prior.size == 0 or prior[0] < 0:  # no drafter forward yet: nothing learnt
            return None
        if not (np.all(np.isfinite(prior)) and np.isfinite(log_gamma)):
            return None  # a non-finite estimate is never carried into the next call
        return cls(tuple(float(x) for x in prior), float(log_gamma))


def init_state(
    target,
    drafter,
    *,
    slots,
    capacity,
    eos_ids,
    temperature,
    top_p,
    seed,
    pending=0,
    adaptation: Adaptation | None = None,
) -> SpecState:
    """All slots free (done). Buffers are `capacity` long: a request never outgrows it.
    `pending` > 0 (engines whose policy may skip drafting) sizes the deferred-context buffer.
    `adaptation`: start from an earlier state's prior and γ instead of "nothing learnt"; the
    first probe then waits for the policy's interval instead of coming at once."""
    eos = tuple(eos_ids) or (-1,)
    km1 = _block_size(drafter) - 1
    if adaptation is not None and len(adaptation.accept_prior_Km1) != km1:
        raise ValueError(f"adaptation has {len(adaptation.accept_prior_Km1)} positions, not {km1}")
    learnt = adaptation is not None

    def blank_BxC():  # one buffer per field: the state is donated, and a buffer may not be
        return jnp.full((slots, capacity), -1, jnp.int32)  # donated twice in one call

    target_cache = target.init_cache(slots, capacity)
    pending_BxUxnD = None
    if drafter is not None and pending > 0:
        nd = len(drafter.config.target_layer_ids) * target.config.hidden_size
        pending_BxUxnD = jnp.zeros((slots, pending, nd), target_cache.k[0].dtype)
    return SpecState(
        target_cache=target_cache,
        context_cache=None if drafter is None else drafter.init_context_cache(slots, capacity),
        bonus_B=jnp.zeros((slots,), jnp.int32),
        out_BxC=blank_BxC(),
        num_out_B=jnp.zeros((slots,), jnp.int32),
        max_new_B=jnp.zeros((slots,), jnp.int32),
        done_B=jnp.ones((slots,), bool),
        eos_E=jnp.asarray(eos, jnp.int32),
        steps_B=jnp.zeros((slots,), jnp.int32),
        accepted_BxC=blank_BxC(),
        width_BxC=blank_BxC(),
        request_BxC=blank_BxC(),
        accept_est_BxKm1=jnp.ones((slots, km1), jnp.float32),
        # negative: no drafter forward yet (see fresh_request_estimate)
        accept_prior_Km1=(
            jnp.asarray(adaptation.accept_prior_Km1, jnp.float32)
            if learnt
            else jnp.full((km1,), -1.0, jnp.float32)
        ),
        accept_log_gamma_B=jnp.zeros((slots,), jnp.float32),
        accept_log_gamma=jnp.asarray(adaptation.accept_log_gamma if learnt else 0.0, jnp.float32),
        probe_drafts_BxKm1=jnp.zeros((slots, km1), jnp.int32),
        probe_at_B=jnp.zeros((slots,), jnp.int32),
        probe_live_B=jnp.zeros((slots,), bool),
        undrafted=jnp.zeros((), jnp.int32),
        probes=jnp.zeros((), jnp.int32),
        # 0: the first undrafted loop probes at once; 1: its entry sets the interval instead
        probe_due_at=jnp.asarray(int(learnt), jnp.int32),
        pending_BxUxnD=pending_BxUxnD,
        pending_B=jnp.zeros((slots,), jnp.int32),
        temperature=jnp.asarray(temperature, jnp.float32),
        top_p=jnp.asarray(top_p, jnp.float32),
        rng=jax.random.key(seed),
    )


# ---- one step ------------------------------------------------------------------------------
def _drafter_forward(target, drafter, s: SpecState, spec: EngineSpec) -> PolicyInput:
    """One drafter forward after each row's bonus token, as a policy sees it (DESIGN §4.3):
    block states and draft logits, never the sampled drafts."""
    d = drafter.draft(s.context_cache, s.bonus_B, target.embedding_VxD(), target.lm_head_DxV())
    hidden = jax.lax.stop_gradient(d.hidden_BxKxD)
    logits_BxKm1xV = d.logits_BxKm1xV.astype(jnp.float32)
    active_B = ~s.done_B
    return PolicyInput(
        hidden_BxKxD=hidden,
        logits_BxKm1xV=logits_BxKm1xV,
        length_r_B=drafter.length_head(hidden) if spec.use_length_head else None,
        head_accept_BxKm1=(
            drafter.length_head.accept_probs(hidden, logits_BxKm1xV)
            if spec.use_accept_head
            else None
        ),
        active_B=active_B,
        num_running=jnp.sum(active_B.astype(jnp.int32)),
        accept_log_gamma=s.accept_log_gamma_B if spec.skip_draft else 0.0,
    )


def _fresh_estimates(s: SpecState, active_B, fresh_BxKm1):
    """The rows' estimates after a drafter forward, and the prior for requests not drafted for
    yet: an EMA of the drafted rows' mean, set to that mean by the first forward (starting
    them at 1 would force a draft on admission even where drafting never pays)."""
    est_BxKm1 = jnp.where(active_B[:, None], fresh_BxKm1, s.accept_est_BxKm1)
    n = jnp.sum(active_B)
    mean_Km1 = jnp.sum(jnp.where(active_B[:, None], fresh_BxKm1, 0.0), axis=0) / jnp.maximum(n, 1)
    ema_Km1 = (1.0 - PRIOR_RATE) * s.accept_prior_Km1 + PRIOR_RATE * mean_Km1
    ema_Km1 = jnp.where(s.accept_prior_Km1 < 0, mean_Km1, ema_Km1)  # the first forward
    return est_BxKm1, jnp.where(n > 0, ema_Km1, s.accept_prior_Km1)


def fresh_request_estimate(s: SpecState) -> jax.Array:
    """A request's acceptance estimate before its first drafter forward [K−1]: the prior,
    1 (drafting pays) before any forward."""
    return jnp.where(s.accept_prior_Km1 < 0, 1.0, s.accept_prior_Km1)


def _draft(drafter, target, s: SpecState, spec: EngineSpec, key):
    """Drafts, their sampling distribution q (None when greedy), the requested widths and
    the rows' acceptance estimates (updated only by policies that keep them)."""
    inp = _drafter_forward(target, drafter, s, spec)
    logits_BxKm1xV = inp.logits_BxKm1xV
    b, km1, v = logits_BxKm1xV.shape
    if spec.greedy:
        q_BxKm1xV = None
        drafts_BxKm1 = jnp.argmax(logits_BxKm1xV, axis=-1).astype(jnp.int32)
    else:
        flat = logits_BxKm1xV.reshape(b * km1, v)
        q_BxKm1xV = acceptance.sampling_probs(flat, s.temperature, spec.top_p(s))
        q_BxKm1xV = q_BxKm1xV.reshape(b, km1, v)
        drafts_BxKm1 = jax.random.categorical(key, jnp.log(q_BxKm1xV), axis=-1).astype(jnp.int32)
    active_B = inp.active_B
    estimates = (s.accept_est_BxKm1, s.accept_prior_Km1)
    if spec.skip_draft:
        width_B, fresh_BxKm1 = spec.policy.decide(
            inp, block_size=spec.block_size, buckets=spec.buckets
        )
        estimates = _fresh_estimates(s, active_B, fresh_BxKm1)
    else:
        width_B = spec.policy.widths(inp, block_size=spec.block_size, buckets=spec.buckets)
    width_B = jnp.where(active_B, jnp.clip(width_B, 1, spec.block_size), 1).astype(jnp.int32)
    return drafts_BxKm1, q_BxKm1xV, width_B, estimates


def probe(target, drafter, s: SpecState, spec: EngineSpec) -> SpecState:
    """Refreshes the rows' acceptance estimates from one drafter forward, without verifying
    (the undrafted program's periodic check whether drafting pays again), after grading the
    previous probe against what was committed since. The context must be current (flushed).
    Decides from committed tokens only, so it keeps decoding lossless."""
    s = grade_probe(s)
    inp = _drafter_forward(target, drafter, s, spec)
    _, fresh_BxKm1 = spec.policy.decide(inp, block_size=spec.block_size, buckets=spec.buckets)
    est_BxKm1, prior_Km1 = _fresh_estimates(s, inp.active_B, fresh_BxKm1)
    return s.replace(
        accept_est_BxKm1=est_BxKm1,
        accept_prior_Km1=prior_Km1,
        undrafted=jnp.zeros_like(s.undrafted),
        probes=s.probes + 1,
        probe_drafts_BxKm1=jnp.argmax(inp.logits_BxKm1xV, axis=-1).astype(jnp.int32),
        probe_at_B=s.num_out_B,
        probe_live_B=inp.active_B,
    )


def grade_probe(s: SpecState) -> SpecState:
    """Feeds the latest probe's outcome (its drafts against the tokens committed since) into
    the rows' calibration, before anything replaces the estimates it was made with."""
    realised_B, width_B, graded_B = calibration.probe_outcome(
        s.probe_drafts_BxKm1, s.probe_at_B, s.probe_live_B, s.out_BxC, s.num_out_B
    )
    rows_B, engine = calibration.update(
        s.accept_log_gamma_B, s.accept_log_gamma, s.accept_est_BxKm1, width_B, realised_B, graded_B
    )
    return s.replace(
        accept_log_gamma_B=rows_B, accept_log_gamma=engine, probe_live_B=s.probe_live_B & ~graded_B
    )


def _verify_accept(
    target, drafter, tokens_BxK, q_BxKm1xV, width_B, s: SpecState, spec, bucket_idx, key
):
    """Target forward over the first W = buckets[bucket_idx] tokens and acceptance of their
    W − 1 drafts, inside one `lax.switch` branch per width: the logits never leave their
    branch (padding [B, W, V] to K and accepting over K positions would cost as much as the
    forward at small widths). The branches only read the cache; the new entries, padded to
    K, are written after the switch (in place; see `verify.py`).

    The drafter-context entries of the (at most W) committed tokens are computed in the
    branch too, over W positions only: a narrow or undrafted step does not project K.

    Returns (accepted_B, bonus_B, target cache and drafter context cache with the new entries
    written but lengths unchanged)."""
    k = spec.block_size

    def branch(w):
        def run(cache):
            logits, feats, new_k, new_v = verify_forward(
                target, tokens_BxK[:, :w], cache, spec.feature_layers
            )
            ctx_k, ctx_v = drafter.context_entries(s.context_cache, feats)
            q_BxWm1xV = None if q_BxKm1xV is None else q_BxKm1xV[:, : w - 1]
            accepted_B, bonus_B = spec.accept_fn(
                key,
                tokens_BxK[:, 1:w],
                q_BxWm1xV,
                logits.astype(jnp.float32),
                width_B,
                s.temperature,
                spec.top_p(s),
            )

            def pad(xs):
                return tuple(pad_width(x, k) for x in xs)

            return (
                accepted_B.astype(jnp.int32),
                bonus_B.astype(jnp.int32),
                (pad(new_k), pad(new_v)),
                (pad(ctx_k), pad(ctx_v)),
            )

        return run

    accepted_B, bonus_B, target_kv, ctx_kv = jax.lax.switch(
        bucket_idx, [branch(w) for w in spec.buckets], s.target_cache
    )
    return accepted_B, bonus_B, write_new_entries(s.target_cache, *target_kv), ctx_kv


def _commit(s: SpecState, tokens_BxK, n_commit_B, active_B) -> SpecState:
    """Appends each active row's first `n_commit` tokens, truncated after an EOS or at its
    max-new-tokens; sets done flags."""
    b, k = tokens_BxK.shape
    c = s.out_BxC.shape[1]
    j_K = jnp.arange(k, dtype=jnp.int32)[None, :]
    valid_BxK = j_K < n_commit_B[:, None]
    is_eos_BxK = jnp.any(tokens_BxK[..., None] == s.eos_E[None, None, :], axis=-1) & valid_BxK
    first_eos_B = jnp.where(jnp.any(is_eos_BxK, axis=1), jnp.argmax(is_eos_BxK, axis=1), k)
    keep_B = jnp.minimum(jnp.minimum(n_commit_B, s.max_new_B - s.num_out_B), first_eos_B + 1)
    keep_B = jnp.where(active_B, keep_B, 0)
    slot_BxK = jnp.where(j_K < keep_B[:, None], s.num_out_B[:, None] + j_K, c)
    out_BxC = s.out_BxC.at[jnp.arange(b)[:, None], slot_BxK].set(tokens_BxK, mode="drop")
    num_out_B = s.num_out_B + keep_B
    hit_eos_B = first_eos_B < keep_B
    done_B = s.done_B | (active_B & (hit_eos_B | (num_out_B >= s.max_new_B)))
    return s.replace(out_BxC=out_BxC, num_out_B=num_out_B, done_B=done_B)


def _record(s: SpecState, active_B, accepted_B, width, request_B) -> SpecState:
    b, c = s.accepted_BxC.shape
    rows_B = jnp.arange(b)
    at_B = jnp.where(active_B, s.steps_B, c)
    width_B = jnp.broadcast_to(width, (b,))
    return s.replace(
        accepted_BxC=s.accepted_BxC.at[rows_B, at_B].set(accepted_B, mode="drop"),
        width_BxC=s.width_BxC.at[rows_B, at_B].set(width_B, mode="drop"),
        request_BxC=s.request_BxC.at[rows_B, at_B].set(request_B, mode="drop"),
        steps_B=s.steps_B + active_B.astype(jnp.int32),
    )


def spec_step(target, drafter, s: SpecState, spec: EngineSpec) -> SpecState:
    """One draft → policy → verify → accept → commit → rollback step for all slots."""
    active_B = ~s.done_B
    rng, key_draft, key_accept = jax.random.split(s.rng, 3)
    if drafter is None:
        return _plain_step(target, s.replace(rng=rng), spec, key_accept)
    if spec.undrafted_mode:
        return _undrafted_step(target, drafter, s.replace(rng=rng), spec, key_accept)
    drafts_BxKm1, q_BxKm1xV, width_B, (est_BxKm1, prior_Km1) = _draft(
        drafter, target, s, spec, key_draft
    )
    buckets_NW = jnp.asarray(spec.buckets, jnp.int32)
    bucket_idx = jnp.sum((buckets_NW < jnp.max(width_B)).astype(jnp.int32))
    tokens_BxK = jnp.concatenate([s.bonus_B[:, None], drafts_BxKm1], axis=1)
    accepted_B, bonus_B, tcache, (ctx_k, ctx_v) = _verify_accept(
        target, drafter, tokens_BxK, q_BxKm1xV, width_B, s, spec, bucket_idx, key_accept
    )
    accepted_B = jnp.where(active_B, accepted_B, 0).astype(jnp.int32)
    n_commit_B = accepted_B + 1
    j_K = jnp.arange(spec.block_size, dtype=jnp.int32)[None, :]
    drafts_BxK = jnp.concatenate([drafts_BxKm1, jnp.zeros_like(drafts_BxKm1[:, :1])], axis=1)
    committed_BxK = jnp.where(j_K < accepted_B[:, None], drafts_BxK, bonus_B[:, None])
    advance_B = jnp.where(active_B, n_commit_B, 0)
    s = _commit(s, committed_BxK, n_commit_B, active_B)
    s = _record(s, active_B, accepted_B, buckets_NW[bucket_idx], width_B)
    s = s.replace(
        target_cache=tcache.with_lengths(s.target_cache.lengths + advance_B),
        context_cache=drafter.write_context(s.context_cache, ctx_k, ctx_v, advance_B),
        bonus_B=jnp.where(active_B, bonus_B, s.bonus_B),
        accept_est_BxKm1=est_BxKm1,
        accept_prior_Km1=prior_Km1,
        undrafted=jnp.zeros_like(s.undrafted),
        rng=rng,
    )
    if spec.skip_draft:  # the rows' realised acceptance against their estimates
        rows_B, engine = calibration.update(
            s.accept_log_gamma_B, s.accept_log_gamma, est_BxKm1, width_B, accepted_B, active_B
        )
        s = s.replace(accept_log_gamma_B=rows_B, accept_log_gamma=engine)
    return s


def _pick(key, logits_BxV, s: SpecState, spec: EngineSpec):
    if spec.greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    probs_BxV = acceptance.sampling_probs(logits_BxV, s.temperature, spec.top_p(s))
    return jax.random.categorical(key, jnp.log(probs_BxV), axis=-1).astype(jnp.int32)


def _undrafted_step(target, drafter, s: SpecState, spec: EngineSpec, key) -> SpecState:
    """A plain decoding step of a speculative engine: the target writes its cache in place,
    and the committed token's features wait in the pending buffer (the caller keeps it from
    overflowing: see `_loop`)."""
    if s.pending_BxUxnD is None:
        raise ValueError("undrafted steps need the pending-context buffer (init_state pending>0)")
    active_B = ~s.done_B
    advance_B = active_B.astype(jnp.int32)
    out = target(
        s.bonus_B[:, None],
        cache=s.target_cache,
        num_new_B=advance_B,
        feature_layers=spec.feature_layers,
    )
    tok_B = _pick(key, out.logits_BxTxV[:, 0].astype(jnp.float32), s, spec)
    s = _commit(s, tok_B[:, None], jnp.ones_like(advance_B), active_B)
    zeros_B = jnp.zeros_like(advance_B)
    s = _record(s, active_B, zeros_B, 1, zeros_B)  # requested 0: undrafted
    b, p, _ = s.pending_BxUxnD.shape
    at_B = jnp.where(active_B, s.pending_B, p)  # inactive rows write nothing
    pending = s.pending_BxUxnD.at[jnp.arange(b), at_B].set(
        out.features_BxTxnD[:, 0].astype(s.pending_BxUxnD.dtype), mode="drop"
    )
    return s.replace(
        target_cache=out.cache,
        pending_BxUxnD=pending,
        pending_B=s.pending_B + advance_B,
        bonus_B=jnp.where(active_B, tok_B, s.bonus_B),
        undrafted=s.undrafted + 1,
    )


def pending_full(s: SpecState) -> jax.Array:
    """Whether some row's pending buffer is full (bool scalar)."""
    return jnp.max(s.pending_B) >= s.pending_BxUxnD.shape[1]


def flush_pending(drafter, s: SpecState, when=True) -> SpecState:
    """Projects every row's pending features into the drafter context (one batched pass over
    U positions; entries past a row's count are written but stay masked), when any wait and
    `when` (a bool scalar) holds."""
    if drafter is None or s.pending_BxUxnD is None:
        return s

    def flush():
        ctx = drafter.append_context(s.context_cache, s.pending_BxUxnD, s.pending_B)
        return ctx, jnp.zeros_like(s.pending_B)

    # only what the flush changes passes through the conditional, not the whole state
    ctx, pending_B = jax.lax.cond(
        jnp.any(s.pending_B > 0) & when, flush, lambda: (s.context_cache, s.pending_B)
    )
    return s.replace(context_cache=ctx, pending_B=pending_B)


def _plain_step(target, s: SpecState, spec: EngineSpec, key) -> SpecState:
    active_B = ~s.done_B
    advance_B = active_B.astype(jnp.int32)
    out = target(s.bonus_B[:, None], cache=s.target_cache, num_new_B=advance_B)
    tok_B = _pick(key, out.logits_BxTxV[:, 0].astype(jnp.float32), s, spec)
    s = _commit(s, tok_B[:, None], jnp.ones_like(advance_B), active_B)
    s = _record(s, active_B, jnp.zeros_like(advance_B), 1, jnp.ones_like(advance_B))
    return s.replace(target_cache=out.cache, bonus_B=jnp.where(active_B, tok_B, s.bonus_B))


# ---- prefill into slots --------------------------------------------------------------------
def _scatter_rows(dst, src, slots_R):
    """Writes src rows into dst at `slots_R`; out-of-range slots (padding rows) drop."""
    return jax.tree.map(lambda d, x: d.at[slots_R].set(x.astype(d.dtype), mode="drop"), dst, src)


def prefill(target, drafter, s: SpecState, slots_R, prompt_RxP, prompt_len_R, max_new_R, spec):
    """Starts R requests in slots `slots_R` (padding rows carry slot index B: dropped).

    Fresh caches for those rows: the prompt fills the target cache and its features the
    drafter context; the first token comes from the prefill logits and becomes the bonus."""
    r, _ = prompt_RxP.shape
    capacity = s.target_cache.capacity
    layers = spec.feature_layers if drafter is not None else ()
    out = target(
        prompt_RxP,
        cache=target.init_cache(r, capacity, dtype=s.target_cache.k[0].dtype),
        num_new_B=prompt_len_R,
        feature_layers=layers,
        compute_logits=False,
    )
    last_RxD = out.hidden_BxTxD[jnp.arange(r), prompt_len_R - 1]
    rng, key = jax.random.split(s.rng)
    first_R = _pick(key, target.logits(last_RxD[:, None])[:, 0].astype(jnp.float32), s, spec)
    ctx = s.context_cache
    if drafter is not None:
        fresh = drafter.init_context_cache(r, capacity, dtype=ctx.k[0].dtype)
        ctx = _scatter_rows(
            ctx, drafter.append_context(fresh, out.features_BxTxnD, prompt_len_R), slots_R
        )
    c = s.out_BxC.shape[1]
    blank_RxC = jnp.full((r, c), -1, jnp.int32)
    zero_R = jnp.zeros((r,), jnp.int32)
    s = s.replace(
        target_cache=_scatter_rows(s.target_cache, out.cache, slots_R),
        context_cache=ctx,
        bonus_B=_scatter_rows(s.bonus_B, first_R, slots_R),
        out_BxC=_scatter_rows(s.out_BxC, blank_RxC, slots_R),
        num_out_B=_scatter_rows(s.num_out_B, zero_R, slots_R),
        max_new_B=_scatter_rows(s.max_new_B, max_new_R, slots_R),
        done_B=_scatter_rows(s.done_B, jnp.zeros((r,), bool), slots_R),
        steps_B=_scatter_rows(s.steps_B, zero_R, slots_R),
        pending_B=_scatter_rows(s.pending_B, zero_R, slots_R),
        accept_log_gamma_B=_scatter_rows(
            s.accept_log_gamma_B, jnp.broadcast_to(s.accept_log_gamma, (r,)), slots_R
        ),
        probe_live_B=_scatter_rows(s.probe_live_B, jnp.zeros((r,), bool), slots_R),
        accepted_BxC=_scatter_rows(s.accepted_BxC, blank_RxC, slots_R),
        width_BxC=_scatter_rows(s.width_BxC, blank_RxC, slots_R),
        request_BxC=_scatter_rows(s.request_BxC, blank_RxC, slots_R),
        accept_est_BxKm1=_scatter_rows(
            s.accept_est_BxKm1,
            jnp.broadcast_to(fresh_request_estimate(s), (r, s.accept_prior_Km1.shape[0])),
            slots_R,
        ),
        rng=rng,
    )
    started_B = _scatter_rows(jnp.zeros_like(s.done_B), jnp.ones((r,), bool), slots_R)
    ones_B = jnp.ones_like(s.num_out_B)
    return _commit(s, s.bonus_B[:, None], ones_B, started_B)


# ---- jitted entry points ---------------------------------------------------------------------
def _models(tdef, tstate, ddef, dstate):
    return nnx.merge(tdef, tstate), (None if ddef is None else nnx.merge(ddef, dstate))


def wants_draft(drafter, s: SpecState, spec: EngineSpec):
    """Whether the next step should draft (bool scalar): the skip_draft policy's choice, made
    from earlier steps only; always True otherwise (and on the plain path)."""
    if drafter is None or not spec.skip_draft:
        return jnp.asarray(True)
    return spec.policy.speculate(
        s.accept_est_BxKm1,
        ~s.done_B,
        s.undrafted,
        buckets=spec.buckets,
        log_gamma=s.accept_log_gamma_B,
        switching=spec.undrafted_mode,
    )


def _loop(tdef, tstate, ddef, dstate, s, stop_on_finish, max_steps, *, spec):
    target, drafter = _models(tdef, tstate, ddef, dstate)
    drafting = not spec.undrafted_mode

    def go(carry):
        s, it, finished = carry
        return jnp.any(~s.done_B) & (it < max_steps) & ~(stop_on_finish & (finished > 0))

    def cond(carry):
        return go(carry) & (wants_draft(drafter, carry[0], spec) == drafting)

    def body(carry):
        s, it, finished = carry
        before_B = ~s.done_B
        s = spec_step(target, drafter, s, spec)
        return s, it + 1, finished + jnp.sum((before_B & s.done_B).astype(jnp.int32))

    if drafting:
        carry = (grade_probe(flush_pending(drafter, s)), jnp.int32(0), jnp.int32(0))
        s, steps, finished = jax.lax.while_loop(cond, body, carry)
        return s, steps, finished, wants_draft(drafter, s, spec)

    def interval(s):
        return spec.policy.probe_interval(
            jnp.sum(~s.done_B),
            spec.buckets,
            accept_BxKm1=s.accept_est_BxKm1,
            active_B=~s.done_B,
            log_gamma=s.accept_log_gamma_B,
        )

    def probe_due(s):
        return s.undrafted >= s.probe_due_at

    def refreshed(s):
        # only the small outputs leave the conditional: no cache flows through it
        fields = (
            "accept_est_BxKm1",
            "accept_prior_Km1",
            "undrafted",
            "probes",
            "accept_log_gamma_B",
            "accept_log_gamma",
            "probe_drafts_BxKm1",
            "probe_at_B",
            "probe_live_B",
        )

        def small(s):
            return {f: getattr(s, f) for f in fields}

        changed = jax.lax.cond(
            probe_due(s), lambda: small(probe(target, drafter, s, spec)), lambda: small(s)
        )
        s = s.replace(**changed)
        # the interval is decided here, between runs of steps, not in every step's check
        return s.replace(probe_due_at=interval(s))

    def prepared(s):
        # the context only has to be current for a probe (the drafted program flushes on
        # entry); otherwise only a full buffer is flushed
        return refreshed(flush_pending(drafter, s, probe_due(s) | pending_full(s)))

    def undrafted_run(carry):
        # undrafted steps until the buffer fills, a probe is due, a row finishes or the loop
        # would stop. The policy's decision is not re-evaluated in these steps: between
        # probes it changes only when a row finishes (the running count), so the outer
        # loop's check covers it. Evaluated in every step it cost the undrafted step ~20 % of
        # a plain step at one slot on the CPU.
        finished0 = carry[2]

        def more(c):
            s, it, finished = c
            return go(c) & (finished == finished0) & ~pending_full(s) & ~probe_due(s)

        s, it, finished = jax.lax.while_loop(more, body, carry)
        return prepared(s), it, finished

    # a probe that is due (e.g. before any drafter forward) comes before the first decision
    carry = (prepared(s), jnp.int32(0), jnp.int32(0))
    s, steps, finished = jax.lax.while_loop(cond, undrafted_run, carry)
    return s, steps, finished, wants_draft(drafter, s, spec)


def _prefill(tdef, tstate, ddef, dstate, s, slots_R, prompt_RxP, len_R, max_new_R, *, spec):
    target, drafter = _models(tdef, tstate, ddef, dstate)
    return prefill(target, drafter, s, slots_R, prompt_RxP, len_R, max_new_R, spec)


_STATIC = ("tdef", "ddef", "spec")
_IMPLS = {"run_loop": _loop, "prefill_slots": _prefill}
_JITTED: dict = {}


def jitted(name: str):
    """The jitted entry point `name`, built on first use. The state is donated on every
    backend (callers continue from the returned state): without donation each device call
    copies the whole state before its loop runs. On this CPU (jax 0.10.2) that copy was most
    of a call's overhead: a one-step call of the goodput engine cost 8.6 ms more than a step in
    a running loop at 64 slots (its engine-step calibration)."""
    if name not in _JITTED:
        _JITTED[name] = jax.jit(_IMPLS[name], static_argnames=_STATIC, donate_argnames=("s",))
    return _JITTED[name]


def run_loop(tdef, tstate, ddef, dstate, s, stop_on_finish, max_steps, *, spec):
    """Steps until no slot is active, `max_steps` ran, (if `stop_on_finish`) a slot finished,
    or the policy wants the other kind of step than this program runs (skip_draft).
    Returns (state, steps run, slots finished, wants_draft for the next step)."""
    return jitted("run_loop")(tdef, tstate, ddef, dstate, s, stop_on_finish, max_steps, spec=spec)


def prefill_slots(tdef, tstate, ddef, dstate, s, slots_R, prompt_RxP, len_R, max_new_R, *, spec):
    return jitted("prefill_slots")(
        tdef, tstate, ddef, dstate, s, slots_R, prompt_RxP, len_R, max_new_R, spec=spec.prefill_spec
    )


def compiled_programs() -> dict[str, int]:
    """Compiled-program counts of the jitted entry points (for no-recompile checks)."""
    return {name: jitted(name)._cache_size() for name in _IMPLS}


@functools.cache
def length_buckets(capacity: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded prompt lengths: powers of two from `smallest`, capped by the capacity."""
    out, p = [], smallest
    while p < capacity:
        out.append(p)
        p *= 2
    return tuple(out + [capacity])
