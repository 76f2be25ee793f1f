"""Length policies: how many tokens each row asks the target to verify (DESIGN §4.3, §5).

Dimensions: B slots, K block size, V vocab, D drafter width, NW number of width buckets.

A policy sees ONLY the drafter's forward pass of this step (block states, draft logits, the
length head's r and, later, a per-position acceptance output) plus batch occupancy, and
goodput also each row's calibration, which is learnt from EARLIER steps' committed tokens
(calibration.py). None of it depends on this step's samples, so rejection sampling stays
lossless under every policy.
It returns a requested width w_b in [1, K] per row (w = the bonus + w − 1 drafts); the engine
runs the batch at the smallest bucket >= the largest active request.

Policies are frozen dataclasses: hashable, so the engine passes them to `jax.jit` as static
arguments and each runs inside the jitted step.

The "don't speculate" arm (goodput with `skip_draft`): before drafting, `speculate` compares
the best expected rate of a draft + verify step against a plain target step (width 1, no
drafter forward), using each row's acceptance estimate from its LATEST drafter forward (stale
by one or more steps; a fresh request starts at the engine's running mean of drafted rows'
estimates, 1 before any draft). While it runs plain steps, the engine refreshes the estimates
every `probe_interval` steps with a probe: one drafter forward, no verify (graded later
against the tokens committed after it, which calibrates the row's estimates). That decision
depends only on earlier steps, never on this step's samples, so it is lossless too; an
undrafted step is exactly a plain decoding step.

Acceptance estimators (per-position acceptance probability a_i, i = 1..K−1, of draft i given
drafts < i were accepted), any of which feeds `goodput`:
- "confidence": a_i = max_x softmax(drafter logits_i)(x), the drafter's own top probability
  at temperature 1. For a calibrated drafter this is the chance its argmax is the target's.
- "length_head": r estimates (A + 1)/K (DESIGN §4.3), so the mean accepted streak is
  m = clip(r·K − 1, 0, K − 1). We assume a constant per-position rate a (a geometric profile)
  and solve Σ_{i=1}^{K−1} a^i = m for a by bisection.
- "head": a per-position acceptance vector [B, K−1] from any other source, e.g. a future
  length-head output trained against greedy match labels: the engine fills
  `PolicyInput.head_accept_BxKm1` from `drafter.length_head.accept_probs(hidden_BxKxD,
  logits_BxKm1xV)` when the drafter's head has that output (`has_accept_output`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.decode.calibration import accepted_at, accepted_by_width, calibrated
from adaflash_jax.decode.verify_cost import VerifyCostTable
from adaflash_jax.drafter.length_head import verify_length

ESTIMATORS = ("confidence", "length_head", "head")


class PolicyError(ValueError):
    """A policy that cannot run with this drafter, bucket set or cost table."""


@struct.dataclass
class PolicyInput:
    hidden_BxKxD: jax.Array  # drafter final-normed block states
    logits_BxKm1xV: jax.Array  # drafter logits for positions 1..K−1
    length_r_B: jax.Array | None  # length head r in (0, 1), when the policy asked for it
    head_accept_BxKm1: jax.Array | None  # per-position acceptance from a head, if any
    active_B: jax.Array  # bool: slot holds an unfinished request
    num_running: jax.Array  # int32 scalar: active slots this step
    # log of the rows' calibration exponent γ (estimates a ↦ a^γ), [B] or a scalar (0 =
    # trust the estimator); see calibration.py
    accept_log_gamma: jax.Array | float = 0.0


# ---- acceptance estimators -----------------------------------------------------------------
def confidence_accept_probs(logits_BxKm1xV: jax.Array) -> jax.Array:
    return jnp.max(jax.nn.softmax(logits_BxKm1xV.astype(jnp.float32), axis=-1), axis=-1)


def geometric_rate(mean_accepted_B: jax.Array, num_drafts: int, iters: int = 40) -> jax.Array:
    """Per-position rate a in [0, 1] with Σ_{i=1}^{n} a^i = mean (n = num_drafts), by bisection
    (the sum is increasing in a)."""
    powers_N = jnp.arange(1, num_drafts + 1, dtype=jnp.float32)
    target_B = jnp.clip(mean_accepted_B.astype(jnp.float32), 0.0, float(num_drafts))

    def body(_, lo_hi):
        lo_B, hi_B = lo_hi
        mid_B = 0.5 * (lo_B + hi_B)
        total_B = jnp.sum(mid_B[:, None] ** powers_N[None, :], axis=-1)
        too_big_B = total_B > target_B
        return jnp.where(too_big_B, lo_B, mid_B), jnp.where(too_big_B, mid_B, hi_B)

    lo_B, hi_B = jax.lax.fori_loop(
        0, iters, body, (jnp.zeros_like(target_B), jnp.ones_like(target_B))
    )
    return 0.5 * (lo_B + hi_B)


def length_head_accept_probs(r_B: jax.Array, block_size: int) -> jax.Array:
    a_B = geometric_rate(r_B * block_size - 1.0, block_size - 1)
    return jnp.broadcast_to(a_B[:, None], (r_B.shape[0], block_size - 1))


def accept_probs(inp: PolicyInput, estimator: str, block_size: int) -> jax.Array:
    if estimator == "confidence":
        return confidence_accept_probs(inp.logits_BxKm1xV)
    if estimator == "length_head":
        return length_head_accept_probs(inp.length_r_B, block_size)
    if inp.head_accept_BxKm1 is None:
        raise PolicyError("estimator 'head' needs a per-position acceptance head output")
    return inp.head_accept_BxKm1.astype(jnp.float32)


def expected_accepted(accept_BxKm1: jax.Array, widths_W) -> jax.Array:
    """E[accepted drafts | width W] = Σ_{i=1}^{W−1} Π_{j<=i} a_j for each W in `widths_W`
    (a tuple → [B, NW]; an int array [B] → [B], one width per row)."""
    if not isinstance(widths_W, tuple):
        return accepted_at(accept_BxKm1, widths_W)
    return accepted_by_width(accept_BxKm1)[:, jnp.asarray(widths_W) - 1]


def expected_committed(accept_BxKm1: jax.Array, widths: tuple[int, ...], log_gamma=0.0):
    """E[committed tokens | verify width W] = 1 + E[accepted | W] under the estimates
    calibrated as a^γ (log_gamma a scalar or one per row; see calibration.py) → [B, NW]."""
    return 1.0 + expected_accepted(calibrated(accept_BxKm1, log_gamma), widths)


def best_width_index(
    accept_BxKm1: jax.Array,
    active_B: jax.Array,
    step_ms_NW: jax.Array,
    widths: tuple[int, ...],
    log_gamma=0.0,
) -> jax.Array:
    """Index of the width maximising Σ_active E[committed | W] / step_ms(W) (ties → narrower)."""
    gain_BxNW = expected_committed(accept_BxKm1, widths, log_gamma)
    total_NW = jnp.sum(jnp.where(active_B[:, None], gain_BxNW, 0.0), axis=0)
    return jnp.argmax(total_NW / step_ms_NW).astype(jnp.int32)


# ---- policies --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedPolicy:
    """Always the whole block (DFlash)."""

    name = "fixed"
    needs_length_head = False

    def validate(self, *, buckets, slots, has_length_head):
        pass

    def widths(self, inp: PolicyInput, *, block_size: int, buckets: tuple[int, ...]):
        return jnp.full(inp.active_B.shape, block_size, jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaFlashPolicy:
    """Reference rule clamp(round(r·K·rate), 1, K), on only above `threshold` running rows."""

    rate: float = 1.3
    threshold: int = 48
    name = "adaflash"
    needs_length_head = True

    def validate(self, *, buckets, slots, has_length_head):
        if not has_length_head:
            raise PolicyError("the adaflash policy needs a drafter with a length head")

    def widths(self, inp: PolicyInput, *, block_size: int, buckets: tuple[int, ...]):
        head_B = verify_length(inp.length_r_B, block_size, self.rate)
        return jnp.where(inp.num_running > self.threshold, head_B, block_size).astype(jnp.int32)


class ReadsEstimator:
    """What a policy with an `estimator` field needs from the drafter's head."""

    estimator: str

    @property
    def needs_length_head(self) -> bool:
        return self.estimator == "length_head"

    @property
    def needs_accept_head(self) -> bool:
        return self.estimator == "head"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GoodputPolicy(ReadsEstimator):
    """One batch width per step maximising expected committed tokens per millisecond; with
    `skip_draft`, also a plain (undrafted) step when drafting is not expected to pay."""

    cost: VerifyCostTable
    estimator: str = "confidence"
    skip_draft: bool = True
    # Undrafted steps between probes (a drafter forward that refreshes the estimates). None:
    # as many as keep a probe's cost (the table's probe time, else its draft time) within
    # `probe_overhead` of the plain steps' time, capped at `max_probe_every`.
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

    def validate(self, *, buckets, slots, has_length_head):
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

    def decide(self, inp: PolicyInput, *, block_size: int, buckets: tuple[int, ...]):
        """(width_B, acceptance estimate [B, K−1]) of a drafted step."""
        a_BxKm1 = accept_probs(inp, self.estimator, block_size)
        step_ms_NW = self.cost.step_ms(inp.num_running, buckets)
        idx = best_width_index(a_BxKm1, inp.active_B, step_ms_NW, buckets, inp.accept_log_gamma)
        width_B = jnp.full(inp.active_B.shape, jnp.asarray(buckets, jnp.int32)[idx], jnp.int32)
        return width_B, a_BxKm1

    def widths(self, inp: PolicyInput, *, block_size: int, buckets: tuple[int, ...]):
        return self.decide(inp, block_size=block_size, buckets=buckets)[0]

    def probe_interval(
        self, num_running, buckets: tuple[int, ...], *, accept_BxKm1, active_B, log_gamma=0.0
    ) -> jax.Array:
        """Undrafted steps between probes (int32 scalar, traceable). A probe is one drafter
        forward without a verify: its cost is the table's measured probe time, else its draft
        time. The base interval keeps probes within `probe_overhead` of the plain steps'
        time; it is scaled by 2·(1 − g), clipped to [1/8, 2], where g is the latest
        estimates' drafting gain (`drafting_gain`): a row set where drafting nearly pays is
        probed up to 8x as often (each graded probe also calibrates the estimates), one far
        from it half as often."""
        if self.probe_every is not None:
            return jnp.asarray(self.probe_every, jnp.int32)
        plain_ms = self.cost.verify_step_ms(num_running, (1,))[0]
        probe_ms = self.cost.probe_step_ms(num_running)
        gain = self.drafting_gain(accept_BxKm1, active_B, buckets=buckets, log_gamma=log_gamma)
        urgency = jnp.clip(2.0 * (1.0 - gain), 1.0 / 8.0, 2.0)
        steps = jnp.ceil(urgency * probe_ms / (self.probe_overhead * plain_ms))
        return jnp.clip(steps, 1, self.max_probe_every).astype(jnp.int32)

    def _rates(self, accept_BxKm1, active_B, buckets, log_gamma, switching):
        """(best drafted, plain) expected committed tokens per ms over the active rows."""
        num_running = jnp.sum(active_B.astype(jnp.int32))
        gain_BxNW = expected_committed(accept_BxKm1, buckets, log_gamma)
        total_NW = jnp.sum(jnp.where(active_B[:, None], gain_BxNW, 0.0), axis=0)
        drafted_ms_NW = self.cost.step_ms(num_running, buckets)
        if switching:
            drafted_ms_NW = drafted_ms_NW + self.cost.switch_ms / self.switch_horizon
        drafted_rate = jnp.max(total_NW / drafted_ms_NW)
        plain_rate = num_running / self.cost.verify_step_ms(num_running, (1,))[0]
        return drafted_rate, plain_rate

    def drafting_gain(self, accept_BxKm1, active_B, *, buckets: tuple[int, ...], log_gamma=0.0):
        """Best drafted rate / plain rate as seen from the undrafted program (the switch
        included): > 1 where it would start drafting (float32 scalar; 0 with no active row)."""
        drafted, plain = self._rates(accept_BxKm1, active_B, buckets, log_gamma, True)
        return jnp.where(plain > 0, drafted / jnp.maximum(plain, 1e-9), 0.0)

    def speculate(
        self,
        accept_BxKm1,
        active_B,
        undrafted,
        *,
        buckets: tuple[int, ...],
        log_gamma=0.0,
        switching: bool = False,
    ):
        """Whether this step drafts (bool scalar): the best expected committed tokens per ms
        of draft + verify, from the rows' latest estimates (the last drafted step's or
        probe's), beats a plain width-1 step. `undrafted`: undrafted steps since the estimates
        were refreshed (unused here; the undrafted program asks only between runs of steps,
        so a policy reading it sees the count at a probe, flush or finished row).
        `switching`: asked from the undrafted program,
        where drafting first costs a host switch of programs (the table's `switch_ms`); the
        step is charged its share over `switch_horizon` drafted steps, so marginal gains do
        not flip programs back and forth. (Charging one step the whole switch kept goodput
        from ever drafting in math on the CPU, where a switch cost 2.7 plain steps and a
        drafted step 4: entering took 6.8 of the block's 8 tokens expected at once.)"""
        drafted_rate, plain_rate = self._rates(
            accept_BxKm1, active_B, buckets, log_gamma, switching
        )
        return drafted_rate > plain_rate


POLICY_NAMES = ("fixed", "adaflash", "goodput")


def make_policy(name: str, *, cost: VerifyCostTable | None = None, **kwargs):
    """Builds a policy by name; `goodput` needs a verify-cost table."""
    if name == "fixed":
        return FixedPolicy(**kwargs)
    if name == "adaflash":
        return AdaFlashPolicy(**kwargs)
    if name == "goodput":
        if cost is None:
            raise PolicyError("the goodput policy needs a verify-cost table (cost=...)")
        return GoodputPolicy(cost=cost, **kwargs)
    raise PolicyError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")
