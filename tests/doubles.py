"""Test doubles of the engine's pluggable parts, each implementing its protocol: a drafter
(`EngineDrafter`), length policies (`LengthPolicy`; one drives goodput's skip arm on a fixed
schedule), a deliberately biased acceptance rule, and a chat template that branches on
thinking mode as Qwen3 / Qwen3.5's do."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.policy import NEVER, Decision
from adaflash_jax.decode.tokens import logits_to_probs
from adaflash_jax.drafter.model import DraftOutput
from adaflash_jax.io.cost_table import VerifyCostTable
from adaflash_jax.model.cache import Cache
from adaflash_jax.model.kv_cache import KVEntries, KVLayer
from adaflash_jax.tokenizer import CHATML_TEMPLATE


class TableDrafter(nnx.Module):
    """Drafts by iterating a next-token table from the bonus token (content-based, so it
    works in any slot), with one-hot logits of `sharpness`: 20 → confidence ~1. With
    `runner_up_V`, a second guess per position (the runner-up table of the first guess
    before it) at logit `sharpness` − 1: a draft tree's sibling. No context: a one-entry
    cache whose lengths still move as the engine commits."""

    def __init__(self, config, next_V, sharpness: float = 20.0, runner_up_V=None):
        self.config = config
        self.table = nnx.Param(jnp.asarray(next_V, jnp.int32))
        self.runner_up = None if runner_up_V is None else nnx.Param(jnp.asarray(runner_up_V))
        self.length_head = None
        self.sharpness = sharpness

    def init_context_cache(self, batch, capacity, dtype=None):
        layer = KVLayer.create(batch=batch, capacity=1, kv_heads=1, head_dim=2, dtype=jnp.float32)
        return Cache.create([layer], batch=batch, capacity=capacity, dtype=jnp.float32)

    def context_entries(self, cache, features_BxTxnD):
        b, t, _ = features_BxTxnD.shape
        return (KVEntries(jnp.zeros((b, t, 1, 2)), jnp.zeros((b, t, 1, 2))),)

    def draft(self, cache, bonus_B, embedding_VxD, lm_head_DxV):
        table, tok, drafts, seconds = self.table[...], bonus_B, [], []
        for _ in range(self.config.block_size - 1):
            if self.runner_up is not None:
                seconds.append(self.runner_up[...][tok])
            tok = table[tok]
            drafts.append(tok)
        v = embedding_VxD.shape[0]
        logits = self.sharpness * jax.nn.one_hot(jnp.stack(drafts, axis=1), v)
        if seconds:
            logits += (self.sharpness - 1) * jax.nn.one_hot(jnp.stack(seconds, axis=1), v)
        hidden = jnp.zeros((bonus_B.shape[0], self.config.block_size, self.config.hidden_size))
        return DraftOutput(hidden_BxKxD=hidden, logits_BxKm1xV=logits)


@dataclasses.dataclass(frozen=True)
class WobblePolicy:
    """A width that varies with the drafter's first logits (never the tokens sampled), to
    exercise every bucket."""

    name = "wobble"
    needs_length_head = False
    needs_accept_head = False
    may_skip = False

    def validate(self, **_):
        pass

    def init(self, slots, previous=None):
        return ()

    def widths(self, draft, state):
        top_B = jnp.argmax(draft.logits_BxKm1xV[:, 0], axis=-1)
        return (1 + top_B % draft.block_size).astype(jnp.int32), state

    def observe(self, outcome, state):
        return state

    def speculate(self, state, active_B, *, undrafted, switching, buckets, token_buckets=()):
        return Decision(draft=jnp.asarray(True), probe_in=jnp.asarray(NEVER, jnp.int32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftEveryNth:
    """`goodput`'s widths and estimates, but drafting once `n` undrafted steps ran, and no
    probes. The undrafted loop asks only between runs of steps (a flush, a probe or a
    finished row), so on an engine with `pending_steps=n` it drafts after every `n`."""

    goodput: GoodputPolicy
    n: int = 2
    name = "draft-every-nth"
    needs_length_head = False
    needs_accept_head = False
    may_skip = True

    def validate(self, **kw):
        self.goodput.validate(**kw)

    def init(self, slots, previous=None):
        return self.goodput.init(slots, previous)

    def widths(self, draft, state):
        return self.goodput.widths(draft, state)

    def observe(self, outcome, state):
        return self.goodput.observe(outcome, state)

    def speculate(self, state, active_B, *, undrafted, switching, buckets, token_buckets=()):
        return Decision(draft=undrafted >= self.n, probe_in=jnp.asarray(NEVER, jnp.int32))


def always_accept(key, next_M, q_MxV, logits_MxV, last_M, temperature, top_p):
    """DELIBERATELY BIASED: takes every draft, bonus sampled from p. Its output follows the
    drafter, not the target; the lossless tests must reject it."""
    p_MxV = logits_to_probs(logits_MxV, temperature, top_p)
    bonus_M = jax.random.categorical(key, jnp.log(p_MxV), axis=-1).astype(jnp.int32)
    return jnp.ones_like(last_M), bonus_M


# Qwen3 / Qwen3.5's generation prompt: with enable_thinking false, an empty think block
THINKING_TEMPLATE = CHATML_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)


def skip_cost_table(draft_ms: float) -> VerifyCostTable:
    """A verify-cost table whose drafter forward costs `draft_ms` against ~1 ms verifies:
    large values make goodput's skip arm run undrafted steps."""
    return VerifyCostTable(
        rows=(1, 8),
        widths=(1, 2, 4),
        verify_ms=((1.0, 1.1, 1.2), (1.0, 1.1, 1.2)),
        draft_ms=(draft_ms, draft_ms),
    )
