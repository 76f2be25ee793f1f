"""Packed verification (docs/design.md §5.5): each row verifies only its own tokens, packed
into one stream. Greedy packed == padded == plain decoding token for token, with ragged
per-row widths (1 next to K), on dense, hybrid and MoE targets; the target runs fewer tokens;
no recompiles after warm-up; rows split over 8 devices decode the same. (Sampled packed
verification: tests/test_sampled_lossless.py.)"""

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from doubles import TableDrafter, WobblePolicy
from flax import nnx

from adaflash_jax.decode.generate import generate
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.policy import Draft
from adaflash_jax.decode.programs import compiled_programs
from adaflash_jax.decode.slots import EngineError, SpeculativeEngine, token_bucket_set
from adaflash_jax.drafter.config import DrafterConfig
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


def test_packing_moves_rows_to_a_stream_and_back():
    width_B = jnp.asarray([2, 0, 3, 1])
    packing = Packing.create(width_B, tokens=8, row_width=4)
    assert packing.row_M.tolist()[:6] == [0, 0, 2, 2, 2, 3]
    assert packing.col_M.tolist()[:6] == [0, 1, 0, 1, 2, 0]
    assert packing.valid_M.tolist() == [True] * 6 + [False] * 2
    x_BxW = jnp.arange(16).reshape(4, 4) + 1
    np.testing.assert_array_equal(packing.pack(x_BxW)[:6], [1, 2, 9, 10, 11, 13])
    back = packing.unpack(packing.pack(x_BxW))
    keep = np.arange(4)[None] < np.asarray(width_B)[:, None]
    np.testing.assert_array_equal(np.where(keep, x_BxW, 0), back)  # zeros past each width
    np.testing.assert_array_equal(
        packing.positions(jnp.asarray([10, 20, 30, 40]))[:6], [10, 11, 30, 31, 32, 40]
    )
    dense = Packing.dense(2, 3)
    np.testing.assert_array_equal(dense.unpack(dense.pack(x_BxW[:2, :3])), x_BxW[:2, :3])


def test_token_buckets_cover_every_row_at_full_width():
    assert token_bucket_set(4, (1, 2, 4, 8)) == (4, 8, 12, 16, 24, 32)
    assert token_bucket_set(1, (1, 4)) == (1, 2, 3, 4)


@pytest.fixture(scope="module", params=["test", "test-hybrid", "micro-moe"])
def setup(request):
    """A target, its plain greedy outputs, and a bigram table drafter that is often right
    (acceptance is partial and ragged)."""
    cfg = target_preset(request.param, vocab_size=V, max_position_embeddings=256)
    target = TargetLM(cfg, rngs=nnx.Rngs(0))
    plain = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=())
    counts = np.zeros((V, V), np.int64)
    for prompt, out in zip(PROMPTS, plain, strict=True):
        seq = prompt + out
        for a, b in zip(seq[:-1], seq[1:]):
            counts[a, b] += 1
    bigram = np.where(counts.sum(1) > 0, counts.argmax(1), (np.arange(V) + 1) % V)
    dcfg = DrafterConfig.for_target(
        cfg, mask_token_id=V - 1, num_layers=1, block_size=K, num_features=2
    )
    return target, plain, TableDrafter(dcfg, bigram)


@dataclasses.dataclass(frozen=True)
class SlotWidths(WobblePolicy):
    """Slot 0 verifies 1 token, slot 1 all K, the others wobble with their drafts."""

    name = "slot-widths"

    def widths(self, draft, state):
        wobble_B, state = super().widths(draft, state)
        slot_B = jnp.arange(wobble_B.shape[0])
        return jnp.where(slot_B == 0, 1, jnp.where(slot_B == 1, K, wobble_B)), state


def _engine(setup, verify, **kw):
    target, _, drafter = setup
    kw = dict(slots=3, capacity=CAPACITY, buckets=(1, 2, 4, 8), eos_ids=()) | kw
    return SpeculativeEngine(target, drafter, policy=SlotWidths(), verify=verify, **kw)


def test_packed_equals_padded_equals_plain(setup):
    """Ragged per-row widths (1 next to K, and 1..K from each row's draft): the same tokens and
    the same accepted counts per step, while the target runs fewer tokens."""
    target, plain, _ = setup
    packed = _engine(setup, "packed")
    by_packed = packed.generate(REQUESTS)
    assert [r.output_ids for r in by_packed] == plain
    widths = [w for r in by_packed for w in r.widths]
    assert 1 in widths and K in widths, f"want width-1 rows next to width-K rows: {widths}"
    assert all(r.widths == r.requested_widths for r in by_packed)  # each row at its own width
    if target.config.is_hybrid or target.config.num_experts:
        return  # padded == plain on these: test_hybrid_speculative.py, test_moe_downstream.py
    padded = _engine(setup, "padded")
    by_padded = padded.generate(REQUESTS)
    assert [r.output_ids for r in by_padded] == plain
    assert [r.accepted for r in by_packed] == [r.accepted for r in by_padded]
    assert packed.last_run["verified_tokens"] == padded.last_run["verified_tokens"]
    assert packed.last_run["computed_tokens"] < padded.last_run["computed_tokens"]
    warm = compiled_programs()
    for shift in (1, 2):  # other prompts and budgets → other widths and token buckets
        requests = [([(t + shift) % V for t in p], m + shift) for p, m in REQUESTS]
        packed.generate(requests)
    assert compiled_programs() == warm


@pytest.mark.parametrize("setup", ["test-hybrid"], indirect=True)  # recurrent states split too
def test_rows_split_over_eight_devices_decode_the_same(setup):
    """Slots split over (data, fsdp): the packed stream's tokens come from every shard's rows."""
    _, plain, _ = setup
    rows = RowLayout.of(make_mesh(2, 4, 1), TRAIN_RULES, 8)
    engine = _engine(setup, "packed", slots=8, rows=rows)
    assert [r.output_ids for r in engine.generate(REQUESTS)] == plain


def test_token_buckets_must_reach_every_row_at_full_width(setup):
    with pytest.raises(EngineError, match="reach slots"):
        _engine(setup, "packed", token_buckets=(3, 6))
    with pytest.raises(EngineError, match="verify must be one of"):
        _engine(setup, "ragged")


PACKED_TABLE = VerifyCostTable(
    rows=(3,),
    widths=(1, 2, 4, 8),
    verify_ms=((1.0, 1.3, 1.9, 3.1),),
    draft_ms=(0.4,),
    fills=(1, 2, 3, 4, 6, 8),
    packed_ms=((1.0, 1.3, 1.6, 1.9, 2.5, 3.1),),
)


def _packed_rate(gain_BxK, w_B, token_buckets):
    """Expected committed tokens per ms of widths `w_B` under PACKED_TABLE."""
    bucket = min(p for p in token_buckets if p >= sum(w_B))
    ms = PACKED_TABLE.draft_ms[0] + PACKED_TABLE.packed(3, bucket // 3)
    return sum(gain_BxK[b, w - 1] for b, w in enumerate(w_B)) / ms


def test_goodput_packed_widths_are_the_best_allocation():
    """Goodput's per-row widths under packed verify reach the brute-force best expected
    committed tokens per ms over every width vector in [1, K]^B (cost: the draft + packed
    verify of the smallest token bucket that holds Σ w_b)."""
    policy = GoodputPolicy(cost=PACKED_TABLE, skip_draft=False)
    token_buckets = token_bucket_set(3, (1, 2, 4, 8))
    rng = np.random.default_rng(0)
    for _ in range(3):
        a_BxKm1 = jnp.asarray(rng.uniform(0.05, 0.98, (3, K - 1)), jnp.float32)
        draft = Draft(
            hidden_BxKxD=jnp.zeros((3, K, 1)),
            logits_BxKm1xV=jnp.zeros((3, K - 1, 2)),
            length_r_B=None,
            head_accept_BxKm1=a_BxKm1,
            active_B=jnp.ones((3,), bool),
            num_running=jnp.int32(3),
            buckets=(1, 2, 4, 8),
            token_buckets=token_buckets,
        )
        head_policy = dataclasses.replace(policy, estimator="head")
        width_B, _ = head_policy.widths(draft, ())
        gain_BxK = 1 + np.concatenate(
            [np.zeros((3, 1)), np.cumsum(np.cumprod(np.asarray(a_BxKm1), axis=1), axis=1)], 1
        )

        every = itertools.product(range(1, K + 1), repeat=3)
        best = max(_packed_rate(gain_BxK, w, token_buckets) for w in every)
        ours = _packed_rate(gain_BxK, np.asarray(width_B).tolist(), token_buckets)
        assert ours == pytest.approx(best, rel=1e-5)


@pytest.mark.parametrize("setup", ["test"], indirect=True)  # the dense target is enough here
def test_goodput_packed_stays_lossless(setup):
    """Goodput with its skip arm over packed verify (the per-row widths: the test above)."""
    target, plain, drafter = setup
    policy = GoodputPolicy(cost=PACKED_TABLE)
    engine = SpeculativeEngine(
        target, drafter, slots=3, capacity=CAPACITY, buckets=(1, 2, 4, 8), eos_ids=(),
        policy=policy, verify="packed",
    )  # fmt: skip
    results = engine.generate(REQUESTS)
    assert [r.output_ids for r in results] == plain
    assert max(w for r in results for w in r.requested_widths) > 1, "goodput should draft"
    with pytest.raises(EngineError, match="packed form"):
        SpeculativeEngine(
            target, drafter, slots=3, capacity=CAPACITY, policy=policy, verify="packed",
            token_buckets=(3, 5, 24),
        )  # fmt: skip
