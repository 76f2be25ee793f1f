"""The speculative engine's state and static spec (docs/design.md §5.1).

Dimensions: B slots, S cache capacity (also each slot's output and statistics buffers), E
eos ids, K block size, W verify width (a bucket), M verify tokens (a token bucket), U
deferred context positions, nD concatenated target features, Y a row's draft nodes (a
tree's, or a chain's K − 1 positions).

Invariants of a live slot b: `bonus_B[b]` is the last committed token; neither its target
entries nor its features exist yet, so `target_cache.lengths[b]` is its position, and
`context_cache.lengths[b] + undrafted.pending_B[b]` too (undrafted steps defer their
tokens' context entries: `Undrafted`). Finished and free slots ride along masked: nothing
they compute is committed. The plain path (`drafter is None`) uses the same state with width
1 and no drafter context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from adaflash_jax.decode import acceptance
from adaflash_jax.decode.policy import FixedPolicy, LengthPolicy
from adaflash_jax.decode.tree import TreeShape
from adaflash_jax.model.cache import Cache
from adaflash_jax.sharding.rows import RowLayout


@struct.dataclass
class Undrafted:
    """What the undrafted loop (`decode/undrafted.py`) leaves for later: its steps' target
    features, projected into the drafter context in one batched pass (a flush), and the
    latest probe, graded against the tokens committed after it."""

    pending_BxUxnD: jax.Array  # target features not yet in the drafter context
    pending_B: jax.Array  # int32 positions held per row
    # the row's latest probe's draft nodes (a chain's greedy drafts as a one-child tree):
    probe_tokens_BxY: jax.Array  # int32 token
    probe_parent_BxY: jax.Array  # int32 verify-token index of the parent (0: the root)
    probe_depth_BxY: jax.Array  # int32 depth (K: an empty node)
    probe_at_B: jax.Array  # int32 the row's output length at that probe
    probe_live_B: jax.Array  # bool: that probe is of the row's current request, ungraded
    steps: jax.Array  # int32 scalar: undrafted steps since the rows' latest drafter forward
    probe_due_at: jax.Array  # int32 scalar: `steps` at which a probe is due

    @classmethod
    def create(cls, *, batch, block_size, nodes, pending, feature_dim, dtype) -> Undrafted:
        b = batch
        return cls(
            pending_BxUxnD=jnp.zeros((b, pending, feature_dim), dtype),
            pending_B=jnp.zeros((b,), jnp.int32),
            probe_tokens_BxY=jnp.zeros((b, nodes), jnp.int32),
            probe_parent_BxY=jnp.zeros((b, nodes), jnp.int32),
            probe_depth_BxY=jnp.full((b, nodes), block_size, jnp.int32),
            probe_at_B=jnp.zeros((b,), jnp.int32),
            probe_live_B=jnp.zeros((b,), bool),
            steps=jnp.zeros((), jnp.int32),
            probe_due_at=jnp.zeros((), jnp.int32),
        )

    def admitted(self, started_B) -> Undrafted:
        """Rows that took a new request defer nothing, and their probe is of the old one."""
        return self.replace(
            pending_B=jnp.where(started_B, 0, self.pending_B),
            probe_live_B=self.probe_live_B & ~started_B,
        )


@struct.dataclass
class SpecState:
    target_cache: Cache
    context_cache: Cache | None  # drafter context (None on the plain path)
    bonus_B: jax.Array  # int32 last committed token
    out_BxS: jax.Array  # int32 generated tokens, -1 past num_out
    num_out_B: jax.Array  # int32
    max_new_B: jax.Array  # int32
    done_B: jax.Array  # bool: finished or free
    started_B: jax.Array  # bool: prefilled since the policy last observed the row
    eos_E: jax.Array  # int32 eos ids (-1 pads, never matches)
    steps_B: jax.Array  # int32 verify steps of the slot's current request
    accepted_BxS: jax.Array  # int32 accepted drafts per step, -1 past steps
    width_BxS: jax.Array  # int32 verify width per step: the batch's bucket (padded), the
    # row's own width (packed)
    request_BxS: jax.Array  # int32 the row's requested width per step (0: undrafted)
    probes: jax.Array  # int32 scalar: drafter forwards that verified nothing (a policy's)
    verified: jax.Array  # int32 scalar: Σ over verify steps of the active rows' widths
    computed: jax.Array  # int32 scalar: Σ over verify steps of the tokens the target ran
    # (B·W padded, the token bucket M packed)
    undrafted: Undrafted  # deferred context entries and the latest probe
    policy_state: Any  # the length policy's own pytree (`LengthPolicy.init`)
    temperature: jax.Array  # float32 scalar
    top_p: jax.Array  # float32 scalar
    rng: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """Everything static about a compiled engine (hashable: a jit static argument)."""

    block_size: int  # K (1 on the plain path)
    buckets: tuple[int, ...]  # ascending verify widths within [1, K]
    # packed verify's ascending token buckets, the last >= B·max(buckets); (): padded verify
    token_buckets: tuple[int, ...] = ()
    greedy: bool
    nucleus: bool  # top_p < 1: sample through the sorted nucleus filter
    feature_layers: tuple[int, ...]
    policy: LengthPolicy = FixedPolicy()
    acceptance: Callable | None = None  # None → greedy_accept / rejection_accept
    rows: RowLayout | None = None  # slots split over mesh axes (None: every chip holds all)
    pending: int = 0  # U: undrafted steps whose context entries one flush commits
    tree: TreeShape | None = None  # draft trees of this shape (packed verify), None: chains

    def __post_init__(self):
        # A serving engine's buckets end at K (`bucket_set`); a spec whose largest bucket W
        # is below K verifies at most W tokens a step (a program pinned to one width).
        b = list(self.buckets)
        if not b or b != sorted(set(b)) or b[0] < 1 or b[-1] > self.block_size:
            raise ValueError(f"buckets {self.buckets} must ascend within [1, K={self.block_size}]")
        p = list(self.token_buckets)
        if p and (p != sorted(set(p)) or p[0] < 1):
            raise ValueError(f"token buckets {self.token_buckets} must ascend from >= 1")
        if self.tree is not None and not p:
            raise ValueError("draft trees verify packed: give token buckets")

    @property
    def packed(self) -> bool:
        return bool(self.token_buckets)

    @property
    def prefill_spec(self) -> EngineSpec:
        """Only what the prefill depends on, so engines that differ in policy, buckets or
        acceptance share prefill programs."""
        k = self.block_size
        return dataclasses.replace(
            self,
            buckets=(k,),
            token_buckets=(),
            policy=FixedPolicy(),
            acceptance=None,
            pending=0,
            tree=None,
        )

    def top_p(self, s: SpecState):
        return s.top_p if self.nucleus else None

    @property
    def accept_fn(self) -> Callable:
        """The token-wise acceptance rule (`decode/acceptance.py`)."""
        if self.acceptance is not None:
            return self.acceptance
        return acceptance.greedy_accept if self.greedy else acceptance.rejection_accept


def bucket_set(buckets, block_size: int) -> tuple[int, ...]:
    """The requested buckets clipped below K, with K itself always present."""
    return tuple(sorted({int(b) for b in buckets if 1 <= int(b) < block_size} | {block_size}))
