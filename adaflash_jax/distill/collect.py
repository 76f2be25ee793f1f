"""On-policy collection and τ measurement: which blocks the drafter drafts, how much is accepted.

Dimensions: B sequences, S sequence length, T max steps per row, K block
size, P = K−1, V vocab.

Two backends give the same per-step record (anchor position, accepted drafts):

- "engine": real speculative decoding with `decode.slots.SpeculativeEngine` (helper
  module of the serving path) on the prompts; works at any collection temperature.
- "replay": greedy only. Greedy speculative decoding is lossless, so its output IS the
  target's greedy response, and every step's outcome is a function of that response: the
  drafter, anchored at the last committed token a with the target's features of every
  position before a, drafts a+1..a+K−1 and the target accepts the leading drafts equal to
  its own argmax. Replay runs the target once over the whole sequences, then walks every
  row's chain a → a + A(a) + 1 in one on-device loop that drafts one block per row per
  iteration (the training path, `train_hidden`, with N = 1). `tests/test_collect.py` checks
  it against a step-by-step cached speculative decode and against the serving engine.

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
from adaflash_jax.distill.shapes import slot_capacity


@dataclasses.dataclass(frozen=True)
class Trajectory:
    anchors: np.ndarray  # [steps] block start positions (absolute, in the sequence)
    accepted: np.ndarray  # [steps] accepted drafts per step (bonus not included)
    head_r: np.ndarray | None = None  # [steps] the length head's r per block (replay, head=True)

    @property
    def tau(self) -> float:
        return float(np.mean(self.accepted + 1)) if len(self.accepted) else float("nan")


@functools.partial(
    jax.jit, static_argnames=("d_graph", "t_graph", "block_size", "layers", "max_steps", "head")
)
def _chains(d_graph, d_params, t_graph, t_params, tokens_BxS, loss_mask_BxS, start_B, end_B,
            *, block_size, layers, max_steps, head=False):  # fmt: skip
    """Greedy speculative steps of every row, walked on device → (anchors [B, T], accepted
    [B, T], steps [B], head r [B, T]) with T = max_steps; r (the length head's output for
    each drafted block) is computed only with `head`, zeros otherwise.

    The target runs ONCE over the whole sequences (its features of every position, its argmax
    at every position); each loop iteration drafts one block per row at the row's current
    anchor (the training path with N = 1) and advances the anchor by accepted + 1.
    """
    target = nnx.merge(t_graph, t_params)
    out = target(tokens_BxS, feature_layers=layers, compute_logits=False)
    best_BxS = jnp.argmax(target.logits(out.hidden_BxTxD), axis=-1)
    emb_VxD, head_DxV = target.embedding_VxD(), target.lm_head_DxV()
    drafter = nnx.merge(d_graph, d_params)
    b = tokens_BxS.shape[0]
    rows_B = jnp.arange(b)

    def body(carry):
        a_B, n_B, anchors_BxT, accepted_BxT, r_BxT = carry
        active_B = a_B < end_B
        anchors_Bx1, valid_Bx1 = a_B[:, None], active_B[:, None]
        hidden = drafter.train_hidden(
            out.features_BxTxnD, tokens_BxS, anchors_Bx1, valid_Bx1, emb_VxD
        )
        draft_Bx1xP = jnp.argmax(drafter.logits(hidden[:, :, 1:], head_DxV), axis=-1)
        _, mask_Bx1xP, tpos_Bx1xP = block_targets(
            tokens_BxS, loss_mask_BxS, anchors_Bx1, valid_Bx1, block_size
        )
        want_Bx1xP = jnp.take_along_axis(best_BxS, tpos_Bx1xP[:, 0], axis=1)[:, None]
        # Past the response (or the sequence) the mask stops the streak: never a match there.
        acc_B = accepted_streak(draft_Bx1xP, want_Bx1xP, mask_Bx1xP)[:, 0]
        slot_B = jnp.where(active_B, n_B, max_steps)  # inactive rows write nowhere
        anchors_BxT = anchors_BxT.at[rows_B, slot_B].set(a_B, mode="drop")
        accepted_BxT = accepted_BxT.at[rows_B, slot_B].set(acc_B, mode="drop")
        if head:  # the block's final-normed states, all K positions (as the head trains)
            r_BxT = r_BxT.at[rows_B, slot_B].set(drafter.length_head(hidden[:, 0]), mode="drop")
        a_B = jnp.where(active_B, a_B + acc_B + 1, a_B)
        return a_B, n_B + active_B.astype(jnp.int32), anchors_BxT, accepted_BxT, r_BxT

    init = (
        start_B,
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b, max_steps), jnp.int32),
        jnp.zeros((b, max_steps), jnp.int32),
        jnp.zeros((b, max_steps), jnp.float32),
    )
    _, n_B, anchors_BxT, accepted_BxT, r_BxT = jax.lax.while_loop(
        lambda c: jnp.any(c[0] < end_B), body, init
    )
    return anchors_BxT, accepted_BxT, n_B, r_BxT


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
    progress: bool = True,
    head: bool = False,
) -> list[Trajectory]:
    """Greedy speculative-decoding trajectories of every sequence of `data` (see module doc).

    `span` (≥ the longest response, e.g. max new tokens) bounds the steps per row, so every
    dataset of one run shares one compiled program. With `head` each trajectory also carries
    the length head's r of every block it drafted (`Trajectory.head_r`).
    """
    from tqdm.auto import tqdm

    d_graph, d_params = drafter_split
    t_graph, t_params = target_split
    trajectories = []
    starts = range(0, len(data), batch_size)
    for lo in tqdm(
        starts, desc=desc, disable=not progress or jax.process_index() != 0, leave=False
    ):
        idx = np.arange(lo, min(lo + batch_size, len(data)))
        pad = np.concatenate([idx, np.full(batch_size - len(idx), idx[0])])  # fixed shape
        tokens, mask = data.tokens[pad], data.loss_mask[pad]
        has = mask.any(axis=1)
        start_B = np.where(has, np.argmax(mask, axis=1), 0).astype(np.int32)
        last_B = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
        end_B = np.where(has, last_B, 0).astype(np.int32)  # the block at `end` never runs
        anchors_BxT, accepted_BxT, n_B, r_BxT = jax.device_get(
            _chains(
                d_graph,
                d_params,
                t_graph,
                t_params,
                jnp.asarray(tokens),
                jnp.asarray(mask),
                jnp.asarray(start_B),
                jnp.asarray(end_B),
                block_size=block_size,
                layers=tuple(feature_layers),
                max_steps=span,
                head=head,
            )
        )
        for row in range(len(idx)):
            n = int(n_B[row])
            r = r_BxT[row, :n] if head else None
            trajectories.append(
                Trajectory(anchors_BxT[row, :n].astype(np.int32), accepted_BxT[row, :n], r)
            )
    return trajectories


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
    rows=None,
) -> tuple[list[list[int]], list[Trajectory]]:
    """Real speculative decoding (full block every step) → (responses, trajectories).

    Step j of a request is anchored at prompt_len + Σ_{i<j} (accepted_i + 1): the position of
    the bonus token it drafts from.
    """
    from adaflash_jax.decode.slots import SpeculativeEngine

    k = drafter.config.block_size
    capacity = slot_capacity(max(len(p) for p in prompt_ids), max_new_tokens, k)
    engine = SpeculativeEngine(
        target,
        drafter,
        slots=slots,
        capacity=capacity,
        temperature=temperature,
        seed=seed,
        eos_ids=eos_ids,
        rows=rows,
    )
    results = engine.generate([(p, max_new_tokens) for p in prompt_ids])
    responses, trajectories = [], []
    for prompt, res in zip(prompt_ids, results, strict=True):
        accepted = np.asarray(res.accepted, np.int32)
        anchors = len(prompt) + np.concatenate([[0], np.cumsum(accepted + 1)[:-1]])
        responses.append(list(res.output_ids))
        trajectories.append(Trajectory(anchors.astype(np.int32)[: len(accepted)], accepted))
    return responses, trajectories
