"""Speculative SAMPLING is lossless: generated-token distributions match plain sampling.

Tiny-vocab target (V = 16) whose LM head is scaled up so its distributions are peaked; the
random drafter shares that head, so its proposals are peaked too but on the wrong tokens —
a biased acceptance rule shows up immediately, while acceptance still happens (tau > 1).
Two-sample chi-square over the per-position token counts of generated tokens 2..5 (token 1
comes from the prefill, not from speculation); fixed seeds, so the test is deterministic.
"""

import dataclasses

import jax
import jax.numpy as jnp
import jax.scipy.stats as jst
import numpy as np
import pytest
from doubles import DraftEveryNth, always_accept
from flax import nnx

from adaflash_jax.decode import acceptance
from adaflash_jax.decode.generate import generate
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.policy import AdaFlashPolicy, FixedPolicy, TreeBatchPolicy
from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.decode.tree import TreeShape
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io.cost_table import VerifyCostTable
from adaflash_jax.model.packing import Packing
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM

V, N, MAX_NEW, TEMPERATURE = 16, 2048, 5, 1.0
PROMPT = [3, 1, 4, 1, 5]
CFG = target_preset("test", vocab_size=V)
P_HONEST = 1e-3  # a lossless engine fails this with probability 1/1000
P_BIASED = 1e-6


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def models(request):
    """The dense test target, and a hybrid one (Gated DeltaNet layers: the recurrent state
    replays each row's accepted prefix, docs/design.md §5.2)."""
    cfg = CFG if request.param == "dense" else target_preset("test-hybrid", vocab_size=V)
    target = TargetLM(cfg, rngs=nnx.Rngs(0))
    target.lm_head.kernel.set_value(target.lm_head.kernel[...] * 15.0)  # peaked distributions
    dcfg = DrafterConfig.for_target(
        cfg, mask_token_id=V - 1, num_layers=1, block_size=4, num_features=2
    )
    return target, Drafter(dcfg, rngs=nnx.Rngs(1))


def _counts(outputs_NxM):
    return np.stack([np.bincount(outputs_NxM[:, j], minlength=V) for j in range(1, MAX_NEW)])


def chi_square_p(counts_a, counts_b) -> float:
    """Two-sample chi-square homogeneity test summed over positions (one table each)."""
    stat, dof = 0.0, 0
    for a, b in zip(counts_a, counts_b):
        seen = (a + b) > 0
        a, b = a[seen].astype(float), b[seen].astype(float)
        total = a + b
        ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
        stat += float(np.sum((a - ea) ** 2 / ea + (b - eb) ** 2 / eb))
        dof += len(a) - 1
    return float(jst.chi2.sf(stat, dof))


@pytest.fixture(scope="module")
def plain_counts(models):
    target, _ = models
    out = generate(target, [PROMPT] * N, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, seed=1)
    return _counts(np.asarray(out))


def _speculative(models, **kw):
    target, drafter = models
    engine = SpeculativeEngine(
        target, drafter, slots=N, capacity=32, temperature=TEMPERATURE, eos_ids=(), seed=2, **kw
    )
    results = engine.generate([(PROMPT, MAX_NEW)] * N)
    for r in results:
        assert set(r.widths) <= set(engine.buckets) or engine.spec.packed
        # requested 0 = an undrafted (plain) step of goodput's skip arm: width 1
        assert all(1 <= q <= w or q == 0 == w - 1 for q, w in zip(r.requested_widths, r.widths))
    return np.asarray([r.output_ids for r in results]), results


@pytest.mark.parametrize(
    "models,accept_fn,lossless",
    [("dense", None, True), ("hybrid", None, True), ("dense", always_accept, False)],
    ids=["rejection-dense", "rejection-hybrid", "biased-dense"],  # biased: the test's power
    indirect=["models"],
)
def test_sampling_matches_plain_and_catches_a_biased_rule(
    models, plain_counts, accept_fn, lossless
):
    outputs, results = _speculative(models, buckets=(4,), acceptance=accept_fn)
    p = chi_square_p(plain_counts, _counts(outputs))
    if lossless:
        assert np.mean([r.tau for r in results]) > 1.3, "acceptance must actually happen"
        assert p > P_HONEST, f"speculative sampling differs from plain sampling (p={p:.2e})"
    else:
        assert p < P_BIASED, f"the test failed to catch always-accept (p={p:.2e})"


GOODPUT_TABLE = VerifyCostTable(
    rows=(1, N),
    widths=(1, 2, 4),
    verify_ms=((1.0, 1.2, 2.1), (1.0, 1.2, 2.1)),
    draft_ms=(0.1, 0.1),
    device="synthetic",
)


# Drafting costs 12 plain steps: goodput's skip arm runs undrafted steps and probes (a
# drafter forward, no verify) after every 2 of them; the test double drafts after every 2, so
# its run mixes drafted and plain steps.
SKIP_TABLE = dataclasses.replace(GOODPUT_TABLE, draft_ms=(12.0, 12.0))


POLICY_CASES = {
    "adaflash": (AdaFlashPolicy(threshold=0), "padded"),
    "goodput": (GoodputPolicy(cost=GOODPUT_TABLE, skip_draft=False), "padded"),
    "goodput-skip-probing": (GoodputPolicy(cost=SKIP_TABLE, probe_every=2), "padded"),
    # asked between runs of undrafted steps: a 2-step buffer (pending_steps) ends each
    "mixed": (DraftEveryNth(goodput=GoodputPolicy(cost=SKIP_TABLE), n=2), "padded"),
}


@pytest.mark.parametrize(
    "models,policy,verify",
    [(m, *case) for m in ("dense", "hybrid") for case in POLICY_CASES.values()]
    # packed: each row verifies its own tokens only; its sampled acceptance is layout-only
    + [("dense", AdaFlashPolicy(threshold=0), "packed")],
    ids=[f"{name}-{m}" for m in ("dense", "hybrid") for name in POLICY_CASES]
    + ["adaflash-packed-dense"],
    indirect=["models"],
)
def test_sampling_stays_lossless_under_each_policy(models, plain_counts, policy, verify):
    outputs, results = _speculative(
        models, buckets=(1, 2, 4), policy=policy, verify=verify, pending_steps=2
    )
    requested = [w for r in results for w in r.requested_widths]
    assert set(requested) - {4}, f"the policy should shorten some blocks, asked {set(requested)}"
    undrafted = np.mean([w == 0 for w in requested])
    if isinstance(policy, DraftEveryNth):
        assert 0.2 < undrafted < 0.8, f"expected mixed drafted/plain steps, {undrafted:.2f}"
    elif policy.name == "goodput" and policy.skip_draft:
        assert undrafted > 0.8, f"drafting costs 12 plain steps, yet {1 - undrafted:.2f} drafted"
    p = chi_square_p(plain_counts, _counts(outputs))
    assert p > P_HONEST, f"{policy.name}: sampling is no longer lossless (p={p:.2e})"


TREE_FILLS = (1, 2, 3, 4, 6, 7)  # a 6-node tree's rows verify up to 7 tokens
TREE_TABLE = dataclasses.replace(
    GOODPUT_TABLE,
    fills=TREE_FILLS,
    packed_ms=(tuple(1.0 + 0.1 * f for f in TREE_FILLS),) * 2,
)


@pytest.mark.parametrize(
    "policy",
    [
        FixedPolicy(),
        TreeBatchPolicy(mean_nodes=2),
        # goodput's per-row node counts, drafted steps between pairs of plain ones
        DraftEveryNth(goodput=GoodputPolicy(cost=TREE_TABLE), n=2),
    ],
    ids=["per-row", "batch", "goodput-mixed"],
)
def test_tree_sampling_matches_plain(models, plain_counts, policy):
    """Draft trees (2 draws from q per position, 6 nodes a row): recursive rejection over a
    node's children picks the child to follow, so every committed token is a plain sample."""
    outputs, results = _speculative(
        models, verify="packed", tree=TreeShape(topk=2, nodes=6), policy=policy, pending_steps=2
    )
    if isinstance(policy, DraftEveryNth):
        requested = [w for r in results for w in r.requested_widths]
        assert 0 in requested and set(requested) - {0, 7}, f"mixed widths: {set(requested)}"
    tau = np.mean([r.tau for r in results])
    p = chi_square_p(plain_counts, _counts(outputs))
    assert tau > 1.05, "acceptance must actually happen"  # the drafter is random
    assert p > P_HONEST, f"sampled tree decoding differs from plain sampling (p={p:.2e})"


def _rejection_rows(key, drafts_BxKm1, q_BxKm1xV, logits_BxWxV, width_B):
    """`acceptance.accept` with the rejection rule over rows in the row layout."""
    b, w, v = logits_BxWxV.shape
    tokens_BxK = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), drafts_BxKm1], axis=1)
    return acceptance.accept(
        acceptance.rejection_accept,
        key,
        Packing.dense(b, w),
        tokens_BxK,
        q_BxKm1xV,
        logits_BxWxV.reshape(b * w, v),
        width_B,
        1.0,
        None,
    )


def test_rejection_acceptance_unit():
    """Hand-checkable cases: p == q accepts everything; p = 0 at a draft rejects it and the
    bonus then comes from the residual, never the rejected token."""
    accept = jax.jit(_rejection_rows)
    logits = jnp.log(jnp.array([[[0.5, 0.5, 1e-9, 1e-9]] * 3] * 5))  # [5, 3, 4]
    q = jnp.array([[[0.5, 0.5, 0.0, 0.0]] * 2] * 5)
    drafts = jnp.array([[0, 1]] * 5)
    n, _ = accept(jax.random.key(0), drafts, q, logits, jnp.full((5,), 3))
    assert n.tolist() == [2] * 5
    n, _ = accept(jax.random.key(0), drafts, q, logits, jnp.full((5,), 2))
    assert n.tolist() == [1] * 5  # capped at width − 1
    q_bad = jnp.array([[[0.0, 0.0, 1.0, 0.0]] * 2] * 5)
    n, bonus = accept(jax.random.key(1), drafts + 2, q_bad, logits, jnp.full((5,), 3))
    assert n.tolist() == [0] * 5 and set(bonus.tolist()) <= {0, 1}


def test_rejection_acceptance_without_drafts():
    """Width 1 (an undrafted step, or a one-token verify branch): no drafts, the token is a
    plain sample from p."""
    p = jnp.array([0.1, 0.6, 0.3, 0.0])
    logits = jnp.broadcast_to(jnp.log(jnp.maximum(p, 1e-30)), (4096, 1, 4))
    drafts, q = jnp.zeros((4096, 0), jnp.int32), None
    n, tok = jax.jit(_rejection_rows)(
        jax.random.key(3), drafts, q, logits, jnp.ones((4096,), jnp.int32)
    )
    assert set(n.tolist()) == {0}
    freq = np.bincount(np.asarray(tok), minlength=4) / 4096
    np.testing.assert_allclose(freq, p, atol=0.03)
