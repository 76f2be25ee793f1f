"""Drafter: block masks, serving path == training path, length head, feature-layer defaults."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.drafter import masks
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.length_head import length_label, verify_length
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.config import ConfigError, TargetConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM

TARGET = target_preset("test", vocab_size=96, num_hidden_layers=6)


@pytest.fixture(scope="module")
def models():
    target = TargetLM(TARGET, rngs=nnx.Rngs(0))
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=95, num_layers=2, block_size=4, num_features=3
    )
    return target, Drafter(cfg, rngs=nnx.Rngs(1))


def test_default_feature_layers_follow_design_formula():
    cfg36 = TargetConfig(**{**TARGET.__dict__, "num_hidden_layers": 36})
    assert cfg36.default_feature_layers(5) == (1, 9, 17, 25, 33)
    assert cfg36.default_feature_layers(1) == (18,)
    assert TARGET.default_feature_layers(3) == (1, 2, 3)


def test_decode_mask_truth_table():
    m = np.asarray(masks.decode_mask(jnp.array([2, 0]), context_capacity=3, block_size=2))
    # row 0: context slots 0,1 visible, slot 2 (stale) hidden; block fully visible both ways
    assert m[0].tolist() == [[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]]
    # row 1: empty context
    assert m[1].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]


def test_train_mask_truth_table():
    anchors = jnp.array([[1, 3]])
    valid = jnp.array([[True, False]])
    m = np.asarray(masks.train_mask(anchors, valid, seq_len=4, block_size=2)).astype(int)
    expected = [
        # ctx 0..3   block0 block1
        [1, 0, 0, 0, 1, 1, 0, 0],  # block 0 (anchor 1) sees context strictly before 1
        [1, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1],  # block 1 is padding: sees only itself
        [0, 0, 0, 0, 0, 0, 1, 1],
    ]
    assert m[0].tolist() == expected


def test_serving_draft_equals_training_blocks(models):
    """Each training block equals the serving path with the same context, bitwise-close."""

    @nnx.jit  # one program for both paths (eager dispatch compiles every op on its own)
    def both(target, drafter, tokens, anchors):
        feats = target(tokens, feature_layers=drafter.config.target_layer_ids).features_BxTxnD
        hidden = drafter.train_hidden(
            feats, tokens, anchors, jnp.ones((2, 3), bool), target.embedding_VxD()
        )
        served = []
        for j in range(anchors.shape[1]):
            a_B = anchors[:, j]
            cache = drafter.init_context_cache(2, 16)
            cache = drafter.append_context(cache, feats, num_new_B=a_B)  # ragged: features[:a]
            bonus = jnp.take_along_axis(tokens, a_B[:, None], axis=1)[:, 0]
            out = drafter.draft(cache, bonus, target.embedding_VxD(), target.lm_head_DxV())
            want_logits = drafter.logits(hidden[:, j, 1:], target.lm_head_DxV())
            served.append((out.hidden_BxKxD, out.logits_BxKm1xV, want_logits))
        return hidden, served

    tokens = jax.random.randint(jax.random.key(3), (2, 14), 0, 90)
    anchors = jnp.array([[3, 9, 5], [1, 7, 10]])
    hidden, served = both(*models, tokens, anchors)
    for j, (out_hidden, out_logits, want_logits) in enumerate(served):
        np.testing.assert_allclose(out_hidden, hidden[:, j], atol=1e-5)
        np.testing.assert_allclose(out_logits, want_logits, atol=1e-4)


def test_incremental_context_equals_one_shot(models):
    @nnx.jit  # one program (eager dispatch compiles every op on its own)
    def one_and_incremental(target, drafter, feats, bonus):
        emb, head = target.embedding_VxD(), target.lm_head_DxV()
        one = drafter.append_context(drafter.init_context_cache(1, 12), feats)
        inc = drafter.init_context_cache(1, 12)
        for lo, hi in ((0, 4), (4, 5), (5, 9)):
            inc = drafter.append_context(inc, feats[:, lo:hi])
        return drafter.draft(one, bonus, emb, head), drafter.draft(inc, bonus, emb, head)

    feats = jax.random.normal(jax.random.key(4), (1, 9, 3 * 32))
    a, b = one_and_incremental(*models, feats, jnp.array([7]))
    np.testing.assert_allclose(a.logits_BxKm1xV, b.logits_BxKm1xV, atol=1e-5)


def test_draft_ignores_stale_context(models):
    """Rolled-back context entries (past `lengths`) must not change the draft."""

    @nnx.jit
    def stale_and_clean(target, drafter, feats):
        cache = drafter.append_context(drafter.init_context_cache(1, 12), feats)
        short = cache.with_lengths(jnp.array([5]))
        clean = drafter.append_context(drafter.init_context_cache(1, 12), feats[:, :5])
        emb, head = target.embedding_VxD(), target.lm_head_DxV()
        return (
            drafter.draft(short, jnp.array([3]), emb, head).logits_BxKm1xV,
            drafter.draft(clean, jnp.array([3]), emb, head).logits_BxKm1xV,
        )

    short, clean = stale_and_clean(*models, jax.random.normal(jax.random.key(5), (1, 8, 3 * 32)))
    np.testing.assert_allclose(short, clean, atol=1e-5)


def test_length_head_rule_and_label(models):
    _, drafter = models
    r = drafter.length_head(jax.random.normal(jax.random.key(6), (3, 4, 32)))
    assert r.shape == (3,) and bool(jnp.all((r > 0) & (r < 1)))
    assert length_label(jnp.array([0, 3, 15]), 16).tolist() == [1 / 16, 4 / 16, 1.0]
    assert verify_length(jnp.array([0.0, 0.25, 0.99]), 16).tolist() == [1, 5, 16]


def test_drafter_config_rejects_bad_fields():
    with pytest.raises(ConfigError, match="mask_token_id"):
        DrafterConfig.for_target(TARGET, mask_token_id=96)
    with pytest.raises(ConfigError, match="target layer id 6"):
        DrafterConfig.for_target(TARGET, mask_token_id=1, target_layer_ids=(1, 6))
    with pytest.raises(ConfigError, match="block_size"):
        DrafterConfig.for_target(TARGET, mask_token_id=1, block_size=1)
    cfg = DrafterConfig.for_target(TARGET, mask_token_id=1)
    other = TargetConfig(**{**TARGET.__dict__, "hidden_size": 64})
    with pytest.raises(ConfigError, match="hidden_size"):
        cfg.validate_against(other)
    small_vocab = TargetConfig(**{**TARGET.__dict__, "vocab_size": 50})
    with pytest.raises(ConfigError, match="vocab"):
        cfg.validate_against(small_vocab)
    shallow = TargetConfig(**{**TARGET.__dict__, "num_hidden_layers": 3})
    with pytest.raises(ConfigError, match="layer"):
        cfg.validate_against(shallow)


# ---- sliding-window layers (issue 27) ---------------------------------------------------------
WINDOW = 5  # shorter than the contexts below, at least the block (4)


@pytest.fixture(scope="module")
def windowed():
    """A drafter whose first layer is sliding (window 5) and second full, reading 8 target
    layers; its target."""
    target_cfg = target_preset("test", vocab_size=96, num_hidden_layers=10)
    cfg = DrafterConfig.for_target(
        target_cfg,
        mask_token_id=95,
        num_layers=2,
        block_size=4,
        num_features=8,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=WINDOW,
    )
    return TargetLM(target_cfg, rngs=nnx.Rngs(0)), Drafter(cfg, rngs=nnx.Rngs(2))


def test_window_masks_see_only_keys_inside_the_window():
    # block anchored at 6, window 5: position k (at 6 + k) sees context keys > 1 + k, < 6
    m = np.asarray(masks.decode_mask(jnp.array([6]), 8, block_size=2, window=5)).astype(int)
    assert m[0].tolist() == [[0, 0, 1, 1, 1, 1, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]]
    # the gathered view: the W − 1 = 4 slots 2..5, same visibility
    slots = masks.window_slots(jnp.array([6, 1]), 5)
    assert slots.tolist() == [[2, 3, 4, 5], [-3, -2, -1, 0]]
    w = np.asarray(masks.windowed_mask(slots, jnp.array([6, 1]), 2, 5)).astype(int)
    assert w[0].tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    assert w[1].tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]]  # only position 0 exists
    t = np.asarray(masks.train_mask(jnp.array([[6]]), jnp.array([[True]]), 8, 2, window=5))
    np.testing.assert_array_equal(t[0, :, :8], m[0, :, :8].astype(bool))


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_windowed_training_blocks_equal_windowed_serving(windowed, attention):
    """Contexts up to 13 tokens, window 5: every training block (sparse path in chunks of 3
    context keys, or the dense mask) equals the serving draft, which reads only the 4 cache
    entries its sliding layer can see."""
    cfg = windowed[1].config
    assert cfg.num_features == 8 and cfg.layer_window(0) == WINDOW and cfg.layer_window(1) is None

    @nnx.jit  # one program for both paths (eager dispatch compiles every op on its own)
    def both(target, drafter, tokens, anchors):
        feats = target(tokens, feature_layers=cfg.target_layer_ids).features_BxTxnD
        hidden = drafter.train_hidden(
            feats,
            tokens,
            anchors,
            jnp.ones((2, 3), bool),
            target.embedding_VxD(),
            attention=attention,
            attention_chunk=3,
        )
        emb, head = target.embedding_VxD(), target.lm_head_DxV()
        served = []
        for j in range(anchors.shape[1]):
            a_B = anchors[:, j]
            cache = drafter.append_context(drafter.init_context_cache(2, 20), feats, num_new_B=a_B)
            bonus = jnp.take_along_axis(tokens, a_B[:, None], axis=1)[:, 0]
            served.append(drafter.draft(cache, bonus, emb, head).hidden_BxKxD)
        return hidden, served

    tokens = jax.random.randint(jax.random.key(7), (2, 16), 0, 90)
    hidden, served = both(*windowed, tokens, jnp.array([[13, 2, 8], [6, 11, 0]]))
    for j, out_hidden in enumerate(served):
        np.testing.assert_allclose(out_hidden, hidden[:, j], atol=1e-5)


def test_window_changes_the_draft_only_past_the_window(windowed):
    """The same weights as full attention: identical while the context fits in the window,
    different once it does not; with every layer sliding, entries older than the window
    change nothing."""
    target, drafter = windowed

    def variant(layer_types):  # same seed, same weights
        return Drafter(
            dataclasses.replace(drafter.config, layer_types=layer_types), rngs=nnx.Rngs(2)
        )

    full, sliding = variant(None), variant(("sliding_attention",) * 2)
    emb, head = target.embedding_VxD(), target.lm_head_DxV()
    feats = jax.random.normal(jax.random.key(8), (1, 12, 8 * 32))

    @nnx.jit  # eager dispatch would compile every op on its own
    def _draft(d, f, emb, head):
        cache = d.append_context(d.init_context_cache(1, 16), f)
        return d.draft(cache, jnp.array([3]), emb, head).logits_BxKm1xV

    def draft(d, f):
        return np.asarray(_draft(d, f, emb, head))

    np.testing.assert_allclose(draft(drafter, feats[:, :1]), draft(full, feats[:, :1]), atol=1e-5)
    assert np.abs(draft(drafter, feats) - draft(full, feats)).max() > 1e-3
    older = feats.at[:, :8].set(jax.random.normal(jax.random.key(9), (1, 8, 8 * 32)))
    np.testing.assert_allclose(draft(sliding, older), draft(sliding, feats), atol=1e-5)
    assert np.abs(draft(drafter, older) - draft(drafter, feats)).max() > 1e-3  # its full layer
