"""Where training blocks start (anchors) and what each block position learns (docs/design.md §4.1).

Dimensions: B batch, S sequence length, N anchors per sequence, K block size, P = K−1.

A sequence is prompt + response + padding; `loss_mask[s]` is 1 exactly on response tokens.
Anchors are drawn uniformly without replacement (host-side NumPy, so a run is reproducible
from (seed, epoch, example)) from the positions one of the `ANCHOR_RULES` admits:

- "response" (stage 1 and stage 2, the reference): a is a response position, a ≤ S−K (the
  whole block fits) and its first label a+1 is a response token; later labels past the
  response end are masked out.
- "visited" (a stage-2 ablation, not the reference): "response" positions where the drafter
  really started a block during on-policy collection.
- "sequence" (the reference's offline length-head init): K ≤ a < len−K over the whole
  non-padding sequence, prompt included; its labels are the sequence's own tokens.

A sequence with fewer admissible positions than N fills the rest with padding blocks marked
invalid.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

ANCHOR_RULES = ("response", "visited", "sequence")


def admissible(loss_mask_S: np.ndarray, block_size: int) -> np.ndarray:
    """Bool [S]: response positions that may start a training block ("response" rule)."""
    m = np.asarray(loss_mask_S, bool)
    s = m.shape[0]
    ok = np.zeros(s, bool)
    last = s - block_size  # a ≤ S−K
    if last >= 0:
        a = np.arange(last + 1)
        ok[a] = m[a] & m[a + 1]
    return ok


def sequence_length(loss_mask_S: np.ndarray) -> int:
    """Non-padding tokens of a prompt + response row: one past its last response token."""
    m = np.asarray(loss_mask_S, bool)
    return int(m.shape[0] - np.argmax(m[::-1])) if m.any() else 0


def sequence_mask(loss_mask_S: np.ndarray) -> np.ndarray:
    """Bool [S]: every non-padding token (the "sequence" rule's label mask)."""
    return np.arange(len(loss_mask_S)) < sequence_length(loss_mask_S)


def admissible_by_rule(
    loss_mask_S: np.ndarray, block_size: int, rule: str, visited: np.ndarray | None = None
) -> np.ndarray:
    """Bool [S]: the positions `rule` admits (see the module docstring)."""
    if rule not in ANCHOR_RULES:
        raise ValueError(f"unknown anchor rule {rule!r}; choose from {ANCHOR_RULES}")
    if rule == "sequence":
        ok = np.zeros(len(loss_mask_S), bool)
        ok[block_size : max(sequence_length(loss_mask_S) - block_size, block_size)] = True
        return ok
    ok = admissible(loss_mask_S, block_size)
    if rule == "visited":
        if visited is None:
            raise ValueError("the 'visited' anchor rule needs recorded block starts")
        keep = np.zeros_like(ok)
        c = np.asarray(visited, np.int64)
        keep[c[(c >= 0) & (c < ok.shape[0])]] = True  # −1 pads and stray starts drop
        ok &= keep
    return ok


def sample_anchors(
    ok_S: np.ndarray, num_anchors: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(anchors [N] int32 sorted, valid [N] bool): N of the admissible positions `ok_S`,
    uniformly without replacement; fewer admissible positions leave invalid padding."""
    pool = np.flatnonzero(ok_S)
    anchors = np.zeros(num_anchors, np.int32)
    valid = np.zeros(num_anchors, bool)
    if pool.size > num_anchors:
        pool = rng.choice(pool, size=num_anchors, replace=False)
    pool = np.sort(pool)
    anchors[: pool.size] = pool
    valid[: pool.size] = True
    return anchors, valid


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """Anchor RNG of one example in one epoch: resampled every epoch, order-independent."""
    return np.random.default_rng([seed, epoch, index])


def block_targets(tokens_BxS, loss_mask_BxS, anchors_BxN, valid_BxN, block_size: int):
    """Labels and masks of every block position → (labels [B,N,P], mask [B,N,P],
    teacher_pos [B,N,P]).

    Block position k (1..K−1) predicts the token at ℓ = a + k; the teacher's distribution
    for it is the target's output at ℓ − 1, so `teacher_pos = ℓ − 1`.
    """
    s = tokens_BxS.shape[1]
    k_P = jnp.arange(1, block_size, dtype=jnp.int32)
    label_pos_BxNxP = anchors_BxN[..., None].astype(jnp.int32) + k_P
    in_range = label_pos_BxNxP < s
    safe = jnp.minimum(label_pos_BxNxP, s - 1)
    b, n, p = safe.shape
    flat = safe.reshape(b, n * p)
    labels = jnp.take_along_axis(tokens_BxS, flat, axis=1).reshape(b, n, p)
    on_resp = jnp.take_along_axis(loss_mask_BxS.astype(bool), flat, axis=1).reshape(b, n, p)
    mask = on_resp & in_range & valid_BxN[..., None]
    return labels, mask, safe - 1
