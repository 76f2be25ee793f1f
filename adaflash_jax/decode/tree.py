"""Draft trees from one block pass, and the walk that accepts along them (docs/design.md §5.6).

Dimensions: B slots, K block size, V vocab, Kc top candidates per position
(`TreeShape.topk`), Y tree nodes per row (`TreeShape.nodes`), W = Y + 1 a row's verify
tokens (the root: its bonus token, then its nodes), Yq candidate slots of the selection
(2Y + 1).

A DFlash block pass gives one distribution per draft position d = 1..K−1, and none depends
on the tokens drafted before it. So the candidates for a node at depth d are the Kc most
likely tokens of position d, whatever its parent, and a node's path probability is the
product of its path's per-position probabilities (the surrogate for the chance the target
accepts the whole path; `TreeShape.surrogate` "head" instead rescales the length head's
per-position acceptance of the top candidate by each candidate's probability relative to
it, `head_scores`). `build` selects the Y nodes of largest path probability best-first
(DDTree): each selected node offers two candidates, its first child (the best token one
position deeper) and its next sibling (its parent's next best token), so every node is
offered exactly once and no candidate beats the node that offered it. The selection is
prefix-closed (a parent is selected before its children) and in non-increasing order: the
first n nodes of a row are its best tree of n nodes, which is what a policy's budget takes.

A row's tree is packed with parent indices into its verify tokens (the root is token 0), so
a node's position is the row's length plus its depth (`model/packing.py` builds the ancestor
mask from them). `walk` accepts: each verified token has a target choice; from the root, the
walk moves to the child whose token is the choice where it stands, while there is one; the
choice where it stops is the new bonus. Greedy, the candidates are each position's top Kc
(`top_candidates`) and the choice is the target's argmax. Sampled, the candidates are Kc
draws without replacement from the drafter's q (`sampled_candidates`) and the choice is
recursive rejection over the node's children (`recursive_choice`), distributed as the
target's p. Either way each committed token is the target's own choice given the committed
ones before it, which is plain decoding: lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

NO_NODE = -1e30  # a log path probability no real node has (a slot the selection left empty)
SURROGATES = ("path", "head")  # a candidate's score: its log q, or the head's (`head_scores`)


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A static tree: `topk` candidates per position, `nodes` selected per row, ranked by
    `surrogate` (SURROGATES)."""

    topk: int
    nodes: int
    surrogate: str = "path"

    def __post_init__(self):
        if self.topk < 1 or self.nodes < 1:
            raise ValueError(f"a tree needs topk >= 1 and nodes >= 1, got {self}")
        if self.surrogate not in SURROGATES:
            raise ValueError(f"unknown tree surrogate {self.surrogate!r}; choose from {SURROGATES}")

    @property
    def row_width(self) -> int:
        """W: the root and the nodes."""
        return self.nodes + 1

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """'TOPKxNODES[@SURROGATE]', e.g. '2x16': 2 candidates per position, 16 nodes a row;
        '2x16@head': ranked by the length head's acceptance."""
        shape, _, surrogate = str(text).lower().partition("@")
        topk, sep, nodes = shape.partition("x")
        if not (sep and topk.strip().isdigit() and nodes.strip().isdigit()):
            raise ValueError(f"a tree is TOPKxNODES[@SURROGATE] (e.g. 2x16), got {text!r}")
        return cls(topk=int(topk), nodes=int(nodes), surrogate=surrogate.strip() or "path")

    def __str__(self) -> str:
        tail = "" if self.surrogate == "path" else f"@{self.surrogate}"
        return f"{self.topk}x{self.nodes}{tail}"


@struct.dataclass
class Tree:
    """Each row's selected nodes in selection order (node i of the row is verify token i + 1)."""

    tokens_BxY: jax.Array  # int32 drafted token
    parent_BxY: jax.Array  # int32 verify-token index of the parent (0: the root)
    depth_BxY: jax.Array  # int32 in [1, K − 1]
    logp_BxY: jax.Array  # float32 log path probability, non-increasing; NO_NODE: empty
    candidates_BxKm1xKc: jax.Array  # int32 each position's candidates, in verify order: a
    # node's children are the first of its children's position, in this order

    @property
    def size_B(self) -> jax.Array:
        """int32 [B]: the nodes selected (fewer than Y where the candidates ran out)."""
        return jnp.sum((self.logp_BxY > NO_NODE / 2).astype(jnp.int32), axis=1)

    def verify_tokens(self, bonus_B):
        """([B, W] the root then the nodes, [B, W] parents with the root its own)."""
        tokens_BxW = jnp.concatenate([bonus_B[:, None], self.tokens_BxY], axis=1)
        root_Bx1 = jnp.zeros_like(self.parent_BxY[:, :1])
        return tokens_BxW, jnp.concatenate([root_Bx1, self.parent_BxY], axis=1)


def top_candidates(logp_BxKm1xV, topk: int):
    """Greedy trees' candidates: per position the `topk` most likely tokens, best first, and
    their log probabilities (the scores)."""
    scores, tokens = jax.lax.top_k(logp_BxKm1xV.astype(jnp.float32), topk)
    return scores, tokens.astype(jnp.int32)


def sampled_candidates(key, q_BxKm1xV, topk: int):
    """Sampled trees' candidates: per position `topk` draws without replacement from q (the
    Gumbel top-k, in draw order: what `recursive_choice` verifies them in). Their scores are
    q's own top-k probabilities, which do not depend on the draws: the tree's shape (which
    ranks are verified) must not, or a rejection's residual would no longer be what the next
    draw is checked against. A rank q cannot fill (fewer tokens with mass, e.g. outside the
    nucleus) has no candidate (NO_NODE)."""
    log_q = jnp.log(q_BxKm1xV.astype(jnp.float32))
    gumbel = jax.random.gumbel(key, log_q.shape, jnp.float32)
    _, tokens = jax.lax.top_k(jnp.where(jnp.isfinite(log_q), log_q + gumbel, -jnp.inf), topk)
    top, _ = jax.lax.top_k(log_q, topk)
    scores = jnp.where(jnp.isfinite(top), top, NO_NODE)
    return scores, tokens.astype(jnp.int32)


def head_scores(scores_BxKm1xKc, accept_BxKm1):
    """The "head" surrogate: a candidate's score is log a_d + its log q − the top
    candidate's, a_d the head's acceptance at position d (so the top-1 chain's path score
    is the head's own survival estimate and a sibling's scales it by q's ratio). Like the
    scores it rescales, it never depends on a sampled tree's draws."""
    log_a_BxKm1 = jnp.log(jnp.clip(accept_BxKm1.astype(jnp.float32), 1e-6, 1.0))
    live = scores_BxKm1xKc > NO_NODE / 2
    rel = scores_BxKm1xKc - scores_BxKm1xKc[..., :1]
    return jnp.where(live, log_a_BxKm1[..., None] + rel, NO_NODE)


def build(scores_BxKm1xKc, tokens_BxKm1xKc, shape: TreeShape) -> Tree:
    """The Y best nodes per row by path score, a candidate's score being its position's
    log-probability estimate (`top_candidates`, `sampled_candidates`: non-increasing along
    the candidates of a position); one selection per node over at most 2Y + 1 candidates."""
    b, km1, c = scores_BxKm1xKc.shape
    n, q = shape.nodes, 2 * shape.nodes + 1
    top_logp_BxKm1xKc, top_tok_BxKm1xKc = scores_BxKm1xKc, tokens_BxKm1xKc
    rows_B = jnp.arange(b)

    def at(d_B, r_B):  # the r-th candidate's score at depth d (1-based)
        return top_logp_BxKm1xKc[rows_B, jnp.clip(d_B - 1, 0, km1 - 1), jnp.clip(r_B, 0, c - 1)]

    ones_B = jnp.ones((b,), jnp.int32)
    cand = dict(  # the candidates: offered by a selected node, not yet taken
        score_BxYq=jnp.full((b, q), NO_NODE, jnp.float32).at[:, 0].set(at(ones_B, 0 * ones_B)),
        parent_BxYq=jnp.zeros((b, q), jnp.int32),
        depth_BxYq=jnp.ones((b, q), jnp.int32),
        rank_BxYq=jnp.zeros((b, q), jnp.int32),
    )
    nodes = dict(
        tokens_BxY=jnp.zeros((b, n), jnp.int32),
        parent_BxY=jnp.zeros((b, n), jnp.int32),
        depth_BxY=jnp.ones((b, n), jnp.int32),
        logp_BxY=jnp.full((b, n), NO_NODE, jnp.float32),
    )

    def select(i, carry):
        cand, nodes = carry
        best_B = jnp.argmax(cand["score_BxYq"], axis=1)
        score_B = cand["score_BxYq"][rows_B, best_B]
        live_B = score_B > NO_NODE / 2  # a NO_NODE sum stays far below half of it
        parent_B, depth_B = cand["parent_BxYq"][rows_B, best_B], cand["depth_BxYq"][rows_B, best_B]
        rank_B = cand["rank_BxYq"][rows_B, best_B]
        token_B = top_tok_BxKm1xKc[rows_B, depth_B - 1, rank_B].astype(jnp.int32)
        nodes = dict(
            tokens_BxY=nodes["tokens_BxY"].at[:, i].set(token_B),
            parent_BxY=nodes["parent_BxY"].at[:, i].set(parent_B),
            depth_BxY=nodes["depth_BxY"].at[:, i].set(depth_B),
            logp_BxY=nodes["logp_BxY"].at[:, i].set(jnp.where(live_B, score_B, NO_NODE)),
        )
        # the node (verify token i + 1) offers its first child and its next sibling
        child_ok_B = live_B & (depth_B < km1)
        sibling_ok_B = live_B & (rank_B + 1 < c)
        child_B = score_B + at(depth_B + 1, 0 * rank_B)
        sibling_B = score_B - at(depth_B, rank_B) + at(depth_B, rank_B + 1)
        offers = (
            (2 * i + 1, jnp.where(child_ok_B, child_B, NO_NODE), i + 1, depth_B + 1, 0 * rank_B),
            (2 * i + 2, jnp.where(sibling_ok_B, sibling_B, NO_NODE), parent_B, depth_B, rank_B + 1),
        )
        score_BxYq = cand["score_BxYq"].at[rows_B, best_B].set(NO_NODE)
        parent_BxYq, depth_BxYq, rank_BxYq = (
            cand["parent_BxYq"],
            cand["depth_BxYq"],
            cand["rank_BxYq"],
        )
        for slot, s_B, p_B, d_B, r_B in offers:
            score_BxYq = score_BxYq.at[:, slot].set(s_B)
            parent_BxYq = parent_BxYq.at[:, slot].set(p_B)
            depth_BxYq = depth_BxYq.at[:, slot].set(d_B)
            rank_BxYq = rank_BxYq.at[:, slot].set(r_B)
        cand = dict(
            score_BxYq=score_BxYq,
            parent_BxYq=parent_BxYq,
            depth_BxYq=depth_BxYq,
            rank_BxYq=rank_BxYq,
        )
        return cand, nodes

    _, nodes = jax.lax.fori_loop(0, n, select, (cand, nodes))
    return Tree(**nodes, candidates_BxKm1xKc=top_tok_BxKm1xKc)


def walk(tokens_BxW, parent_BxW, target_BxW, width_B, max_depth: int):
    """Acceptance along each row's tree of its first `width_B[b]` verify tokens: from the
    root, the child whose token is the target token where the walk stands, `max_depth`
    times at most. Returns (accepted_B int32: drafts accepted, path_BxZ int32 [B, max_depth
    + 1]: the verify tokens walked, root first, the last repeated past the walk's end,
    bonus_B int32: the target token where it stopped)."""
    b, w = tokens_BxW.shape
    j_W = jnp.arange(w, dtype=jnp.int32)
    valid_BxW = (j_W[None] < width_B[:, None]) & (j_W[None] > 0)
    # child_BxWxW[b, i, j]: token j is the child of token i that the target token at i picks
    child_BxWxW = (
        valid_BxW[:, None, :]
        & (parent_BxW[:, None, :] == j_W[None, :, None])
        & (tokens_BxW[:, None, :] == target_BxW[:, :, None])
    )
    has_BxW = jnp.any(child_BxWxW, axis=2)
    next_BxW = jnp.where(has_BxW, jnp.argmax(child_BxWxW, axis=2), j_W[None]).astype(jnp.int32)
    rows_B = jnp.arange(b)
    at_B = jnp.zeros((b,), jnp.int32)
    path = [at_B]
    for _ in range(max_depth):
        at_B = next_BxW[rows_B, at_B]
        path.append(at_B)
    path_BxZ = jnp.stack(path, axis=1)
    accepted_B = jnp.sum((path_BxZ[:, 1:] != path_BxZ[:, :-1]).astype(jnp.int32), axis=1)
    return accepted_B, path_BxZ, target_BxW[rows_B, at_B]


def children(parent_BxW, width_B) -> jax.Array:
    """[B, W] int32: each verify token's children among the row's first `width_B[b]`."""
    w = parent_BxW.shape[1]
    j_W = jnp.arange(w, dtype=jnp.int32)
    valid_BxW = (j_W[None] < width_B[:, None]) & (j_W[None] > 0)
    child_BxWxW = valid_BxW[:, None, :] & (parent_BxW[:, None, :] == j_W[None, :, None])
    return jnp.sum(child_BxWxW.astype(jnp.int32), axis=2)


def recursive_choice(key, p_MxV, q_MxV, candidates_MxKc, children_M):
    """The target's choice at each verify token of a sampled tree: its children (the first
    `children_M` candidates, drawn from q without replacement, in draw order) are tried in
    turn, each kept with probability min(1, p(c)/q(c)); after a rejection p becomes
    norm(max(0, p − q)) and q loses the rejected token (renormalised: the next draw's law);
    the first kept child is the choice, else a draw from the last p. Distributed as p
    (docs/design.md §5.6), so the walk commits plain samples."""
    m, c = candidates_MxKc.shape
    keys = jax.random.split(key, c + 1)
    chosen_M, done_M = jnp.zeros((m,), jnp.int32), jnp.zeros((m,), bool)
    p, q = p_MxV, q_MxV
    for r in range(c):
        tok_M = candidates_MxKc[:, r]
        p_c = jnp.take_along_axis(p, tok_M[:, None], axis=1)[:, 0]
        q_c = jnp.take_along_axis(q, tok_M[:, None], axis=1)[:, 0]
        tried_M = (r < children_M) & ~done_M
        kept_M = tried_M & (jax.random.uniform(keys[r], (m,)) * q_c < p_c)
        chosen_M = jnp.where(kept_M, tok_M, chosen_M)
        done_M = done_M | kept_M
        rejected_M = (tried_M & ~kept_M)[:, None]
        residual = jnp.maximum(p - q, 0.0)
        mass = jnp.sum(residual, axis=1, keepdims=True)
        p = jnp.where(rejected_M & (mass > 1e-12), residual / jnp.maximum(mass, 1e-30), p)
        q_left = q.at[jnp.arange(m), tok_M].set(0.0)
        q_left = q_left / jnp.maximum(jnp.sum(q_left, axis=1, keepdims=True), 1e-30)
        q = jnp.where(rejected_M, q_left, q)
    bonus_M = jax.random.categorical(keys[c], jnp.log(p), axis=-1).astype(jnp.int32)
    return jnp.where(done_M, chosen_M, bonus_M)
