"""The goodput length policy (`LengthPolicy`) and its acceptance estimators (docs/design.md §5.4).

Dimensions: B slots, K block size, Y a row's draft nodes (a tree's, or a chain's K − 1
positions), NW widths (the verify buckets), NM packed verify's token buckets, V vocab.

Each drafted step picks the one batch width W maximising Σ_active E[committed | W] /
step_ms(W) over the buckets: E[committed | W] = 1 + Σ_{i<W} s_i from each row's survival
estimates s_i (the chance node i is accepted; for a chain Π_{j<=i} a_j from per-position
estimates a_j: the drafter's top probability, "confidence"; the constant rate the length
head's r implies, "length_head"; or the head's acceptance output, "head"), step_ms the cost
table's draft + verify time. Under packed verify (a step costs its token bucket M, not B ×
the widest row) it picks a width per row: for each M, the M − n extra tokens of n active
rows go to the largest survivals over all rows (optimal: each row's survivals shrink with
i), and the M with the most tokens per ms of the table's packed form wins. With draft trees
(`decode/tree.py`, packed only) a row's nodes are its tree's in selection order and s_i
their path probabilities ("confidence": the drafter's own), so the same choice fills the
step's token bucket with the best nodes of every row, or picks a plain step.

With `skip_draft` (the "don't speculate" arm: the engine's undrafted loop,
`decode/undrafted.py`), a plain step (width 1, no drafter forward) runs instead when its rate
beats drafting's best, judged from each row's latest drafter forward (a drafted step's or a
probe's; a fresh request starts at the engine's running mean, 1 before any), calibrated to
the row's realised acceptance (`calibration.py`); the policy also says how often to probe.
Decisions read earlier steps only and an undrafted step is exactly a plain step, so decoding
stays lossless. Without the arm the policy keeps no state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from adaflash_jax.decode.goodput.calibration import (
    accepted_by_width,
    bisect,
    calibrated,
    chain_survival,
    update,
)
from adaflash_jax.decode.policy import (
    NEVER,
    Decision,
    Draft,
    Outcome,
    PolicyError,
    Slots,
)
from adaflash_jax.io.cost_table import VerifyCostTable

ESTIMATORS = ("confidence", "length_head", "head")
TREE_ESTIMATORS = ("confidence",)  # a tree node's survival is its own score (its surrogate)
PRIOR_RATE = 0.2  # EMA weight of one drafted step's mean estimate in a fresh request's prior


# ---- acceptance estimators -----------------------------------------------------------------
def length_head_accept_probs(r_B: jax.Array, block_size: int, iters: int = 40) -> jax.Array:
    """[B, K−1]: the constant rate a in [0, 1] with Σ_{i=1}^{K−1} a^i = r·K − 1 (the mean
    accepted streak r implies, clipped to [0, K − 1])."""
    n = block_size - 1
    powers_N = jnp.arange(1, n + 1, dtype=jnp.float32)
    target_B = jnp.clip((r_B * block_size - 1.0).astype(jnp.float32), 0.0, float(n))

    def too_big(a_B):  # the sum grows with a
        return jnp.sum(a_B[:, None] ** powers_N[None, :], axis=-1) > target_B

    a_B = bisect(too_big, jnp.zeros_like(target_B), jnp.ones_like(target_B), iters)
    return jnp.broadcast_to(a_B[:, None], (r_B.shape[0], n))


def accept_probs(draft: Draft, estimator: str) -> jax.Array:
    """[B, K − 1]: a chain's per-position acceptance estimates."""
    if estimator == "confidence":
        logits_BxKm1xV = draft.logits_BxKm1xV.astype(jnp.float32)
        return jnp.max(jax.nn.softmax(logits_BxKm1xV, axis=-1), axis=-1)
    if estimator == "length_head":
        return length_head_accept_probs(draft.length_r_B, draft.block_size)
    return draft.head_accept_BxKm1.astype(jnp.float32)


def survival(draft: Draft, estimator: str) -> jax.Array:
    """[B, Y]: the chance each node is accepted: a chain's Π_{j<=i} a_j, a tree node's
    exponentiated score (its path probability, or the head's surrogate; 0 for a slot the
    selection left empty)."""
    if draft.tree is not None:
        return jnp.exp(jnp.maximum(draft.tree.logp_BxY, -1e4))  # NO_NODE: exactly 0
    return chain_survival(accept_probs(draft, estimator))


def expected_committed(survive_BxY: jax.Array, widths: tuple[int, ...], log_gamma=0.0):
    """E[committed tokens | verify width W] = 1 + Σ_{i<W} s_i under the survivals calibrated
    as s^γ (log_gamma a scalar or one per row) → [B, NW]."""
    by_width_BxW = accepted_by_width(calibrated(survive_BxY, log_gamma))
    return 1.0 + by_width_BxW[:, jnp.asarray(widths) - 1]


# ---- the policy ----------------------------------------------------------------------------
@struct.dataclass
class GoodputState:
    """The skip arm's state: the rows' estimates and their calibration."""

    est_BxY: jax.Array  # float32 raw survival estimates of the row's latest draft
    prior_Y: jax.Array  # float32 EMA of rows' estimates (negative: no forward yet)
    log_gamma_B: jax.Array  # float32 log calibration exponent γ per row (calibration.py)
    log_gamma: jax.Array  # float32 the same over all rows: a fresh request's start

    def refreshed(self, s_BxY: jax.Array, active_B: jax.Array) -> GoodputState:
        """After a drafter forward estimated survivals `s_BxY`: the active rows' estimates,
        and the prior, an EMA of their mean that the first forward sets to it (starting fresh
        requests at 1 would force a draft on admission even where drafting never pays)."""
        n = jnp.sum(active_B)
        mean_Y = jnp.sum(jnp.where(active_B[:, None], s_BxY, 0.0), axis=0) / jnp.maximum(n, 1)
        ema_Y = (1.0 - PRIOR_RATE) * self.prior_Y + PRIOR_RATE * mean_Y
        ema_Y = jnp.where(self.prior_Y < 0, mean_Y, ema_Y)  # the first forward
        return self.replace(
            est_BxY=jnp.where(active_B[:, None], s_BxY, self.est_BxY),
            prior_Y=jnp.where(n > 0, ema_Y, self.prior_Y),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GoodputPolicy:
    """One batch width per step maximising expected committed tokens per millisecond; with
    `skip_draft`, also a plain (undrafted) step when drafting is not expected to pay."""

    cost: VerifyCostTable
    estimator: str = "confidence"
    skip_draft: bool = True
    # Undrafted steps between probes. None: as many as keep a probe's cost (the table's draft
    # time) within `probe_overhead` of the plain steps' time, capped at `max_probe_every`.
    probe_every: int | None = None
    probe_overhead: float = 0.05
    max_probe_every: int = 64
    # drafted steps one switch from the undrafted program is spread over (1: the first step
    # alone must pay for it)
    switch_horizon: float = 4.0
    name = "goodput"

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise PolicyError(f"unknown estimator {self.estimator!r}; choose from {ESTIMATORS}")
        if self.probe_every is not None and self.probe_every < 1:
            raise PolicyError(f"probe_every must be >= 1, got {self.probe_every}")
        if not self.switch_horizon >= 1:
            raise PolicyError(f"switch_horizon must be >= 1, got {self.switch_horizon}")
        if not self.probe_overhead > 0 or self.max_probe_every < 1:
            raise PolicyError(
                f"need probe_overhead > 0 and max_probe_every >= 1: {self.probe_overhead}, "
                f"{self.max_probe_every}"
            )

    @property
    def needs_length_head(self) -> bool:
        return self.estimator == "length_head"

    @property
    def needs_accept_head(self) -> bool:
        return self.estimator == "head"

    @property
    def may_skip(self) -> bool:
        return self.skip_draft

    def validate(self, *, buckets, has_length_head, fills=(), tree=None):
        if tree is not None and self.estimator not in TREE_ESTIMATORS:
            raise PolicyError(
                f"goodput's {self.estimator!r} estimator scores chain positions; a draft "
                f"tree's nodes carry their own scores (path probability, or the head's with "
                f"a tree TOPKxNODES@head): use estimator 'confidence'"
            )
        if tree is not None and not fills:
            raise PolicyError("goodput over draft trees fills packed verify's token buckets")
        unknown = [f for f in fills if f not in self.cost.fills]
        if unknown:
            raise PolicyError(
                f"packed verify's token buckets per slot {tuple(fills)} need the cost table's "
                f"packed form at each; it has fills {self.cost.fills}, missing {unknown}"
            )
        missing = [w for w in buckets if w not in self.cost.widths]
        if missing:
            raise PolicyError(
                f"verify-cost table has widths {self.cost.widths}, missing buckets {missing}"
            )
        if (self.needs_length_head or self.needs_accept_head) and not has_length_head:
            raise PolicyError(f"goodput with estimator {self.estimator!r} needs a length head")
        if self.skip_draft and 1 not in buckets:
            raise PolicyError(
                f"goodput's undrafted (plain) step verifies width 1, which is not among the "
                f"buckets {buckets}; add 1 or pass skip_draft=False"
            )

    def init(self, slots: Slots, previous: GoodputState | None = None):
        """Nothing without the skip arm. With it, from what an earlier call learnt (`previous`:
        its prior and engine-wide γ, unless nothing or non-finite); a learnt state waits for
        the probe interval before its first probe, a fresh one probes at once (`speculate`)."""
        if not self.skip_draft:
            return ()
        b, n = slots.count, slots.nodes
        prior, log_gamma = np.full((n,), -1.0, np.float32), np.float32(0.0)
        if previous is not None:
            p, lg = jax.device_get((previous.prior_Y, previous.log_gamma))
            if p.size != n:
                raise ValueError(f"previous state has {p.size} nodes, not the engine's {n}")
            if p[0] >= 0 and np.all(np.isfinite(p)) and np.isfinite(lg):
                prior, log_gamma = p, lg
        return GoodputState(
            est_BxY=jnp.ones((b, n), jnp.float32),
            prior_Y=jnp.asarray(prior, jnp.float32),
            log_gamma_B=jnp.zeros((b,), jnp.float32),
            log_gamma=jnp.asarray(log_gamma, jnp.float32),
        )

    def _tokens_per_ms(self, s_BxY, log_gamma, active_B, buckets, extra_ms=0.0):
        """Expected committed tokens per ms of a drafted step at each bucket [NW], summed over
        the active rows."""
        gain_BxNW = expected_committed(s_BxY, buckets, log_gamma)
        total_NW = jnp.sum(jnp.where(active_B[:, None], gain_BxNW, 0.0), axis=0)
        num_running = jnp.sum(active_B.astype(jnp.int32))
        return total_NW / (self.cost.step_ms(num_running, buckets) + extra_ms)

    def _packed_options(self, s_BxY, log_gamma, active_B, token_buckets, extra_ms=0.0):
        """Packed verify: per token bucket M [NM], the expected committed tokens per ms when
        the active rows share M tokens, each row's extra tokens going to the largest
        survivals over all rows; with the extra-token budget per M [NM] and each (row, node)'s
        rank among them [B, Y] (rank < budget: taken; an empty node, survival 0, ranks after
        every real one and its row's taken count stops before it)."""
        b = active_B.shape[0]
        inc_BxY = jnp.where(active_B[:, None], calibrated(s_BxY, log_gamma), -1.0)
        order = jnp.argsort(-inc_BxY.reshape(-1), stable=True)
        sorted_BY = jnp.maximum(inc_BxY.reshape(-1)[order], 0.0)
        best_sums = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(sorted_BY)])
        n = jnp.sum(active_B.astype(jnp.int32))
        tokens_NM = jnp.asarray(token_buckets, jnp.int32)
        budget_NM = jnp.clip(tokens_NM - n, 0, sorted_BY.shape[0])
        fills = tuple(p // b for p in token_buckets)
        rate_NM = (n + best_sums[budget_NM]) / (self.cost.packed_step_ms(n, fills) + extra_ms)
        rank_BxY = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
        return rate_NM, budget_NM, rank_BxY.reshape(inc_BxY.shape)

    def _best_rate(self, s_BxY, log_gamma, active_B, buckets, token_buckets, extra_ms=0.0):
        """The best drafted step's expected committed tokens per ms (scalar)."""
        if token_buckets:
            rate_NM, _, _ = self._packed_options(
                s_BxY, log_gamma, active_B, token_buckets, extra_ms
            )
            return jnp.max(rate_NM)
        return jnp.max(self._tokens_per_ms(s_BxY, log_gamma, active_B, buckets, extra_ms))

    def widths(self, draft: Draft, state):
        s_BxY = survival(draft, self.estimator)
        log_gamma = state.log_gamma_B if self.skip_draft else 0.0
        if draft.token_buckets:
            rate_NM, budget_NM, rank_BxY = self._packed_options(
                s_BxY, log_gamma, draft.active_B, draft.token_buckets
            )
            taken_BxY = rank_BxY < budget_NM[jnp.argmax(rate_NM)]
            if draft.tree is not None:  # a prefix of the row's real nodes
                taken_BxY &= jnp.arange(s_BxY.shape[1])[None, :] < draft.tree.size_B[:, None]
            width_B = 1 + jnp.sum(taken_BxY.astype(jnp.int32), axis=1)
        else:
            best = jnp.argmax(self._tokens_per_ms(s_BxY, log_gamma, draft.active_B, draft.buckets))
            width_B = jnp.full(draft.active_B.shape, jnp.asarray(draft.buckets)[best], jnp.int32)
        return width_B, state.refreshed(s_BxY, draft.active_B) if self.skip_draft else state

    def observe(self, outcome: Outcome, state):
        """Admitted rows start from the engine-wide estimate (1 before any drafter forward)
        and γ (their deferred context and probe are of the old request); verified rows'
        realised acceptance calibrates their estimates."""
        if not self.skip_draft:
            return state
        if outcome.started_B is not None:
            new_B = outcome.started_B
            fresh_Y = jnp.where(state.prior_Y < 0, 1.0, state.prior_Y)
            state = state.replace(
                est_BxY=jnp.where(new_B[:, None], fresh_Y, state.est_BxY),
                log_gamma_B=jnp.where(new_B, state.log_gamma, state.log_gamma_B),
            )
        if outcome.verified_B is not None:
            rows_B, engine = update(
                state.log_gamma_B,
                state.log_gamma,
                state.est_BxY,
                outcome.width_B,
                outcome.accepted_B,
                outcome.verified_B,
            )
            state = state.replace(log_gamma_B=rows_B, log_gamma=engine)
        return state

    # ---- the skip arm's decisions (the engine asks them between steps) --------------------
    def _rates(self, state, active_B, buckets, token_buckets, switching: bool):
        """(best drafted, plain) expected committed tokens per ms over the active rows."""
        extra_ms = self.cost.switch_ms / self.switch_horizon if switching else 0.0
        drafted = self._best_rate(
            state.est_BxY, state.log_gamma_B, active_B, buckets, token_buckets, extra_ms
        )
        num_running = jnp.sum(active_B.astype(jnp.int32))
        return drafted, num_running / self.cost.verify_step_ms(num_running, (1,))[0]

    def speculate(self, state, active_B, *, undrafted, switching, buckets, token_buckets=()):
        """Drafts when drafting's best expected tokens per ms, from the rows' latest
        estimates, beats a plain step (always, without the arm). From the undrafted loop
        (`switching`) each drafted step is charged its share of the host switch over
        `switch_horizon` steps, so marginal gains do not flip programs back and forth
        (charging one step the whole switch kept goodput from ever drafting). A probe is due
        at once before any drafter forward, else after `probe_interval` undrafted steps."""
        del undrafted  # the interval counts from the latest forward; the engine keeps count
        if not self.skip_draft:
            return Decision(draft=jnp.asarray(True), probe_in=jnp.asarray(NEVER, jnp.int32))
        drafted_rate, plain_rate = self._rates(state, active_B, buckets, token_buckets, switching)
        interval = self.probe_interval(
            state, active_B, buckets=buckets, token_buckets=token_buckets
        )
        fresh = state.prior_Y[0] < 0
        return Decision(draft=drafted_rate > plain_rate, probe_in=jnp.where(fresh, 0, interval))

    def drafting_gain(self, state, active_B, *, buckets, token_buckets=()):
        """Best drafted / plain rate from the undrafted program (switch included): > 1 where it
        would start drafting (float32 scalar; 0 with no active row)."""
        drafted, plain = self._rates(state, active_B, buckets, token_buckets, True)
        return jnp.where(plain > 0, drafted / jnp.maximum(plain, 1e-9), 0.0)

    def probe_interval(self, state, active_B, *, buckets, token_buckets=()) -> jax.Array:
        """Undrafted steps before the next probe (int32 scalar)."""
        if self.probe_every is not None:
            return jnp.asarray(self.probe_every, jnp.int32)
        gain = self.drafting_gain(state, active_B, buckets=buckets, token_buckets=token_buckets)
        return self.interval_at_gain(gain, jnp.sum(active_B.astype(jnp.int32)))

    def interval_at_gain(self, gain, num_running) -> jax.Array:
        """A probe is one drafter forward without a verify (the table's draft time). The base
        interval keeps probes within `probe_overhead` of the plain steps' time; it is scaled by
        2·(1 − gain), clipped to [1/8, 2]: a row set where drafting nearly pays is probed up to
        8x as often (each graded probe also calibrates the estimates), one far from it half as
        often."""
        plain_ms = self.cost.verify_step_ms(num_running, (1,))[0]
        probe_ms = self.cost.draft_step_ms(num_running)
        urgency = jnp.clip(2.0 * (1.0 - gain), 1.0 / 8.0, 2.0)
        steps = jnp.ceil(urgency * probe_ms / (self.probe_overhead * plain_ms))
        return jnp.clip(steps, 1, self.max_probe_every).astype(jnp.int32)
