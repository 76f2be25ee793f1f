"""Length policies: how many drafted tokens each row verifies (docs/design.md §4.3, §5).

Dimensions: B slots, K block size, V vocab, nD target features per committed token.

A policy is a pure-function triple in the manner of optax's transformations (`LengthPolicy`):
`init` makes its state (a pytree the engine carries as one opaque `SpecState.policy_state`,
as a train state carries `opt_state`), `widths` turns a drafter forward (`Draft`: its hidden
states and distributions, never the sampled drafts, so sampled decoding stays lossless) into
a requested width w_b in [1, K] per row (the bonus + w − 1 drafts; padded verify runs the
batch at the smallest bucket >= the largest active request, packed verify each row at its
own), and `observe` learns from what the engine
did (`Outcome`). Between steps the engine asks `speculate` (`Decision`): whether the next
step drafts, and how many undrafted steps may pass before the rows' estimates need a fresh
drafter forward (a probe). Only a policy with `may_skip` ever says no; the engine then runs
its undrafted loop (`decode/undrafted.py`). The engine owns every loop; a policy only
answers. Policies are frozen dataclasses: hashable, so they travel in the engine's static
spec into `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.decode.tree import NO_NODE, Tree
from adaflash_jax.drafter.length_head import SERVING_RATE, verify_length

PolicyState = Any  # a pytree: () for a policy without state


class PolicyError(ValueError):
    """A policy that cannot run with this drafter, bucket set or cost table."""


@dataclasses.dataclass(frozen=True)
class Slots:
    """The engine's slots as a policy sizes its state by them."""

    count: int  # B
    block_size: int  # K
    tree_nodes: int | None = None  # Y with draft trees (None: chains)

    @property
    def nodes(self) -> int:
        """N: the draft nodes a row may verify after its bonus (K − 1, or a tree's Y)."""
        return self.block_size - 1 if self.tree_nodes is None else self.tree_nodes


@struct.dataclass
class Draft:
    """One drafter forward after each row's bonus token, as a policy sees it."""

    hidden_BxKxD: jax.Array  # drafter final-normed block states (stop-gradient)
    logits_BxKm1xV: jax.Array  # float32 drafter logits for positions 1..K−1
    length_r_B: jax.Array | None  # length head r in (0, 1), when the policy reads it
    head_accept_BxKm1: jax.Array | None  # per-position acceptance from the head, if read
    active_B: jax.Array  # bool: the slot holds an unfinished request
    num_running: jax.Array  # int32 scalar: active slots
    # the engine's verify widths, and packed verify's token buckets (() padded), static
    buckets: tuple[int, ...] = struct.field(pytree_node=False, default=())
    token_buckets: tuple[int, ...] = struct.field(pytree_node=False, default=())
    # a draft tree per row (`decode/tree.py`; None: chains): a width is then the row's root
    # and its first w − 1 nodes, within [1, Y + 1]
    tree: Tree | None = None

    @property
    def block_size(self) -> int:
        return self.hidden_BxKxD.shape[1]

    @property
    def row_width(self) -> int:
        """The most tokens a row may verify: K, or a tree's Y + 1."""
        return self.block_size if self.tree is None else self.tree.tokens_BxY.shape[1] + 1


@struct.dataclass
class Outcome:
    """What the engine did with the rows since the policy's last decision: some took new
    requests (a prefill: their earlier state is stale), or their drafts were verified. The
    fields of the other kind are None."""

    started_B: jax.Array | None = None  # bool: took a new request
    verified_B: jax.Array | None = None  # bool: its draft was verified
    width_B: jax.Array | None = None  # int32: at the width it asked for, within [1, K]
    accepted_B: jax.Array | None = None  # int32: drafts accepted


@struct.dataclass
class Decision:
    """A policy's answer between steps."""

    draft: jax.Array  # bool scalar: the next step drafts
    probe_in: jax.Array  # int32 scalar: undrafted steps after the rows' latest drafter
    # forward before the next probe (0: at once)


NEVER = 2**30  # a probe interval that never comes
NOT_FOR_TREES = (
    "the {name} policy sizes chains; draft trees take the fixed policy (every row its whole "
    "tree: a per-row node budget), tree-batch (one node budget over the batch) or goodput "
    "(the token bucket or a plain step, by the cost table)"
)


class LengthPolicy(Protocol):
    """What the engine calls on a length policy."""

    name: str
    needs_length_head: bool  # `widths` reads Draft.length_r_B
    needs_accept_head: bool  # `widths` reads Draft.head_accept_BxKm1
    may_skip: bool  # `speculate` may answer "don't draft" (the engine's undrafted loop)

    def validate(
        self, *, buckets: tuple[int, ...], has_length_head: bool, fills: tuple = (), tree=None
    ) -> None:
        """Raises PolicyError for an engine it cannot serve (`fills`: packed verify's token
        buckets per slot, () when padded; `tree`: the engine's `TreeShape`, None: chains)."""

    def init(self, slots: Slots, previous: PolicyState | None = None) -> PolicyState:
        """A fresh state; `previous` is the state an earlier `generate` call ended with (a
        policy that learns across calls may start from it)."""

    def widths(self, draft: Draft, state: PolicyState) -> tuple[jax.Array, PolicyState]:
        """Requested widths [B] int32 in [1, K] (inactive rows: anything)."""

    def observe(self, outcome: Outcome, state: PolicyState) -> PolicyState: ...

    def speculate(
        self, state: PolicyState, active_B, *, undrafted, switching: bool, buckets, token_buckets
    ) -> Decision:
        """Between steps: `undrafted` (int32 scalar) undrafted steps ran since the rows'
        latest drafter forward; `switching`: asked from the undrafted loop."""


class Stateless:
    """A policy that keeps nothing, reads no acceptance output and always drafts."""

    needs_accept_head = False
    may_skip = False

    def validate(self, *, buckets, has_length_head, fills=(), tree=None):
        pass

    def init(self, slots: Slots, previous: PolicyState | None = None) -> PolicyState:
        return ()

    def observe(self, outcome: Outcome, state: PolicyState) -> PolicyState:
        return state

    def speculate(self, state, active_B, *, undrafted, switching, buckets, token_buckets):
        return Decision(draft=jnp.asarray(True), probe_in=jnp.asarray(NEVER, jnp.int32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedPolicy(Stateless):
    """Always the whole block (DFlash), or a tree's every node (a per-row node budget, as
    DDTree publishes); with `width`, that many tokens a row (at most the row's)."""

    width: int | None = None
    name = "fixed"
    needs_length_head = False

    def __post_init__(self):
        if self.width is not None and self.width < 1:
            raise PolicyError(f"the fixed policy's width must be >= 1, got {self.width}")

    def widths(self, draft: Draft, state):
        w = draft.row_width if self.width is None else min(self.width, draft.row_width)
        return jnp.full(draft.active_B.shape, w, jnp.int32), state


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaFlashPolicy(Stateless):
    """Reference rule clamp(round(r·K·rate), 1, K), on only above `threshold` running rows."""

    rate: float = SERVING_RATE
    threshold: int = 48
    name = "adaflash"
    needs_length_head = True

    def validate(self, *, buckets, has_length_head, fills=(), tree=None):
        if tree is not None:
            raise PolicyError(NOT_FOR_TREES.format(name=self.name))
        if not has_length_head:
            raise PolicyError("the adaflash policy needs a drafter with a length head")

    def widths(self, draft: Draft, state):
        k = draft.block_size
        head_B = verify_length(draft.length_r_B, k, self.rate)
        return jnp.where(draft.num_running > self.threshold, head_B, k).astype(jnp.int32), state


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeBatchPolicy(Stateless):
    """Draft trees with one node budget for the whole batch: `mean_nodes` × the running rows
    nodes go to the best nodes of every row at once, ranked by path probability (each row's
    nodes come best first, so a row takes a prefix of its tree): a confident row gets a deep
    tree, a hopeless one none (its step verifies its bonus alone). Σ of the ranked path
    probabilities is the expected accepted drafts, so no split of the budget expects more."""

    mean_nodes: float = 4.0
    name = "tree-batch"
    needs_length_head = False

    def validate(self, *, buckets, has_length_head, fills=(), tree=None):
        if tree is None:
            raise PolicyError("the tree-batch policy allocates tree nodes: give the engine a tree")
        if not 0 <= self.mean_nodes <= tree.nodes:
            raise PolicyError(
                f"tree-batch's mean_nodes {self.mean_nodes} must be within [0, the tree's "
                f"nodes per row {tree.nodes}]"
            )

    def widths(self, draft: Draft, state):
        logp_BxY = draft.tree.logp_BxY
        b, n = logp_BxY.shape
        budget = jnp.floor(self.mean_nodes * draft.num_running).astype(jnp.int32)
        live_BxY = (logp_BxY > NO_NODE / 2) & draft.active_B[:, None]
        score_P = jnp.where(live_BxY, logp_BxY, NO_NODE).reshape(-1)
        order_P = jnp.argsort(-score_P, stable=True)  # ties: the earlier row, then node
        rank_P = jnp.zeros_like(order_P).at[order_P].set(jnp.arange(b * n, dtype=order_P.dtype))
        taken_BxY = (rank_P < budget).reshape(b, n) & live_BxY
        return 1 + jnp.sum(taken_BxY.astype(jnp.int32), axis=1), state
