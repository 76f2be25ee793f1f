"""Speculative decoding on a hybrid Gated-DeltaNet target (docs/design.md §5.2): each row's
recurrent state ends at its own accepted length, so greedy speculative decoding equals plain
greedy decoding, the state after partly rejected steps equals a fresh prefill of the committed
tokens, and goodput's undrafted steps and probes and split rows keep it so."""

import jax.numpy as jnp
import numpy as np
import pytest
from doubles import DraftEveryNth, TableDrafter, skip_cost_table
from flax import nnx

from adaflash_jax.decode.generate import generate
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.recurrent_state import RecurrentState
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rows import RowLayout, fetch
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.mesh import make_mesh

V = 128
CFG = target_preset("test-hybrid", vocab_size=V, max_position_embeddings=256)
CAPACITY = 64
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9], list(range(20, 32)), [7] * 5]
MAX_NEW = [9, 6, 13, 3, 11, 8]


@pytest.fixture(scope="module")
def target():
    return TargetLM(CFG, rngs=nnx.Rngs(0), chunk=4)


def _drafter_cfg(block_size=4):
    return DrafterConfig.for_target(
        CFG, mask_token_id=V - 1, num_layers=1, block_size=block_size, num_features=2
    )


@pytest.fixture(scope="module")
def reference(target):
    return generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=())


@pytest.fixture(scope="module")
def bigram(reference):
    """Most frequent successor of each token in the reference: a drafter that is often right,
    so acceptance is partial and ragged, and the recurrent replay stops mid-block."""
    counts = np.zeros((V, V), np.int64)
    for prompt, out in zip(PROMPTS, reference):
        seq = prompt + out
        for a, b in zip(seq[:-1], seq[1:]):
            counts[a, b] += 1
    return np.where(counts.sum(1) > 0, counts.argmax(1), (np.arange(V) + 1) % V)


def _requests():
    return list(zip(PROMPTS, MAX_NEW, strict=True))


@pytest.mark.parametrize("drafter_kind", ["table", "dflash"])
def test_greedy_speculative_equals_plain(target, bigram, reference, drafter_kind):
    """A table drafter (ragged, partial acceptance) and a real DFlash drafter fed by the
    hybrid's features: the same tokens as plain greedy decoding."""
    if drafter_kind == "table":
        drafter = TableDrafter(_drafter_cfg(), bigram)
    else:
        drafter = Drafter(_drafter_cfg(), rngs=nnx.Rngs(1))
    engine = SpeculativeEngine(target, drafter, slots=3, capacity=CAPACITY, buckets=(1, 2, 4))
    results = engine.generate(_requests())
    assert [r.output_ids for r in results] == reference
    if drafter_kind == "table":
        accepted = [a for r in results for a in r.accepted]
        assert np.mean(accepted) > 0.5 and min(accepted) < 3  # partial, ragged acceptance


def test_state_after_partly_rejected_steps_equals_a_fresh_prefill(target, bigram):
    """After drafted steps that accepted part of their blocks, every row's conv history and
    delta state equal those of a fresh prefill of the tokens it committed."""
    engine = SpeculativeEngine(
        target, TableDrafter(_drafter_cfg(), bigram), slots=2, capacity=CAPACITY, eos_ids=()
    )
    state = engine.prefill(engine.init_state(0), [(0, PROMPTS[1], 30), (1, PROMPTS[4], 30)])
    state, steps, _, _ = engine.run(state, stop_on_finish=False, max_steps=5)
    accepted = np.asarray(state.accepted_BxS[:, :5])
    assert ((accepted > 0) & (accepted < 3)).any(), accepted  # some steps rejected a suffix
    lengths = np.asarray(state.target_cache.lengths)
    out = np.asarray(state.out_BxS)
    for row, prompt in enumerate((PROMPTS[1], PROMPTS[4])):
        committed = prompt + out[row, : lengths[row] - len(prompt)].tolist()
        fresh = target(jnp.asarray([committed]), cache=target.init_cache(1, CAPACITY)).cache
        for ours, want in zip(state.target_cache.layers, fresh.layers):
            if not isinstance(want, RecurrentState):
                continue
            np.testing.assert_allclose(ours.history_BxA1xX[row], want.history_BxA1xX[0], atol=1e-5)
            np.testing.assert_allclose(
                ours.state_BxJxDkxDv[row], want.state_BxJxDkxDv[0], atol=1e-4
            )


def test_goodput_undrafted_steps_stay_lossless(target, bigram, reference):
    """Drafted and undrafted (plain: the recurrent form, state moved in "write" mode) steps
    interleaved: the same tokens as plain greedy decoding. (Probes, and goodput under
    sampling, run on a hybrid in test_sampled_lossless.py.)"""
    goodput = GoodputPolicy(cost=skip_cost_table(100.0))
    engine = SpeculativeEngine(
        target,
        TableDrafter(_drafter_cfg(), bigram),
        slots=2,
        capacity=CAPACITY,
        buckets=(1, 2, 4),
        policy=DraftEveryNth(goodput=goodput, n=2),
        pending_steps=2,
    )
    results = engine.generate(_requests())
    assert [r.output_ids for r in results] == reference
    requested = [q for r in results for q in r.requested_widths]
    assert 0 in requested and max(requested) > 1  # undrafted and drafted steps both ran


def test_rows_split_over_eight_devices_decode_the_same(target, reference):
    """Slots (recurrent states included) split over (data, fsdp): the plain tokens, and the
    recurrent state really is split."""
    mesh = make_mesh(2, 4, 1)
    rows = RowLayout.of(mesh, TRAIN_RULES, 8)
    drafter = Drafter(_drafter_cfg(), rngs=nnx.Rngs(1))
    engine = SpeculativeEngine(target, drafter, slots=8, capacity=CAPACITY, rows=rows)
    results = engine.generate(_requests())
    assert [r.output_ids for r in results] == reference
    state = engine.prefill(engine.init_state(0), [(0, PROMPTS[0], 4)])
    delta = state.target_cache.layers[0].state_BxJxDkxDv
    assert delta.addressable_shards[0].data.shape[0] == 1  # one row per chip
    assert fetch(state.num_out_B)[0] == 1
