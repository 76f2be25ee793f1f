"""Speculative engine, greedy: lossless against plain decoding, statistics, no recompiles,
continuous batching, and request validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from doubles import DraftEveryNth, TableDrafter, WobblePolicy
from flax import nnx

from adaflash_jax.decode.generate import generate
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.loops import DRAFTED, UNDRAFTED, admit
from adaflash_jax.decode.policy import AdaFlashPolicy
from adaflash_jax.decode.programs import compiled_programs
from adaflash_jax.decode.slots import EngineError, SpeculativeEngine
from adaflash_jax.decode.state import bucket_set
from adaflash_jax.decode.undrafted import flush
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io.cost_table import VerifyCostTable
from adaflash_jax.model.config import ConfigError
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM

V = 128
CFG = target_preset("test", vocab_size=V, max_position_embeddings=256)
CAPACITY = 64
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9], list(range(20, 32))]
MAX_NEW = [9, 6, 13, 3, 11]  # not multiples of the block: max-tokens lands inside blocks


@pytest.fixture(scope="module")
def target():
    return TargetLM(CFG, rngs=nnx.Rngs(0))


def _drafter_cfg(block_size):
    return DrafterConfig.for_target(
        CFG, mask_token_id=V - 1, num_layers=1, block_size=block_size, num_features=2
    )


@pytest.fixture(scope="module")
def drafter():
    return Drafter(_drafter_cfg(4), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def reference(target):
    """Plain greedy outputs (helper generate), without and with an EOS id that occurs in the
    middle of request 0's continuation."""
    plain = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=())
    eos = plain[0][4]
    with_eos = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=(eos,))
    assert len(with_eos[0]) == plain[0].index(eos) + 1 < len(plain[0])
    return {"plain": plain, "eos": eos, "with_eos": with_eos}


@pytest.fixture(scope="module")
def bigram(reference):
    """Most frequent successor of each token in the reference outputs: a drafter built from
    it is often right, so acceptance really happens (and is ragged)."""
    counts = np.zeros((V, V), np.int64)
    for prompt, out in zip(PROMPTS, reference["plain"]):
        seq = prompt + out
        for a, b in zip(seq[:-1], seq[1:]):
            counts[a, b] += 1
    return np.where(counts.sum(1) > 0, counts.argmax(1), (np.arange(V) + 1) % V)


def _requests():
    return list(zip(PROMPTS, MAX_NEW))


def _engine(target, drafter, *, slots=2, **kw):
    """The small engine most tests here run: buckets (1, 2, 4) in the shared cache capacity."""
    return SpeculativeEngine(
        target, drafter, slots=slots, capacity=CAPACITY, buckets=(1, 2, 4), **kw
    )


def _cut_inside_a_block(result) -> bool:
    """The last step verified more tokens than the request kept (EOS or max-new cut it)."""
    return sum(a + 1 for a in result.accepted) > len(result.output_ids) - 1


def _check_stats(results, engine):
    for r in results:
        assert r.steps == len(r.accepted) == len(r.widths) == len(r.requested_widths)
        assert set(r.widths) <= set(engine.buckets)
        # requested 0 = an undrafted (plain) step: width 1, nothing to accept
        assert all(1 <= q <= w or q == 0 == w - 1 for q, w in zip(r.requested_widths, r.widths))
        assert all(0 <= a < max(q, 1) for a, q in zip(r.accepted, r.requested_widths))
        # every step commits accepted+1 tokens (the last one may be cut by EOS / max-new)
        committed = sum(a + 1 for a in r.accepted)
        assert committed >= len(r.output_ids) - 1 > committed - engine.block_size


@pytest.mark.parametrize("block_size,slots,buckets", [(4, 2, (1, 2, 4)), (8, 3, (2, 8))])
def test_greedy_lossless_random_drafter(target, drafter, reference, block_size, slots, buckets):
    kw = dict(slots=slots, capacity=CAPACITY, block_size=block_size, buckets=buckets)
    engine = SpeculativeEngine(target, drafter, eos_ids=(), **kw)
    results = engine.generate(_requests())
    assert [r.output_ids for r in results] == reference["plain"]
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    _check_stats(results, engine)
    eos_engine = SpeculativeEngine(target, drafter, eos_ids=(reference["eos"],), **kw)
    results = eos_engine.generate(_requests())
    assert [r.output_ids for r in results] == reference["with_eos"]
    assert results[0].finish_reason == "eos"


@pytest.fixture(scope="module")
def table_engine(target, bigram):
    drafter = TableDrafter(_drafter_cfg(4), bigram)
    return _engine(target, drafter)


def test_oracle_drafter_accepts_and_stays_lossless(table_engine, reference):
    results = table_engine.generate(_requests())
    assert [r.output_ids for r in results] == reference["plain"]
    assert any(_cut_inside_a_block(r) for r in results), "max-new should cut a block"
    accepted = [a for r in results for a in r.accepted]
    assert np.mean(accepted) + 1 > 1.5, "the bigram drafter should be right often"
    assert 0 in accepted or min(accepted) < 3, "acceptance should be ragged, not all-or-none"
    _check_stats(results, table_engine)


def test_spec_pinned_below_k_caps_every_verify(target, bigram, reference):
    """A spec whose largest bucket W is below K (how adaflash_jax.aot compiles one program
    per width) verifies at most W tokens a step and stays lossless."""
    engine = _engine(target, TableDrafter(_drafter_cfg(4), bigram))
    engine.spec = dataclasses.replace(engine.spec, buckets=(2,))
    results = engine.generate(_requests())
    assert [r.output_ids for r in results] == reference["plain"]
    assert {w for r in results for w in r.widths} == {2}
    accepted = [a for r in results for a in r.accepted]
    assert max(accepted) == 1  # the oracle is often right: one draft verified, one accepted
    with pytest.raises(ValueError, match="within"):
        dataclasses.replace(engine.spec, buckets=(2, 5))


def test_oracle_drafter_eos_inside_block(target, bigram, reference):
    drafter = TableDrafter(_drafter_cfg(4), bigram)
    engine = _engine(target, drafter, eos_ids=(reference["eos"],))
    results = engine.generate(_requests())
    assert [r.output_ids for r in results] == reference["with_eos"]
    assert results[0].finish_reason == "eos"
    assert _cut_inside_a_block(results[0]), "EOS should land inside a multi-token commit"


def test_adversarial_drafter_is_lossless(target, reference):
    seen = {t for out in reference["plain"] for t in out}
    never = next(t for t in range(V) if t not in seen)
    drafter = TableDrafter(_drafter_cfg(4), np.full((V,), never))  # always wrong
    engine = _engine(target, drafter)
    results = engine.generate(_requests())
    assert [r.output_ids for r in results] == reference["plain"]
    assert all(r.tau == 1.0 for r in results if r.steps)


def test_continuous_batching_equals_each_request_alone(table_engine):
    requests = _requests()  # 5 requests through 2 slots
    together = table_engine.generate(requests)
    for req, res in zip(requests, together):
        (alone,) = table_engine.generate([req])
        assert alone.output_ids == res.output_ids
        assert alone.accepted == res.accepted  # same drafts, same verification


def test_no_recompiles_with_varying_widths(target, bigram, reference):
    drafter = TableDrafter(_drafter_cfg(8), bigram)
    engine = SpeculativeEngine(
        target, drafter, slots=2, capacity=CAPACITY, buckets=(1, 2, 4, 8), policy=WobblePolicy()
    )
    first = engine.generate(_requests())  # warm-up
    assert [r.output_ids for r in first] == reference["plain"]
    warm = compiled_programs()
    widths = set()
    for shift in range(3):  # different prompts, lengths, budgets → different widths
        reqs = [([(t + shift) % V for t in p], m + shift) for p, m in _requests()]
        widths |= {w for r in engine.generate(reqs) for w in r.widths}
    assert len(widths) >= 3, f"the test should exercise several buckets, saw {widths}"
    assert compiled_programs() == warm


def test_plain_path_matches_generate(target, reference):
    engine = SpeculativeEngine(target, None, slots=2, capacity=CAPACITY)
    results = engine.generate(_requests())
    assert [r.output_ids for r in results] == reference["plain"]
    assert all(set(r.widths) == {1} and set(r.accepted) == {0} for r in results)


def test_requests_are_validated_before_compute(target, drafter):
    engine = SpeculativeEngine(target, drafter, slots=2, capacity=CAPACITY, buckets=(4,))
    with pytest.raises(EngineError, match="exceeds the cache capacity"):
        engine.generate([([1, 2], 5), (list(range(40)), 30)])
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.generate([([1, V], 5)])
    with pytest.raises(EngineError, match="empty prompt"):
        engine.generate([([], 5)])
    with pytest.raises(EngineError, match="max_new_tokens"):
        engine.generate([([1], 0)])
    with pytest.raises(EngineError, match="max_position_embeddings"):
        SpeculativeEngine(target, drafter, slots=2, capacity=512)
    with pytest.raises(EngineError, match="length head"):
        no_head = Drafter(dataclasses.replace(_drafter_cfg(4), length_head=None), rngs=nnx.Rngs(2))
        SpeculativeEngine(target, no_head, slots=2, capacity=CAPACITY, policy=AdaFlashPolicy())
    table = VerifyCostTable(rows=(1,), widths=(4,), verify_ms=((1.0,),), draft_ms=(0.1,))
    with pytest.raises(EngineError, match="accept_probs"):
        head_policy = GoodputPolicy(cost=table, estimator="head", skip_draft=False)
        SpeculativeEngine(
            target, drafter, slots=2, capacity=CAPACITY, buckets=(4,), policy=head_policy
        )
    with pytest.raises(EngineError, match="width 1"):
        skipping = GoodputPolicy(cost=table)
        SpeculativeEngine(
            target, drafter, slots=2, capacity=CAPACITY, buckets=(4,), policy=skipping
        )
    other = TargetLM(dataclasses.replace(CFG, num_hidden_layers=1), rngs=nnx.Rngs(3))
    with pytest.raises(ConfigError, match="layer"):
        SpeculativeEngine(other, drafter, slots=2, capacity=CAPACITY)
    assert bucket_set((1, 2, 4, 8, 16), 10) == (1, 2, 4, 8, 10)
    assert bucket_set((1, 2, 4, 8, 16), 4) == (1, 2, 4)


# ---- goodput's "don't speculate" arm ------------------------------------------------------------
def _skip_table(draft_ms):
    return VerifyCostTable(
        rows=(1, 8),
        widths=(1, 2, 4),
        verify_ms=((1.0, 1.1, 1.2), (1.0, 1.1, 1.2)),
        draft_ms=(draft_ms, draft_ms),
    )


@pytest.mark.parametrize(
    "draft_ms,probe_every,expect",
    [(0.01, 8, "drafted"), (100.0, 1000, "undrafted"), (100.0, 2, "probed"), (100.0, 2, "mixed")],
)
def test_goodput_skip_arm_is_lossless_and_follows_the_cost(
    target, bigram, reference, draft_ms, probe_every, expect
):
    """Cheap drafts: every step drafts. Drafting costs 100 plain steps: every step is plain
    (requested 0, width 1) and the output is still plain greedy's; with a probe every 2
    steps the estimates refresh without a drafted step. Drafted and undrafted steps
    interleaved (a test policy drafting after every 2 plain steps): the same output, and no
    recompiles after the first run."""
    drafter = TableDrafter(_drafter_cfg(4), bigram)
    cost = _skip_table(draft_ms)
    policy = (
        DraftEveryNth(goodput=GoodputPolicy(cost=cost), n=2)
        if expect == "mixed"
        else GoodputPolicy(cost=cost, probe_every=probe_every)
    )
    engine = _engine(target, drafter, policy=policy, pending_steps=2)
    results = engine.generate(_requests())
    assert [r.output_ids for r in results] == reference["plain"]
    _check_stats(results, engine)
    requested = [q for r in results for q in r.requested_widths]
    undrafted = [q == 0 for q in requested]
    probes = engine.last_run["probes"]
    if expect == "drafted":
        assert not any(undrafted) and np.mean([r.tau for r in results]) > 1.5
        assert probes == 1  # the opening probe: drafting pays, and drafted steps follow
    elif expect in ("undrafted", "probed"):
        assert all(undrafted) and all(set(r.widths) == {1} for r in results)
        # the opening probe; with one every 2 undrafted steps, about one per 3 loop steps
        assert probes == 1 if expect == "undrafted" else probes >= len(requested) // 6
    else:
        assert 0.2 < np.mean(undrafted) < 0.8, requested
        warm = compiled_programs()
        again = engine.generate(_requests())
        assert [r.output_ids for r in again] == reference["plain"]
        assert compiled_programs() == warm


def test_a_probe_turns_drafting_back_on(target, bigram, reference):
    """Rows whose estimates say drafting does not pay run plain steps until a probe (one
    drafter forward) finds the drafter confident again; from then on they draft."""
    drafter = TableDrafter(_drafter_cfg(4), bigram)  # one-hot drafts: confidence 1
    policy = GoodputPolicy(cost=_skip_table(0.01), probe_every=3)
    engine = _engine(target, drafter, slots=1, policy=policy, eos_ids=())
    state = admit(engine.prefill(engine.init_state(0), [(0, PROMPTS[1], 30)]), engine.spec)
    # as if a drafter forward had just said drafting does not pay
    p = state.policy_state
    zeros = jnp.zeros_like(p.est_BxY)
    state = state.replace(policy_state=p.replace(est_BxY=zeros, prior_Y=zeros[0]))
    engine._program = UNDRAFTED
    state, steps, _, _ = engine.run(state, stop_on_finish=False, max_steps=8)
    requested = np.asarray(state.request_BxS[0, :steps]).tolist()
    assert requested[:3] == [0, 0, 0] and all(w > 0 for w in requested[3:]), requested
    assert int(state.probes) == 1
    np.testing.assert_allclose(state.policy_state.est_BxY[0], 1.0, atol=1e-3)


@pytest.mark.parametrize("draft_ms,drafts", [(100.0, False), (0.01, True)])
def test_an_engine_keeps_what_it_learnt_across_calls(target, bigram, reference, draft_ms, drafts):
    """A second `generate` starts from the prior and γ the first learnt: it needs no opening
    probe, and drafts (or not) from its first step; forgetting it brings the probe back.
    The outputs stay plain greedy's throughout."""
    drafter = TableDrafter(_drafter_cfg(4), bigram)  # one-hot drafts: confidence 1
    policy = GoodputPolicy(cost=_skip_table(draft_ms), probe_every=1000)
    engine = _engine(target, drafter, policy=policy)
    assert engine.learnt is None
    slots = engine.policy_slots
    active = jnp.ones((engine.slots,), bool)

    def probe_in(state):  # the policy's answer from the undrafted loop, before any step
        ask = dict(undrafted=0, switching=True, buckets=engine.buckets)
        return int(policy.speculate(state, active, **ask).probe_in)

    unlearnt = engine.init_state(0).policy_state  # no drafter forward: nothing learnt
    assert probe_in(policy.init(slots, unlearnt)) == 0  # the first loop probes
    for call, expect_probes in (("first", 1), ("second", 0), ("reset", 1)):
        if call == "reset":
            engine.learnt = None  # forget what the first call learnt
        results = engine.generate(_requests())
        assert [r.output_ids for r in results] == reference["plain"], call
        assert engine.last_run["probes"] == expect_probes, call
        requested = [q for r in results for q in r.requested_widths]
        assert all((q > 0) == drafts for q in requested), (call, requested)
        learnt = engine.learnt
        np.testing.assert_allclose(learnt.prior_Y, np.ones(3), atol=1e-3)
    # two calls from the same start replay each other (the benchmark's timed passes)
    replays = []
    for _ in range(2):
        engine.learnt = learnt
        results = engine.generate(_requests())
        replays.append(([r.requested_widths for r in results], engine.last_run))
    assert replays[0] == replays[1]
    engine.learnt = learnt
    start = engine.init_state(0).policy_state
    np.testing.assert_allclose(start.prior_Y, learnt.prior_Y)
    assert float(start.log_gamma) == pytest.approx(float(learnt.log_gamma))
    assert probe_in(start) == 1000  # the first probe waits for the interval
    broken = learnt.replace(log_gamma=jnp.float32(jnp.nan))
    fresh = policy.init(slots, broken)  # NaN is never carried into the next call
    assert float(fresh.prior_Y[0]) < 0 and probe_in(fresh) == 0
    with pytest.raises(ValueError, match="nodes"):
        policy.init(slots, learnt.replace(prior_Y=jnp.ones((1,))))


@pytest.mark.parametrize("draft_every,pending_steps", [(2, 2), (7, 3)])
def test_context_stays_in_sync_across_drafted_and_undrafted_steps(
    target, drafter, draft_every, pending_steps
):
    """After a run mixing drafted and undrafted steps, the drafter context plus the pending
    features hold exactly the target features of every committed token, as if appended from
    scratch. The double is asked between runs of undrafted steps, which end as the buffer
    fills: (2, 2) switches after every flush; (7, 3) flushes twice before it does."""
    goodput = GoodputPolicy(cost=_skip_table(100.0))
    engine = _engine(
        target,
        drafter,
        policy=DraftEveryNth(goodput=goodput, n=draft_every),
        eos_ids=(),
        pending_steps=pending_steps,
    )
    prompts = [PROMPTS[1], PROMPTS[4]]
    state = engine.init_state(0)
    engine._program = DRAFTED
    state = engine.prefill(state, [(0, prompts[0], 40), (1, prompts[1], 40)])
    state, steps, calls, _ = engine.run(state, stop_on_finish=False, max_steps=18)
    assert steps == 18 and not np.any(state.done_B), "every row must still be running"
    assert calls > 2, "the run should switch between the drafted and undrafted programs"
    requested = np.asarray(state.request_BxS[:, :steps])
    assert (requested == 0).any() and (requested > 0).any(), requested
    pending_B = np.asarray(state.undrafted.pending_B)
    assert pending_B.max() <= pending_steps
    np.testing.assert_array_equal(
        np.asarray(state.context_cache.lengths) + pending_B, state.target_cache.lengths
    )
    state = jax.jit(flush, static_argnums=0)(drafter, state)
    assert not np.any(state.undrafted.pending_B)

    @nnx.jit  # one program for every row (eager dispatch compiles every op on its own)
    def from_scratch(target, drafter, seq, n):
        # causal: the padding after the first n tokens changes none of their features
        feats = target(seq, feature_layers=drafter.config.target_layer_ids).features_BxTxnD
        return drafter.append_context(drafter.init_context_cache(1, CAPACITY), feats, n)

    for row, prompt in enumerate(prompts):
        out = np.asarray(state.out_BxS[row, : int(state.num_out_B[row])]).tolist()
        # every committed token but the last (the bonus: its features come with the next step)
        seq = prompt + out[:-1]
        n = len(seq)
        assert int(state.context_cache.lengths[row]) == n
        padded = jnp.asarray([seq + [0] * (CAPACITY - n)], jnp.int32)
        ref = from_scratch(target, drafter, padded, jnp.array([n]))
        assert int(ref.lengths[0]) == n
        for got, want in zip(
            jax.tree.leaves(state.context_cache.layers), jax.tree.leaves(ref.layers)
        ):
            np.testing.assert_allclose(got[row, :n], want[0, :n], atol=2e-5, rtol=1e-4)


def _unsure_engine(target, next_V, policy, **kw):
    """One slot, a table drafter whose every draft has top probability ~0.06."""
    drafter = TableDrafter(_drafter_cfg(4), next_V, sharpness=2.0)
    return _engine(target, drafter, slots=1, policy=policy, **kw)


def test_calibration_drafts_where_an_unsure_drafter_is_right(target, bigram, reference):
    """Two drafters equally unsure of every draft (top probability 0.06): the bigram one is
    often right, the other never. Uncalibrated, neither estimate pays for a draft; graded
    probes (their drafts against the tokens committed after them) lift the first row's
    calibration until it drafts, and sink the second's. Both stay lossless."""
    seen = {t for out in reference["plain"] for t in out}
    never = next(t for t in range(V) if t not in seen)
    # drafting pays when a 4-wide step is expected to commit more than 1.5 tokens
    cost = VerifyCostTable(
        rows=(1, 8), widths=(1, 2, 4), verify_ms=((1.0, 1.0, 1.0),) * 2, draft_ms=(0.5, 0.5)
    )
    runs = {}
    for name, table in (("right", bigram), ("wrong", np.full((V,), never))):
        engine = _unsure_engine(target, table, GoodputPolicy(cost=cost, probe_every=3))
        results = engine.generate(_requests())
        assert [r.output_ids for r in results] == reference["plain"], name
        runs[name] = [q for r in results for q in r.requested_widths]
    assert np.mean([q > 0 for q in runs["right"]]) > 0.3, runs["right"]
    assert not any(runs["wrong"]), "".join(map(str, runs["wrong"]))


def test_drafted_steps_calibrate_their_rows(target, bigram):
    """Verified steps feed the calibration too: an unsure drafter (confidence 0.06) that is
    often right drives its row's log γ, and the engine's, below 0 (drafts are free in this
    table, so every step drafts whatever the estimates)."""
    free_drafts = VerifyCostTable(
        rows=(1,), widths=(1, 2, 4), verify_ms=((1.0,) * 3,), draft_ms=(0,)
    )
    policy = GoodputPolicy(cost=free_drafts, probe_every=1000)
    engine = _unsure_engine(target, bigram, policy, eos_ids=())
    state = engine.prefill(engine.init_state(0), [(0, PROMPTS[1], 30)])
    engine._program = DRAFTED
    state, steps, _, _ = engine.run(state, stop_on_finish=False, max_steps=6)
    assert np.all(np.asarray(state.request_BxS[0, :steps]) > 0), "every step drafts"
    accepted = np.asarray(state.accepted_BxS[0, :steps])
    assert accepted.mean() > 0.5, accepted  # far above the ~0.06 expected per step
    row, whole = float(state.policy_state.log_gamma_B[0]), float(state.policy_state.log_gamma)
    assert row < 0 and whole < 0, (row, whole)


def test_fresh_requests_start_from_the_engines_running_estimate(target, drafter):
    """Drafter forwards (drafted steps and probes) move the prior (an EMA of the rows'
    estimates) away from 1; a request admitted later starts its estimate there, not at 1
    (the policy sees admitted rows when the next loop program begins: `admit`)."""
    policy = GoodputPolicy(cost=_skip_table(100.0), probe_every=2)
    engine = _engine(target, drafter, policy=policy, eos_ids=())
    state = engine.init_state(0)
    state = admit(engine.prefill(state, [(0, PROMPTS[0], 12)]), engine.spec)
    np.testing.assert_array_equal(state.policy_state.est_BxY[0], np.ones(3))  # no forward
    state, _, _, _ = engine.run(state, stop_on_finish=False)
    prior = np.asarray(state.policy_state.prior_Y)
    assert np.all((prior >= 0) & (prior < 0.99)), prior  # a random drafter is unsure
    state = admit(engine.prefill(state, [(1, PROMPTS[1], 5)]), engine.spec)
    np.testing.assert_allclose(state.policy_state.est_BxY[1], prior)
