"""On-policy collection and τ measurement: which blocks the drafter drafts, how much is accepted.

Dimensions: B sequences, S sequence length, N anchors (every response position), K block
size, P = K−1, V vocab.

Two backends give the same per-step record (anchor position, accepted drafts):

- "engine": real speculative decoding with `decode.speculative.SpeculativeEngine` (helper
  module of the serving path) on the prompts; works at any collection temperature.
- "replay": greedy only. Greedy speculative decoding is lossless, so its output IS the
  target's greedy response, and every step's outcome is a function of that response: the
  drafter, anchored at the last committed token a with the target's features of every
  position before a, drafts a+1..a+K−1 and the target accepts the leading drafts equal to
  its own argmax. Replay computes the accepted streak at EVERY response position in one
  batched drafter forward (the training path, `train_hidden`) and then walks the chain
  a → a + A(a) + 1 on the host. `tests/test_collect.py` checks it against a step-by-step
  cached speculative decode.

τ counts the bonus token: τ = Σ (accepted + 1) / steps. The first response token comes from
the prefill and is not a step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.distill.anchors import block_targets
from adaflash_jax.distill.batches import SequenceData
from adaflash_jax.distill.losses import accepted_streak


@dataclasses.dataclass(frozen=True)
class Trajectory:
    anchors: np.ndarray  # [steps] block start positions (absolute, in the sequence)
    accepted: np.ndarray  # [steps] accepted drafts per step (bonus not included)

    @property
    def tau(self) -> float:
        return float(np.mean(self.accepted + 1)) if len(self.accepted) else float("nan")


@functools.partial(jax.jit, static_argnames=("d_graph", "t_graph", "block_size", "layers"))
def _streaks(d_graph, d_params, t_graph, t_params, tokens_BxS, loss_mask_BxS, anchors_BxN,
             valid_BxN, *, block_size, layers):  # fmt: skip
    """Accepted greedy streak of a block anchored at every given position → [B, N]."""
    target = nnx.merge(t_graph, t_params)
    out = target(tokens_BxS, feature_layers=layers, compute_logits=False)
    best_BxS = jnp.argmax(target.logits(out.hidden_BxTxD), axis=-1)
    drafter = nnx.merge(d_graph, d_params)
    hidden = drafter.train_hidden(
        out.features_BxTxnD, tokens_BxS, anchors_BxN, valid_BxN, target.embedding_VxD()
    )
    draft_BxNxP = jnp.argmax(drafter.logits(hidden[:, :, 1:], target.lm_head_DxV()), axis=-1)
    _, mask_BxNxP, tpos_BxNxP = block_targets(
        tokens_BxS, loss_mask_BxS, anchors_BxN, valid_BxN, block_size
    )
    b, n, p = tpos_BxNxP.shape
    want_BxNxP = jnp.take_along_axis(best_BxS, tpos_BxNxP.reshape(b, n * p), axis=1)
    # Positions past the sequence are clamped by block_targets; mask them, never match them.
    return accepted_streak(draft_BxNxP, want_BxNxP.reshape(b, n, p), mask_BxNxP)


def replay(
    drafter_split,
    target_split,
    data: SequenceData,
    *,
    block_size: int,
    feature_layers: Sequence[int],
    span: int,
    batch_size: int = 16,
    desc: str = "replay",
) -> list[Trajectory]:
    """Greedy speculative-decoding trajectories of every sequence of `data` (see module doc).

    `span` (≥ the longest response, e.g. max new tokens) fixes the anchor count, so every
    dataset shares one compiled program.
    """
    d_graph, d_params = drafter_split
    t_graph, t_params = target_split
    s = data.seq_len
    from tqdm.auto import tqdm

    trajectories = []
    starts = range(0, len(data), batch_size)
    for lo in tqdm(starts, desc=desc, disable=jax.process_index() != 0, leave=False):
        idx = np.arange(lo, min(lo + batch_size, len(data)))
        pad = np.concatenate([idx, np.full(batch_size - len(idx), idx[0])])  # fixed shape
        tokens, mask = data.tokens[pad], data.loss_mask[pad]
        start_B = np.argmax(mask, axis=1)
        pos_BxN = start_B[:, None] + np.arange(span)[None, :]
        valid_BxN = (pos_BxN < s) & np.take_along_axis(mask, np.minimum(pos_BxN, s - 1), 1)
        anchors_BxN = np.where(valid_BxN, pos_BxN, 0).astype(np.int32)
        streak_BxN = _streaks(
            d_graph,
            d_params,
            t_graph,
            t_params,
            jnp.asarray(tokens),
            jnp.asarray(mask),
            jnp.asarray(anchors_BxN),
            jnp.asarray(valid_BxN),
            block_size=block_size,
            layers=tuple(feature_layers),
        )
        streak_BxN = np.asarray(jax.device_get(streak_BxN))
        for row in range(len(idx)):
            streak_S = np.zeros(s, np.int64)
            ok = valid_BxN[row]
            streak_S[anchors_BxN[row][ok]] = streak_BxN[row][ok]
            trajectories.append(_walk(mask[row], streak_S))
    return trajectories


def _walk(loss_mask_S: np.ndarray, streak_S: np.ndarray) -> Trajectory:
    resp = np.flatnonzero(loss_mask_S)
    if resp.size < 2:
        return Trajectory(np.zeros(0, np.int32), np.zeros(0, np.int32))
    a, end = int(resp[0]), int(resp[-1])
    anchors, accepted = [], []
    while a < end:
        acc = min(int(streak_S[a]), end - a)
        anchors.append(a)
        accepted.append(acc)
        a += acc + 1
    return Trajectory(np.asarray(anchors, np.int32), np.asarray(accepted, np.int32))


def with_visited(data: SequenceData, trajectories: Sequence[Trajectory]) -> SequenceData:
    """The dataset plus each sequence's visited block starts (stage-2 anchors)."""
    width = max((len(t.anchors) for t in trajectories), default=0) or 1
    visited = np.full((len(data), width), -1, np.int32)
    for i, t in enumerate(trajectories):
        visited[i, : len(t.anchors)] = t.anchors
    tau = tau_by_domain(data, trajectories)
    return dataclasses.replace(data, visited=visited, meta={**data.meta, "tau": tau})


def tau_by_domain(data: SequenceData, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """τ = committed tokens per verify step, pooled over each domain's sequences."""
    out = {}
    for d, name in enumerate(data.domains):
        rows = [t for i, t in enumerate(trajectories) if data.domain[i] == d]
        steps = sum(len(t.accepted) for t in rows)
        tokens = sum(int(np.sum(t.accepted + 1)) for t in rows)
        out[name] = tokens / steps if steps else float("nan")
    return out


def engine_collect(
    target,
    drafter,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    slots: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[Trajectory]]:
    """Real speculative decoding (full block every step) → (responses, trajectories).

    Step j of a request is anchored at prompt_len + Σ_{i<j} (accepted_i + 1): the position of
    the bonus token it drafts from.
    """
    from adaflash_jax.decode.slots import SpeculativeEngine

    k = drafter.config.block_size
    capacity = max(len(p) for p in prompt_ids) + max_new_tokens + k
    capacity = -(-capacity // 16) * 16
    engine = SpeculativeEngine(
        target,
        drafter,
        slots=slots,
        capacity=capacity,
        policy="fixed",
        temperature=temperature,
        seed=seed,
        eos_ids=eos_ids,
    )
    results = engine.generate([(p, max_new_tokens) for p in prompt_ids])
    responses, trajectories = [], []
    for prompt, res in zip(prompt_ids, results, strict=True):
        accepted = np.asarray(res.accepted, np.int32)
        anchors = len(prompt) + np.concatenate([[0], np.cumsum(accepted + 1)[:-1]])
        responses.append(list(res.output_ids))
        trajectories.append(Trajectory(anchors.astype(np.int32)[: len(accepted)], accepted))
    return responses, trajectories
