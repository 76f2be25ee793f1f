"""Draft trees (docs/design.md §5.6): the best-first selection is the brute-force best set of
paths; a tree verified in one packed forward gives every node the logits of its own root-to-
node chain (dense, hybrid: the ancestor-masked delta rule, MoE), and committing a path equals
writing it as a chain; tree decoding is plain greedy token for token (a 1-wide tree is the
chain itself, step for step), with ragged rows (a row verifying its bonus alone next to a
row with its whole tree), batch allocation, rows split over 8 devices, and no recompiles
after warm-up; what a tree engine cannot honour is refused by name. (Sampled trees:
tests/test_sampled_lossless.py.)"""

import dataclasses
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from doubles import TableDrafter
from flax import nnx

from adaflash_jax.decode.drafting import draft_tree
from adaflash_jax.decode.generate import generate
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.policy import AdaFlashPolicy, FixedPolicy, TreeBatchPolicy
from adaflash_jax.decode.programs import compiled_programs
from adaflash_jax.decode.slots import EngineError, SpeculativeEngine
from adaflash_jax.decode.tree import NO_NODE, TreeShape, build, head_scores, top_candidates, walk
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io.cost_table import VerifyCostTable
from adaflash_jax.model.packing import Packing
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rows import RowLayout
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.mesh import make_mesh

V, K, CAPACITY = 128, 8, 64
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9], list(range(20, 32))]
MAX_NEW = [9, 6, 13, 3, 11]
REQUESTS = list(zip(PROMPTS, MAX_NEW, strict=True))


def _best_paths(logp_KxV, topk, n):
    """Brute force: the n largest log path probabilities over every path of top-k tokens."""
    top_KxC = np.sort(logp_KxV, axis=-1)[:, ::-1][:, :topk]
    scores = [
        sum(top_KxC[i, r] for i, r in enumerate(ranks))
        for d in range(1, len(logp_KxV) + 1)
        for ranks in itertools.product(range(topk), repeat=d)
    ]
    return sorted(scores, reverse=True)[:n]


def test_best_first_selection_is_the_best_tree():
    rng = np.random.default_rng(0)
    logp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 4, 7)) * 2.0), axis=-1)
    for topk, n in ((3, 10), (2, 5), (1, 6)):
        tree = build(*top_candidates(logp, topk), TreeShape(topk=topk, nodes=n))
        for b in range(3):
            got = np.asarray(tree.logp_BxY[b])
            best = _best_paths(np.asarray(logp[b]), topk, n)
            np.testing.assert_allclose(got[: len(best)], best, atol=1e-5)
            assert np.all(got[len(best) :] == NO_NODE)  # topk 1: only K − 1 nodes exist
            assert np.all(np.diff(got) <= 0)  # best first: a prefix is the best smaller tree
            parent, depth = np.asarray(tree.parent_BxY[b]), np.asarray(tree.depth_BxY[b])
            for i in range(len(best)):  # node i is verify token i + 1; parents come first
                assert parent[i] <= i and depth[i] == (
                    1 if parent[i] == 0 else depth[parent[i] - 1] + 1
                )
                path_logp = float(logp[b, depth[i] - 1, tree.tokens_BxY[b, i]])
                above = 0.0 if parent[i] == 0 else got[parent[i] - 1]
                assert got[i] == pytest.approx(above + path_logp, abs=1e-5)


def test_tree_packing_and_walk():
    parent_BxW = jnp.asarray([[0, 0, 0, 1, 1, 3], [0, 0, 1, 2, 0, 4]])
    packing = Packing.create(jnp.asarray([6, 5]), tokens=12, row_width=6, parent_BxW=parent_BxW)
    assert packing.depth_BxW.tolist() == [[0, 1, 1, 2, 2, 3], [0, 1, 2, 3, 1, 2]]
    assert np.asarray(packing.visible_BxWxW[0, 5]).tolist() == [1, 1, 0, 1, 0, 1]
    np.testing.assert_array_equal(
        packing.positions(jnp.asarray([10, 20]))[:11], [10, 11, 11, 12, 12, 13, 20, 21, 22, 23, 21]
    )
    # two generations up; −1 − the generations missing where the root is nearer
    assert packing.ancestors(2).tolist() == [[-2, -1, -1, 0, 0, 1], [-2, -1, 0, 1, -1, 0]]
    tokens_BxW = jnp.asarray([[9, 1, 2, 3, 4, 5], [9, 1, 2, 3, 4, 5]])
    # the target's choice at each token: row 0 walks 0 → 1 → 3 → 5 and stops (5 is a leaf);
    # row 1 picks 4 at the root, then 7 (no child has it): the bonus
    choice_BxW = jnp.asarray([[1, 3, 0, 5, 0, 8], [4, 0, 0, 0, 7, 0]])
    accepted, path, bonus = walk(tokens_BxW, parent_BxW, choice_BxW, jnp.asarray([6, 5]), 4)
    assert accepted.tolist() == [3, 1] and bonus.tolist() == [8, 7]
    assert path.tolist() == [[0, 1, 3, 5, 5], [0, 4, 4, 4, 4]]
    _, _, bonus = walk(tokens_BxW, parent_BxW, choice_BxW, jnp.asarray([3, 1]), 4)
    assert bonus.tolist() == [3, 4]  # token 3 is past row 0's width; row 1 verifies its root alone


@pytest.fixture(scope="module", params=["test", "test-hybrid", "micro-moe"])
def target(request):
    cfg = target_preset(request.param, vocab_size=V, max_position_embeddings=256)
    return TargetLM(cfg, rngs=nnx.Rngs(0))


def _prefilled(target, prompts):
    width = max(map(len, prompts))
    tokens = jnp.asarray([p + [0] * (width - len(p)) for p in prompts])
    out = target(
        tokens,
        cache=target.init_cache(len(prompts), CAPACITY),
        num_new_B=jnp.asarray([len(p) for p in prompts]),
    )
    return out.cache


def test_a_verified_tree_is_each_node_chain(target):
    """Each node's logits in the tree forward are those of a chain forward over its root-to-
    node path; committing a root-to-leaf path equals writing that path as a chain (K/V at the
    committed positions, the DeltaNet's state and conv history)."""
    cache = _prefilled(target, [[3, 1, 4, 1, 5], [2, 7]])
    parent_BxW = np.asarray([[0, 0, 0, 1, 1, 3], [0, 0, 1, 2, 0, 4]])
    tokens_BxW = np.asarray([[5, 11, 12, 13, 14, 15], [7, 21, 22, 23, 24, 25]])
    width_B = jnp.asarray([6, 5])
    packing = Packing.create(width_B, tokens=12, row_width=6, parent_BxW=jnp.asarray(parent_BxW))
    out = target(
        packing.pack(jnp.asarray(tokens_BxW))[:, None],
        cache=cache,
        cache_mode="read",
        packing=packing,
    )
    logits_BxWxV = packing.unpack(out.logits_BxTxV[:, 0])

    def path_of(b, j):
        path = [j]
        while path[-1] != 0:
            path.append(int(parent_BxW[b, path[-1]]))
        return path[::-1]

    chain = jax.jit(lambda tokens: target(tokens, cache=cache, cache_mode="read").logits_BxTxV)
    for b, j in [(r, j) for r in range(2) for j in range(int(width_B[r]))]:
        path = path_of(b, j)
        rows = np.zeros((2, 4), np.int32)
        rows[b, : len(path)] = tokens_BxW[b, path]
        np.testing.assert_allclose(
            logits_BxWxV[b, j], chain(jnp.asarray(rows))[b, len(path) - 1], atol=2e-4
        )
    leaves = [
        (b, j)
        for b in range(2)
        for j in range(int(width_B[b]))
        if j not in parent_BxW[b, 1 : int(width_B[b])]
    ]
    for b, leaf in leaves:
        path = path_of(b, leaf)
        path_BxZ = np.zeros((2, 4), np.int32)
        path_BxZ[b, : len(path)] = path
        n_B = jnp.asarray([len(path) if r == b else 0 for r in range(2)])
        by_tree = cache.commit(out.entries, n_B, jnp.asarray(path_BxZ))
        rows = np.zeros((2, 4), np.int32)
        rows[b, : len(path)] = tokens_BxW[b, path]
        by_chain = target(jnp.asarray(rows), cache=cache, num_new_B=n_B).cache
        assert by_tree.lengths.tolist() == by_chain.lengths.tolist()
        for mine, theirs in zip(by_tree.layers, by_chain.layers, strict=True):
            for x, y in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
                if x.ndim >= 2 and x.shape[1] == CAPACITY:  # K/V: the committed positions
                    x, y = x[b, : int(by_tree.lengths[b])], y[b, : int(by_tree.lengths[b])]
                np.testing.assert_allclose(x, y, atol=2e-4)


@pytest.fixture(scope="module", params=["test", "test-hybrid", "micro-moe"])
def setup(request):
    """A target, its plain greedy outputs, and a drafter double with two guesses per
    position: its first guess is the bigram of the plain outputs, wrong on a third of the
    tokens, where its second guess is right (siblings matter)."""
    cfg = target_preset(request.param, vocab_size=V, max_position_embeddings=256)
    target = TargetLM(cfg, rngs=nnx.Rngs(0))
    plain = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=())
    counts = np.zeros((V, V), np.int64)
    for prompt, out in zip(PROMPTS, plain, strict=True):
        seq = prompt + out
        for a, b in zip(seq[:-1], seq[1:]):
            counts[a, b] += 1
    bigram = np.where(counts.sum(1) > 0, counts.argmax(1), (np.arange(V) + 1) % V)
    wrong = np.random.default_rng(0).random(V) < 0.35
    first = np.where(wrong, (bigram + 17) % V, bigram)
    second = np.where(wrong, bigram, (bigram + 29) % V)
    dcfg = DrafterConfig.for_target(
        cfg, mask_token_id=V - 1, num_layers=1, block_size=K, num_features=2
    )
    return target, plain, TableDrafter(dcfg, first, runner_up_V=second)


def _engine(setup, tree, policy=None, **kw):
    target, _, drafter = setup
    kw = dict(slots=3, capacity=CAPACITY, eos_ids=(), verify="packed") | kw
    return SpeculativeEngine(target, drafter, tree=tree, policy=policy, **kw)


@dataclasses.dataclass(frozen=True)
class RowBudgets(FixedPolicy):
    """Slot 0 verifies its bonus alone (no nodes), slot 1 its whole tree, slot 2 two nodes."""

    name = "row-budgets"

    def widths(self, draft, state):
        slot_B = jnp.arange(draft.active_B.shape[0])
        return jnp.where(slot_B == 0, 1, jnp.where(slot_B == 1, draft.row_width, 3)), state


def test_tree_greedy_is_plain_greedy(setup):
    target, plain, _ = setup
    chain = _engine(setup, None).generate(REQUESTS)
    as_chain = _engine(setup, TreeShape(topk=1, nodes=K - 1)).generate(REQUESTS)
    assert [r.output_ids for r in chain] == plain
    assert [r.output_ids for r in as_chain] == plain
    assert [r.accepted for r in as_chain] == [r.accepted for r in chain]  # step for step
    tree = _engine(setup, TreeShape(topk=2, nodes=2 * K))
    by_tree = tree.generate(REQUESTS)
    assert [r.output_ids for r in by_tree] == plain
    tau = np.mean([r.tau for r in by_tree])
    assert tau > np.mean([r.tau for r in chain]), "the second guesses should be accepted"
    ragged = _engine(setup, TreeShape(topk=3, nodes=12), RowBudgets()).generate(REQUESTS)
    assert [r.output_ids for r in ragged] == plain
    widths = [w for r in ragged for w in r.widths]
    assert 1 in widths and 13 in widths, f"want 0-node rows next to whole trees: {widths}"
    batch = _engine(setup, TreeShape(topk=2, nodes=2 * K), TreeBatchPolicy(mean_nodes=3))
    by_batch = batch.generate(REQUESTS)
    assert [r.output_ids for r in by_batch] == plain
    if target.config.is_hybrid or target.config.num_experts:
        return
    warm = compiled_programs()
    for shift in (1, 2):  # other prompts and budgets → other allocations and token buckets
        batch.generate([([(t + shift) % V for t in p], m + shift) for p, m in REQUESTS])
    assert compiled_programs() == warm


def _packed_table(buckets, fills, rows=3, plain_ms=1.0, draft_ms=0.6, per_token_ms=0.15):
    """A synthetic table: a packed step costs draft + plain + per_token_ms per extra token."""
    return VerifyCostTable(
        rows=(rows,),
        widths=buckets,
        verify_ms=(tuple(plain_ms + per_token_ms * rows * (w - 1) for w in buckets),),
        draft_ms=(draft_ms,),
        fills=fills,
        packed_ms=(tuple(plain_ms + per_token_ms * rows * (f - 1) for f in fills),),
        device="synthetic",
    )


@pytest.mark.parametrize("setup", ["test", "test-hybrid"], indirect=True)
def test_goodput_over_trees_is_plain_greedy(setup):
    """Goodput filling the token bucket with the best nodes of every row (or taking plain
    steps, probing and grading its probes' trees) decodes plain greedy; it drafts and it
    takes plain steps; its widths are prefixes of the rows' trees."""
    _, plain, _ = setup
    shape = TreeShape(topk=2, nodes=2 * K)
    probe = _engine(setup, shape)
    fills = tuple(p // 3 for p in probe.token_buckets)
    policy = GoodputPolicy(cost=_packed_table(probe.buckets, fills), probe_every=2)
    engine = _engine(setup, shape, policy)
    results = engine.generate(REQUESTS)
    assert [r.output_ids for r in results] == plain
    requested = [w for r in results for w in r.requested_widths]
    assert 0 in requested, f"some steps should be plain: {requested}"
    assert any(w > 1 for w in requested), f"some steps should draft: {requested}"
    assert max(requested) <= shape.row_width and engine.last_run["probes"] > 0


@pytest.mark.parametrize("setup", ["test-hybrid"], indirect=True)  # recurrent states split too
def test_tree_rows_split_over_eight_devices_decode_the_same(setup):
    _, plain, _ = setup
    rows = RowLayout.of(make_mesh(2, 4, 1), TRAIN_RULES, 8)
    engine = _engine(
        setup, TreeShape(topk=2, nodes=K), TreeBatchPolicy(mean_nodes=4), slots=8, rows=rows
    )
    assert [r.output_ids for r in engine.generate(REQUESTS)] == plain


@pytest.mark.parametrize("setup", ["test"], indirect=True)
def test_what_a_tree_engine_cannot_honour_is_refused(setup):
    with pytest.raises(EngineError, match="verify packed"):
        _engine(setup, TreeShape(topk=2, nodes=4), verify="padded")
    with pytest.raises(EngineError, match="sizes chains"):
        _engine(setup, TreeShape(topk=2, nodes=4), AdaFlashPolicy())
    with pytest.raises(EngineError, match="give the engine a tree"):
        _engine(setup, None, TreeBatchPolicy())
    with pytest.raises(EngineError, match="mean_nodes"):
        _engine(setup, TreeShape(topk=2, nodes=4), TreeBatchPolicy(mean_nodes=5))
    with pytest.raises(EngineError, match="surrogate 'head'.*accept_probs"):
        _engine(setup, TreeShape(topk=2, nodes=4, surrogate="head"))  # the table has no head
    with pytest.raises(ValueError, match="surrogate"):
        TreeShape.parse("2x4@vibes")


def test_head_surrogate_scores():
    """The head's surrogate: a candidate scores log a_d + log q(c) − log q(top); the top-1
    chain's path score is then Σ log a (the head's survival), siblings scale it by q's
    ratio; trees built from it rank by it (here the head prefers a shallower, wider tree)."""
    q1, q2 = [0.6, 0.3, 0.1, 1e-9], [0.8, 0.15, 0.05, 1e-9]
    logits = jnp.log(jnp.array([[q1, q2, q1]]))  # [1, 3, 4]: K − 1 = 3
    accept = jnp.array([[0.9, 0.2, 0.2]])
    spec = types.SimpleNamespace(greedy=True, tree=TreeShape(topk=2, nodes=4, surrogate="head"))
    tree = draft_tree(None, logits, accept, None, spec)
    scores, tokens = top_candidates(jax.nn.log_softmax(logits, axis=-1), 2)
    np.testing.assert_allclose(
        head_scores(scores, accept)[0, :, 0], np.log([0.9, 0.2, 0.2]), rtol=1e-5
    )
    paths = {tuple(p) for p in _paths(tree)}
    # path probability takes (0) .6, (0,0) .48, (1) .3, (0,0,0) .29; the head's
    # (0) .9, (1) .45, (0,0) .18, (1,0) .09
    assert paths == {(0,), (1,), (0, 0), (1, 0)}, paths
    by_path = build(scores, tokens, TreeShape(2, 4))
    assert {tuple(p) for p in _paths(by_path)} == {(0,), (0, 0), (1,), (0, 0, 0)}
    np.testing.assert_allclose(np.exp(tree.logp_BxY[0, :2]), [0.9, 0.45], rtol=1e-4)


def _paths(tree):
    """Each node's candidate ranks from the root (from its tokens: rank = token here)."""
    out, parent, tokens = [], np.asarray(tree.parent_BxY[0]), np.asarray(tree.tokens_BxY[0])
    for i in range(len(tokens)):
        path, j = [], i
        while True:
            path.append(int(tokens[j]))
            if parent[j] == 0:
                break
            j = parent[j] - 1
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("setup", ["test"], indirect=True)
def test_head_ranked_trees_are_plain_greedy(setup):
    """Trees ranked by the length head's acceptance (a drafter with its accept output)."""
    target, plain, _ = setup
    dcfg = DrafterConfig.for_target(
        target.config, mask_token_id=V - 1, num_layers=1, block_size=K, num_features=2,
        length_head=True, accept_dim=8,
    )  # fmt: skip
    drafter = Drafter(dcfg, rngs=nnx.Rngs(3))
    engine = SpeculativeEngine(
        target, drafter, slots=3, capacity=CAPACITY, eos_ids=(),
        tree=TreeShape(topk=2, nodes=2 * K, surrogate="head"),
    )  # fmt: skip
    assert [r.output_ids for r in engine.generate(REQUESTS)] == plain


@pytest.mark.parametrize("setup", ["test", "test-hybrid"], indirect=True)
def test_the_verify_kernel_decodes_plain_greedy(setup):
    """The target's verify attention as the Pallas kernel (interpreted here; it compiles for
    TPU in tests/test_ragged_attention.py): trees, per-row budgets and the chain still
    decode plain greedy token for token."""
    target, plain, drafter = setup
    kernel_target = TargetLM(target.config, rngs=nnx.Rngs(0), verify_attention="interpret")
    for tree, policy in ((TreeShape(topk=2, nodes=K), None), (None, FixedPolicy())):
        engine = SpeculativeEngine(
            kernel_target, drafter, slots=3, capacity=CAPACITY, eos_ids=(), tree=tree,
            policy=policy, verify="packed",
        )  # fmt: skip
        assert [r.output_ids for r in engine.generate(REQUESTS)] == plain
    with pytest.raises(ValueError, match="verify_attention"):
        TargetLM(target.config, rngs=nnx.Rngs(0), verify_attention="cuda")
