"""Length policies: pure-function checks (no decode loop). The cost table: test_cost_table.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.decode.build import make_policy
from adaflash_jax.decode.goodput import calibration
from adaflash_jax.decode.goodput.policy import (
    GoodputPolicy,
    accept_probs,
    expected_committed,
    length_head_accept_probs,
)
from adaflash_jax.decode.policy import AdaFlashPolicy, Draft, FixedPolicy, PolicyError, Slots
from adaflash_jax.decode.tree import NO_NODE, Tree, TreeShape
from adaflash_jax.decode.undrafted import chain_nodes, probe_outcome
from adaflash_jax.io.cost_table import VerifyCostTable

K = 8
BUCKETS = (1, 2, 4, 8)
TABLE = VerifyCostTable(
    rows=(1, 4, 16),
    widths=BUCKETS,
    verify_ms=((1.0, 1.05, 1.1, 1.3), (1.2, 1.5, 2.0, 3.0), (2.0, 3.5, 6.0, 11.0)),
    draft_ms=(0.3, 0.5, 1.0),
    device="synthetic",
)


def _input(b=5, accept=None, r=None, active=None, seed=0):
    key = jax.random.key(seed)
    active = jnp.ones((b,), bool) if active is None else jnp.asarray(active)
    return Draft(
        hidden_BxKxD=jnp.zeros((b, K, 4)),
        logits_BxKm1xV=jax.random.normal(key, (b, K - 1, 16)) * 3,
        length_r_B=None if r is None else jnp.asarray(r, jnp.float32),
        head_accept_BxKm1=None if accept is None else jnp.asarray(accept, jnp.float32),
        active_B=active,
        num_running=jnp.sum(active.astype(jnp.int32)),
        buckets=BUCKETS,
    )


def _slots(b):
    return Slots(count=b, block_size=K)


@functools.partial(jax.jit, static_argnames=("policy",))
def _widths(policy, inp):
    """A fresh state's widths."""
    return policy.widths(inp, policy.init(_slots(inp.active_B.shape[0])))[0]


def _brute_force_width(accept_BxKm1, active_B, table, buckets):
    n = int(np.sum(active_B))
    best, best_rate = None, -1.0
    for w in buckets:
        total = 0.0
        for a_row, on in zip(accept_BxKm1, active_B):
            if on:
                total += 1.0 + sum(np.prod(a_row[:i]) for i in range(1, w))
        cost = table.verify(n, w) + float(np.interp(n, table.rows, table.draft_ms))
        if total / cost > best_rate + 1e-9:
            best, best_rate = w, total / cost
    return best


@pytest.mark.parametrize("seed", range(6))
def test_goodput_picks_the_optimal_width(seed):
    rng = np.random.default_rng(seed)
    b = 12
    profile = rng.uniform(0.2, 1.0, size=(b, 1)) ** rng.uniform(0.2, 3.0)
    accept = np.clip(profile * rng.uniform(0.6, 1.0, size=(b, K - 1)), 0, 1)
    active = rng.random(b) < 0.8
    active[0] = True
    policy = GoodputPolicy(cost=TABLE, estimator="head")
    w = _widths(policy, _input(b, accept=accept, active=active))
    want = _brute_force_width(accept, active, TABLE, BUCKETS)
    assert set(np.asarray(w).tolist()) == {want}


def test_goodput_follows_acceptance_and_cost():
    policy = GoodputPolicy(cost=TABLE, estimator="head")
    sure, hopeless = np.ones((3, K - 1)), np.zeros((3, K - 1))
    # Certain drafts at low load: the widest block wins; hopeless drafts: width 1.
    assert int(_widths(policy, _input(3, accept=sure))[0]) == 8
    assert int(_widths(policy, _input(3, accept=hopeless))[0]) == 1
    # Certain drafts at 16 rows: verification is compute-bound (width 8 costs 11 ms), so a
    # narrower bucket wins; it must be the brute-force optimum.
    got = _widths(policy, _input(16, accept=np.ones((16, K - 1))))
    assert int(got[0]) == _brute_force_width(np.ones((16, K - 1)), np.ones(16), TABLE, BUCKETS)


def test_expected_committed_formula():
    a = jnp.array([[1.0] * (K - 1), [0.0] * (K - 1), [0.5] * (K - 1)])
    e = np.asarray(expected_committed(calibration.chain_survival(a), BUCKETS))
    np.testing.assert_allclose(e[0], [1, 2, 4, 8])
    np.testing.assert_allclose(e[1], [1, 1, 1, 1])
    np.testing.assert_allclose(e[2], [1, 1.5, 1.875, 1 + sum(0.5**i for i in range(1, 8))])


def test_length_head_profile_matches_the_predicted_length():
    r = jnp.array([1 / K, 0.5, 0.8, 1.0])
    a = np.asarray(length_head_accept_probs(r, K))
    mean_accepted = np.sum(np.cumprod(a, axis=1), axis=1)
    np.testing.assert_allclose(mean_accepted, np.asarray(r) * K - 1, atol=1e-3)


def test_confidence_estimator_is_the_drafter_top_probability():
    inp = _input(2)
    a = accept_probs(inp, "confidence")
    np.testing.assert_allclose(a, jax.nn.softmax(inp.logits_BxKm1xV, -1).max(-1), rtol=1e-6)


def test_fixed_and_adaflash_widths():
    inp = _input(3, r=[0.05, 0.3, 0.9])
    assert np.asarray(FixedPolicy().widths(inp, ())[0]).tolist() == [8] * 3
    # 3 running rows: below the threshold the reference verifies the whole block.
    ada = AdaFlashPolicy(threshold=2)
    assert np.asarray(ada.widths(inp, ())[0]).tolist() == [1, 3, 8]
    off = AdaFlashPolicy(threshold=3)
    assert np.asarray(off.widths(inp, ())[0]).tolist() == [8] * 3
    assert FixedPolicy().init(_slots(3)) == () and ada.observe(None, ()) == ()  # stateless


@pytest.mark.parametrize("estimator", ["confidence", "length_head"])
def test_goodput_widths_stay_in_bucket_set(estimator):
    policy = GoodputPolicy(cost=TABLE, estimator=estimator)
    for seed in range(4):
        inp = _input(6, r=np.linspace(0.05, 1.0, 6), seed=seed)
        w = np.asarray(_widths(policy, inp))
        assert len(set(w.tolist())) == 1 and w[0] in BUCKETS


def test_policy_errors():
    with pytest.raises(PolicyError, match="verify-cost table"):
        make_policy("goodput")
    with pytest.raises(PolicyError, match="unknown policy"):
        make_policy("eagle")
    with pytest.raises(PolicyError, match="estimator"):
        GoodputPolicy(cost=TABLE, estimator="vibes")
    with pytest.raises(PolicyError, match="missing buckets"):
        GoodputPolicy(cost=TABLE).validate(buckets=(1, 3), has_length_head=True)
    with pytest.raises(PolicyError, match="length head"):
        AdaFlashPolicy().validate(buckets=BUCKETS, has_length_head=False)


def test_entering_drafting_must_pay_for_the_switch():
    """From the undrafted program, a drafted step is charged the table's switch overhead
    spread over `switch_horizon` steps: a gain that beats a plain step only without it keeps
    the engine where it is."""
    table = dataclasses.replace(TABLE, switch_ms=2.0)
    whole = GoodputPolicy(cost=table, switch_horizon=1)  # one step pays the whole switch
    shared = GoodputPolicy(cost=table)  # 4 steps: 0.5 ms each
    # 1 row: plain 1.0 ms (1 token/ms); width 4 drafted 1.1 + 0.3 ms, 3.4 with the switch
    # a = 0.5: width 4 commits 1.875 → 1.34 tokens/ms, 0.55 with the switch, 0.99 shared
    # a = 0.6: width 4 commits 2.18 → 0.64 with the switch, 1.15 shared
    # a = 0.9: width 8 commits 5.17 in 1.6 ms, 3.6 with the switch → 1.44 tokens/ms
    active = jnp.ones((1,), bool)

    def drafts(policy, state, switching):
        return bool(
            policy.speculate(state, active, undrafted=0, switching=switching, buckets=BUCKETS).draft
        )

    for a, stay, enter, enter_shared in (
        (0.2, False, False, False),
        (0.5, True, False, False),
        (0.6, True, False, True),
        (0.9, True, True, True),
    ):
        survive = calibration.chain_survival(jnp.full((1, K - 1), a))
        state = whole.init(_slots(1)).replace(est_BxY=survive)
        assert drafts(whole, state, False) == stay, a
        assert drafts(whole, state, True) == enter, a
        assert bool(whole.drafting_gain(state, active, buckets=BUCKETS) > 1.0) == enter, a
        assert drafts(shared, state, True) == enter_shared, a
    with pytest.raises(PolicyError, match="switch_horizon"):
        GoodputPolicy(cost=table, switch_horizon=0.5)
    assert VerifyCostTable.from_json({**TABLE.to_json(), "switch_ms": 2.0}) == table
    old = TABLE.to_json()
    del old["switch_ms"]  # tables written before the field existed
    assert VerifyCostTable.from_json(old).switch_ms == 0.0


def _interval(policy, rows, gain=0.5):
    return int(policy.interval_at_gain(jnp.float32(gain), jnp.int32(rows)))


def test_probe_interval_bounds_the_probe_overhead():
    """Base interval: ceil(draft forward / (5% · plain step)), scaled by
    2·(1 − drafting gain) within [1/8, 2], then within [1, max_probe_every]; an explicit
    probe_every wins."""
    policy = GoodputPolicy(cost=TABLE)  # gain 0.5: the base interval
    # 1 row: plain 1.0 ms, draft 0.3 ms → 0.3 / 0.05 = 6 steps
    assert _interval(policy, 1) == 6
    # 16 rows: plain 2.0, draft 1 → 1 / 0.1 = 10
    assert _interval(policy, 16) == 10
    assert _interval(policy, 16, gain=0.0) == 20  # far from paying: 2x
    assert _interval(policy, 16, gain=0.75) == 5  # closer: more often
    assert _interval(policy, 16, gain=0.99) == 2  # 10 / 8, rounded up
    tight = GoodputPolicy(cost=TABLE, probe_overhead=0.005)  # 1 / 0.01 = 100, capped at 64
    assert _interval(tight, 16) == 64
    loose = GoodputPolicy(cost=TABLE, probe_overhead=0.2)  # 0.3 / 0.2 = 1.5 → 2
    assert _interval(loose, 1) == 2
    # the interval the skip arm asks for: at the rows' drafting gain, or probe_every
    survive = calibration.chain_survival(jnp.full((2, K - 1), 0.5))
    state = policy.init(_slots(2)).replace(est_BxY=survive)
    active = jnp.ones((2,), bool)
    gain = policy.drafting_gain(state, active, buckets=BUCKETS)
    want = _interval(policy, 2, gain=float(gain))
    assert int(policy.probe_interval(state, active, buckets=BUCKETS)) == want
    every = GoodputPolicy(cost=TABLE, probe_every=3)
    assert int(every.probe_interval(state, active, buckets=BUCKETS)) == 3
    # the answer the engine reads: that interval once the policy has seen a drafter forward,
    # a probe at once before any (a fresh state's prior is unset)
    ask = dict(undrafted=0, switching=True, buckets=BUCKETS)
    learnt = state.replace(prior_Y=survive[0])
    assert int(every.speculate(learnt, active, **ask).probe_in) == 3
    assert int(every.speculate(state, active, **ask).probe_in) == 0


def test_calibration_exponent_fits_the_realised_acceptance():
    """s ↦ s^γ: the fitted γ* reproduces a count at the observed width (γ < 1 for an
    under-confident estimator, > 1 for an over-confident one); an update moves each graded
    row's count part of the way to its outcome, and the engine's γ follows their mean."""
    est = jnp.array([[0.4, 0.4, 0.4], [0.9, 0.9, 0.9], [0.5, 0.5, 0.5]])
    width = jnp.array([4, 4, 3])
    realised = jnp.array([2.5, 0.5, 1.0])
    lg = calibration.fit_log_gamma(est, width, realised)
    got = calibration.accepted_at(calibration.calibrated(est, lg), width)
    np.testing.assert_allclose(got, realised, rtol=1e-3)
    assert lg[0] < 0 < lg[1]
    # beyond reach: every draft accepted needs γ → 0, clipped at the bound
    full = calibration.fit_log_gamma(est[:1], jnp.array([4]), jnp.array([3]))
    np.testing.assert_allclose(full, -calibration.MAX_LOG_GAMMA, rtol=1e-3)
    # an update moves the calibrated expected count a RATE fraction towards the outcome
    rows, engine = calibration.update(
        jnp.zeros(3), jnp.float32(0.0), est, width, realised, jnp.array([True, True, False])
    )
    before = calibration.accepted_at(est, width)
    after = calibration.accepted_at(calibration.calibrated(est, rows), width)
    want = before + calibration.ROW_RATE * (realised - before)
    np.testing.assert_allclose(after[:2], want[:2], rtol=1e-3)
    assert float(rows[2]) == 0.0  # not graded
    engine_fits = calibration.fit_log_gamma(
        est, width, before + calibration.ENGINE_RATE * (realised - before)
    )
    np.testing.assert_allclose(engine, (engine_fits[0] + engine_fits[1]) / 2, rtol=1e-4)
    # a zero outcome lowers the count, without sending γ to its bound
    low, _ = calibration.update(
        jnp.zeros(1), jnp.float32(0.0), est[:1], width[:1], jnp.zeros(1), jnp.ones(1, bool)
    )
    assert 0 < float(low[0]) < calibration.MAX_LOG_GAMMA / 2
    # the policies read calibrated estimates: γ = 1/2 turns 0.25 into 0.5
    a = jnp.full((1, K - 1), 0.25)
    np.testing.assert_allclose(
        expected_committed(a, (2,), jnp.log(jnp.array([0.5]))), [[1.5]], rtol=1e-6
    )


def test_a_probe_is_graded_against_the_tokens_committed_after_it():
    """Leading matches of the probe's drafts with the committed tokens, over the positions
    committed so far (width = 1 + those); rows without a live probe or a committed position
    are not graded."""
    out = jnp.array(
        [
            [5, 6, 7, 8, 9, -1, -1, -1],  # probe at 1: drafts 6 7 0 → 2 accepted of 3 graded
            [5, 6, 7, 8, 9, 1, 2, 3],  # probe at 2: drafts 7 8 9 → all 3
            [5, 6, -1, -1, -1, -1, -1, -1],  # probe at 2: nothing committed since
            [5, 6, 7, 8, -1, -1, -1, -1],  # probe at 1 of an earlier request: not live
        ]
    )
    drafts = jnp.array([[6, 7, 0], [7, 8, 9], [1, 2, 3], [6, 7, 8]])
    realised, width, graded = probe_outcome(
        *chain_nodes(drafts),
        jnp.array([1, 2, 2, 1]),
        jnp.array([True, True, True, False]),
        out,
        jnp.array([5, 8, 2, 4]),
    )
    assert realised.tolist()[:2] == [2, 3]
    assert width.tolist()[:3] == [4, 4, 1]
    assert graded.tolist() == [True, True, False, False]
    partial = probe_outcome(
        *chain_nodes(drafts[:1]), jnp.array([1]), jnp.array([True]), out[:1], jnp.array([2])
    )  # one position committed (6): one accepted over width 2
    assert [int(x[0]) for x in partial] == [1, 2, 1]


def test_a_tree_probe_is_graded_by_walking_the_committed_tokens():
    """A probe's tree is walked along the tokens committed since, over its nodes before the
    first whose depth is not committed yet (the width); an empty node (depth K) ends them."""
    # verify tokens: 0 root; 1: 6 (d1); 2: 4 (d1); 3: 7 under 1 (d2); 4: 9 under 2 (d2);
    # 5: 3 under 3 (d3); 6: empty
    tokens = jnp.array([[6, 4, 7, 9, 3, 0]] * 3)
    parent = jnp.array([[0, 0, 1, 2, 3, 0]] * 3)
    depth = jnp.array([[1, 1, 2, 2, 3, K]] * 3)
    out = jnp.array(
        [
            [5, 6, 7, 3, -1, -1],  # probe at 1: 6 7 3 → 3 accepted over all 5 nodes
            [5, 4, 9, 1, -1, -1],  # probe at 1: 4 9, then 1 (none) → 2 over 5 nodes
            [5, 6, 8, -1, -1, -1],  # probe at 1: 2 committed: nodes 1-4 (depth <= 2), 6 → 1
        ]
    )
    realised, width, graded = probe_outcome(
        tokens, parent, depth, jnp.ones(3, jnp.int32), jnp.ones(3, bool), out,
        jnp.array([4, 4, 3]),
    )  # fmt: skip
    assert realised.tolist() == [3, 2, 1]
    assert width.tolist() == [6, 6, 5]
    assert graded.tolist() == [True, True, True]


def _tree_draft(logp_BxY, active):
    b, y = logp_BxY.shape
    tree = Tree(
        tokens_BxY=jnp.zeros((b, y), jnp.int32),
        parent_BxY=jnp.zeros((b, y), jnp.int32),
        depth_BxY=jnp.ones((b, y), jnp.int32),
        logp_BxY=jnp.asarray(logp_BxY, jnp.float32),
        candidates_BxKm1xKc=jnp.zeros((b, K - 1, 2), jnp.int32),
    )
    return dataclasses.replace(
        _input(b, active=active), tree=tree, token_buckets=tuple(b * f for f in PACKED_FILLS)
    )


PACKED_FILLS = (1, 2, 4, 8, 12)
PACKED = dataclasses.replace(
    TABLE,
    fills=PACKED_FILLS,
    packed_ms=tuple(
        tuple(plain + (f - 1) * step for f in PACKED_FILLS)
        for plain, step in zip((1.0, 1.2, 2.0), (0.01, 0.05, 0.4))
    ),
)


@pytest.mark.parametrize("seed", range(4))
def test_goodput_fills_the_token_bucket_with_the_best_tree_nodes(seed):
    """Over trees, goodput's widths are each row's first nodes (best first), the bucket and
    split maximising Σ(1 + the taken nodes' path probabilities) / the packed step's ms, by
    brute force over every bucket; an empty node is never taken, an inactive row takes none,
    and hopeless rows at load make a plain-rate choice possible."""
    rng = np.random.default_rng(seed)
    b, y = 4, 11
    steps = rng.uniform(0.02, 0.7, size=(b, y))
    logp = np.cumsum(np.log(steps), axis=1)  # non-increasing path probabilities
    logp[0, 8:] = NO_NODE  # row 0 has 8 nodes
    active = np.array([True, True, rng.random() < 0.5, True])
    policy = GoodputPolicy(cost=PACKED, skip_draft=False)
    draft = _tree_draft(logp, active)
    width = np.asarray(policy.widths(draft, policy.init(Slots(count=b, block_size=K)))[0])
    n = int(active.sum())
    surv = np.where(active[:, None], np.exp(np.maximum(logp, -1e4)), -1.0).reshape(-1)
    best = None
    for f in PACKED_FILLS:
        budget = max(0, min(b * f - n, surv.size))
        gain = n + np.sum(np.clip(np.sort(surv)[::-1][:budget], 0, None))
        rate = gain / float(PACKED.packed_step_ms(n, (f,))[0])
        if best is None or rate > best[0] + 1e-9:
            best = (rate, budget)
    taken = np.zeros((b, y), bool)
    flat = np.argsort(-surv, kind="stable")[: best[1]]
    taken.reshape(-1)[flat] = True
    taken &= logp > NO_NODE / 2
    np.testing.assert_array_equal(width, 1 + taken.sum(1))
    assert width[0] <= 9 and (active | (width == 1)).all()


def test_goodput_refuses_tree_estimators_it_cannot_score():
    shape = TreeShape(topk=2, nodes=8)
    with pytest.raises(PolicyError, match="path probability"):
        GoodputPolicy(cost=PACKED, estimator="head").validate(
            buckets=BUCKETS, has_length_head=True, fills=PACKED_FILLS, tree=shape
        )
    with pytest.raises(PolicyError, match="packed"):
        GoodputPolicy(cost=PACKED).validate(buckets=BUCKETS, has_length_head=True, tree=shape)
    GoodputPolicy(cost=PACKED).validate(
        buckets=BUCKETS, has_length_head=False, fills=PACKED_FILLS, tree=shape
    )
