"""What the engine needs from a drafter, and the drafting half of a step.

Dimensions: B slots, K block size, D model, V vocab, T new tokens per row, S cache capacity,
Kv kv heads, Dh head dim, nD concatenated target features.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from adaflash_jax.decode import tree
from adaflash_jax.decode.policy import Draft
from adaflash_jax.decode.tokens import logits_to_probs
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.length_head import LengthHead
from adaflash_jax.drafter.model import DraftOutput
from adaflash_jax.model.cache import Cache


class EngineDrafter(Protocol):
    """The drafter as the engine uses it (an `nnx.Module`: it travels into `jax.jit` as a
    (graphdef, state) pair). `drafter.model.Drafter` is the real one; tests use doubles."""

    config: DrafterConfig  # block_size, target_layer_ids; validate_against(target config)
    length_head: LengthHead | None  # r, and per-position acceptance if it has that output

    def init_context_cache(self, batch: int, capacity: int, dtype=None) -> Cache:
        """An empty drafter context: a cache of one layer cache per drafter layer."""

    def context_entries(self, cache: Cache, features_BxTxnD) -> tuple:
        """Per-layer context entries of T committed tokens' features at `cache.positions(T)`,
        for `cache.commit` (the engine commits them)."""

    def draft(self, cache: Cache, bonus_B, embedding_VxD, lm_head_DxV) -> DraftOutput:
        """One block forward after each row's bonus token (at `cache.lengths`)."""


def draft(target, drafter: EngineDrafter, s, spec, key=None) -> Draft:
    """One drafter forward after each row's bonus token, as the policy sees it: block states,
    draft logits and the head outputs the policy reads, never a chain's sampled drafts; with
    `spec.tree` the rows' trees (sampled candidates drawn with `key`)."""
    d = drafter.draft(s.context_cache, s.bonus_B, target.embedding_VxD(), target.lm_head_DxV())
    hidden_BxKxD = jax.lax.stop_gradient(d.hidden_BxKxD)
    logits_BxKm1xV = d.logits_BxKm1xV.astype(jnp.float32)
    policy, active_B = spec.policy, ~s.done_B
    head_surrogate = spec.tree is not None and spec.tree.surrogate == "head"
    head_accept_BxKm1 = (
        drafter.length_head.accept_probs(hidden_BxKxD, logits_BxKm1xV)
        if policy.needs_accept_head or head_surrogate
        else None
    )
    return Draft(
        hidden_BxKxD=hidden_BxKxD,
        logits_BxKm1xV=logits_BxKm1xV,
        length_r_B=drafter.length_head(hidden_BxKxD) if policy.needs_length_head else None,
        head_accept_BxKm1=head_accept_BxKm1,
        active_B=active_B,
        num_running=jnp.sum(active_B.astype(jnp.int32)),
        buckets=spec.buckets,
        token_buckets=spec.token_buckets,
        tree=(
            None
            if spec.tree is None
            else draft_tree(key, logits_BxKm1xV, head_accept_BxKm1, s, spec)
        ),
    )


def draft_tree(key, logits_BxKm1xV, head_accept_BxKm1, s, spec) -> tree.Tree:
    """Greedy: each position's top-k by the drafter's distribution at temperature 1 (the
    one-hot limit would rank nothing). Sampled: k draws without replacement from the
    distribution drafts are sampled from (`draft_probs`), which the walk's rejection reads.
    Scored by the tree's surrogate (the head's: `head_accept_BxKm1`)."""
    k = spec.tree.topk
    if spec.greedy:
        scores, tokens = tree.top_candidates(jax.nn.log_softmax(logits_BxKm1xV, axis=-1), k)
    else:
        scores, tokens = tree.sampled_candidates(key, draft_probs(logits_BxKm1xV, s, spec), k)
    if spec.tree.surrogate == "head":
        scores = tree.head_scores(scores, head_accept_BxKm1)
    return tree.build(scores, tokens, spec.tree)


def draft_probs(logits_BxKm1xV, s, spec):
    """q [B, K−1, V]: the drafter's distribution at the sampling temperature and top-p."""
    b, km1, v = logits_BxKm1xV.shape
    q = logits_to_probs(logits_BxKm1xV.reshape(b * km1, v), s.temperature, spec.top_p(s))
    return q.reshape(b, km1, v)


def sample_drafts(key, logits_BxKm1xV, s, spec):
    """The drafts [B, K−1] int32 and the distribution q [B, K−1, V] they were sampled from
    (None when greedy: the argmax)."""
    if spec.greedy:
        return jnp.argmax(logits_BxKm1xV, axis=-1).astype(jnp.int32), None
    q_BxKm1xV = draft_probs(logits_BxKm1xV, s, spec)
    drafts_BxKm1 = jax.random.categorical(key, jnp.log(q_BxKm1xV), axis=-1).astype(jnp.int32)
    return drafts_BxKm1, q_BxKm1xV
