"""Anchor sampling, block label masks and the resumable batch iterator (truth tables)."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.distill import anchors as A
from adaflash_jax.distill.batches import SequenceData, batch_iterator

#              prompt | response ........ | pad
MASK = np.array([0, 0, 1, 1, 1, 1, 1, 0, 0, 0], bool)


def test_admissible_truth_table():
    # a must be a response position with a+1 a response token and a ≤ S−K.
    assert A.admissible(MASK, 3).astype(int).tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    # K = 6: a ≤ 4 cuts the tail
    assert A.admissible(MASK, 6).astype(int).tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    assert not A.admissible(MASK, 11).any()  # block longer than the sequence


def _ok(rule="response", visited=None, k=3, mask=MASK):
    return A.admissible_by_rule(mask, k, rule, visited)


def test_sample_anchors_without_replacement_and_padding():
    rng = np.random.default_rng(0)
    a, v = A.sample_anchors(_ok(), 2, rng)
    assert v.tolist() == [True, True] and len(set(a.tolist())) == 2
    assert set(a.tolist()) <= {2, 3, 4, 5} and a.tolist() == sorted(a.tolist())
    a, v = A.sample_anchors(_ok(), 6, rng)  # only 4 admissible: 2 padding blocks
    assert a.tolist() == [2, 3, 4, 5, 0, 0] and v.tolist() == [1, 1, 1, 1, 0, 0]
    a, v = A.sample_anchors(_ok("visited", np.array([0, 3, 5, 9, -1])), 3, rng)
    assert a.tolist() == [3, 5, 0] and v.tolist() == [True, True, False]


def test_sequence_rule_truth_table():
    # The reference's offline head init: K <= a < len - K over the whole non-padding sequence
    # (prompt included); its labels cover every non-padding token.
    mask = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], bool)  # len 12
    assert A.sequence_length(mask) == 12
    assert np.flatnonzero(_ok("sequence", k=3, mask=mask)).tolist() == [3, 4, 5, 6, 7, 8]
    assert A.sequence_mask(mask).astype(int).tolist() == [1] * 12 + [0, 0]
    assert not _ok("sequence", k=6, mask=mask).any()  # len - K <= K: no block
    with pytest.raises(ValueError, match="anchor rule"):
        _ok("everywhere")
    with pytest.raises(ValueError, match="recorded block starts"):
        _ok("visited")


def test_stage2_anchors_cover_the_response_uniformly():
    """χ² test: with the default ("response") rule, every admissible response position is an
    anchor equally often, as the reference's uniform resampling every forward pass draws
    them (no bias towards the block starts the drafter visited)."""
    resp = np.zeros(80, bool)
    resp[10:70] = True
    ok = _ok(k=8, mask=resp)
    cells = np.flatnonzero(ok)
    rng = np.random.default_rng(3)
    counts = collections.Counter()
    draws, n = 600, 12
    for _ in range(draws):
        counts.update(A.sample_anchors(ok, n, rng)[0].tolist())
    observed = np.array([counts[c] for c in cells], float)
    expected = draws * n / len(cells)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = len(cells) - 1
    assert set(counts) == set(cells.tolist())  # nothing outside the admissible positions
    assert chi2 < dof + 4 * np.sqrt(2 * dof), (chi2, dof)  # ~4 sigma for χ²(dof)


def test_sample_anchors_is_uniform():
    counts = collections.Counter()
    rng = np.random.default_rng(1)
    for _ in range(2000):
        counts.update(A.sample_anchors(_ok(), 2, rng)[0].tolist())
    freq = np.array([counts[i] for i in (2, 3, 4, 5)]) / 4000
    np.testing.assert_allclose(freq, 0.25, atol=0.03)


def test_block_targets_truth_table():
    tokens = jnp.arange(10)[None] + 100
    anchors = jnp.array([[2, 5, 0]])
    valid = jnp.array([[True, True, False]])
    labels, mask, tpos = A.block_targets(tokens, jnp.asarray(MASK)[None], anchors, valid, 4)
    assert labels[0, :2].tolist() == [[103, 104, 105], [106, 107, 108]]
    # anchor 5: labels 6 (response), 7, 8 (padding) → masked; padding block fully masked
    assert mask[0].astype(int).tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert tpos[0, :2].tolist() == [[2, 3, 4], [5, 6, 7]]  # teacher at ℓ − 1


def _data(m=5, s=10):
    tokens = np.arange(m * s, dtype=np.int32).reshape(m, s)
    mask = np.tile(MASK, (m, 1))
    return SequenceData(tokens=tokens, loss_mask=mask, domain=np.zeros(m, np.int32))


def test_iterator_resume_epochs_and_process_split(tmp_path):
    data = _data()
    data.save(str(tmp_path / "d"))
    data = SequenceData.load(str(tmp_path / "d"))
    kw = dict(global_batch=4, num_anchors=2, block_size=3, seed=7)
    it = batch_iterator(data, **kw)
    batches = [next(it) for _ in range(5)]  # 20 rows over 5 examples: 4 epochs
    firsts = [b["tokens"][:, 0] // 10 for b in batches]
    seen = np.concatenate(firsts)
    for e in range(4):  # every epoch visits every example exactly once
        assert sorted(seen[5 * e : 5 * e + 5].tolist()) == [0, 1, 2, 3, 4]
    # anchors are resampled across epochs for the same example
    per_example = collections.defaultdict(set)
    for b in batches:
        for row, anc in zip(b["tokens"][:, 0] // 10, b["anchors"]):
            per_example[int(row)].add(tuple(anc.tolist()))
    assert any(len(v) > 1 for v in per_example.values())
    # resume from the state after 2 batches
    it2 = batch_iterator(data, **kw)
    next(it2), next(it2)
    state = it2.get_state()
    it3 = batch_iterator(data, **kw)
    it3.set_state(state)
    for want in batches[2:]:
        got = next(it3)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    # two processes each hold half the rows (anchors included) of the same global batch
    halves = [next(batch_iterator(data, **kw, process_index=p, process_count=2)) for p in (0, 1)]
    for k in batches[0]:
        both = np.stack([halves[0][k], halves[1][k]], axis=1).reshape(batches[0][k].shape)
        np.testing.assert_array_equal(both, batches[0][k])


def test_iterator_anchor_rules():
    """The iterator draws by its rule: "visited" keeps recorded starts only; "sequence"
    serves the non-padding mask as the label mask."""
    data = _data()
    visited = np.tile(np.array([3, 4, -1]), (len(data), 1)).astype(np.int32)
    data = SequenceData(
        tokens=data.tokens, loss_mask=data.loss_mask, domain=data.domain, visited=visited
    )
    kw = dict(global_batch=5, num_anchors=3, block_size=3, seed=0)
    b = next(batch_iterator(data, **kw, anchor_rule="visited"))
    assert {int(a) for a, v in zip(b["anchors"].ravel(), b["valid"].ravel()) if v} <= {3, 4}
    b = next(batch_iterator(data, **kw, anchor_rule="sequence"))
    assert b["loss_mask"][0].astype(int).tolist() == [1] * 7 + [0] * 3
    assert set(b["anchors"][b["valid"]].tolist()) <= {3}  # K <= a < 7 - K
    with pytest.raises(ValueError, match="recorded block starts"):
        batch_iterator(_data(), **kw, anchor_rule="visited")
