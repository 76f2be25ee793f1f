"""Our export inside tpu-inference's own DFlash model, weight loader and proposer (its PyPI
wheel 0.32.0, `tests/tpu_inference_stack.py`): the plain layout `--for tpu-inference` loads
and drafts the same tokens as our drafter over two draft steps, fed the same target
features; the AdaFlash layout is refused by that loader, as the issue found. The RoPE θ
cases the wheel gets wrong are measured by `benchmarks/tpu_inference_agreement.py`."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_inference_stack as tpu
from flax import nnx

from adaflash_jax.drafter.checkpoint import load_drafter, save_drafter
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.checkpoint import save_target
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from experiments import export as export_cli

pytestmark = pytest.mark.skipif(
    not tpu.available(), reason=f"tpu-inference wheel not installed: {tpu.INSTALL}"
)

K, LAYERS, V = 4, (0, 2), 256  # layer 2 is not the target's last (3)
PROMPT = [5, 9, 17, 3, 44, 81, 2, 7, 100, 33, 12, 8]
ACCEPTED = 2  # drafts taken as accepted in step 1, so step 2 follows a partial rejection


def spread(module, key):
    """O(1) activations: weights N(0, 0.15²), norms 1 + N(0, 0.3²), as the torch reference test."""
    for path, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Param):
            name = "/".join(map(str, path))  # keyed by name: other attributes do not shift it
            noise = jax.random.normal(
                jax.random.fold_in(key, zlib.crc32(name.encode())), var.get_value().shape
            )
            norm = "norm" in name
            var.set_value(1.0 + 0.3 * noise if norm else 0.15 * noise)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A Qwen3-shaped target (head dim 128, as the wheel's kernels need), our drafter for it in
    the AdaFlash layout and converted `--for tpu-inference`."""
    root = tmp_path_factory.mktemp("tpu_inference")
    cfg = target_preset(
        "test",
        vocab_size=V,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        rope_theta=1e6,
    )
    target = TargetLM(cfg, rngs=nnx.Rngs(0))
    spread(target, jax.random.key(10))
    save_target(target, root / "target")
    dcfg = DrafterConfig.for_target(
        cfg, mask_token_id=V - 1, num_layers=2, block_size=K, target_layer_ids=LAYERS
    )
    drafter = Drafter(dcfg, rngs=nnx.Rngs(1))
    spread(drafter, jax.random.key(18))  # no top-2 near-tie (see the margin check)
    save_drafter(drafter, root / "adaflash")
    out = str(root / "plain")
    assert export_cli.main([str(root / "adaflash"), "--for", "tpu-inference", "--out", out]) == 0
    with tpu.stub_imports():  # one import of the wheel for the module's tests
        yield root, target


def test_their_loader_refuses_the_adaflash_layout(exports):
    root, target = exports
    error = tpu.load_error(
        root / "adaflash", root / "target", target.embedding_VxD(), target.lm_head_DxV()
    )
    assert error is not None and "thresh_head_two_model." in error
    assert "is not a valid param path" in error


def test_their_drafter_proposes_our_drafts_over_two_steps(exports):
    root, target = exports
    ours = load_drafter(root / "plain")  # the bf16 weights they load, float32 compute
    emb, head = target.embedding_VxD(), target.lm_head_DxV()
    prompt = jnp.array(PROMPT, jnp.int32)
    forward = nnx.jit(lambda model, tokens: model(tokens, feature_layers=LAYERS))
    draft = nnx.jit(lambda d, cache, bonus: d.draft(cache, bonus, emb, head))
    out = forward(target, prompt[None])
    feats = out.features_BxTxnD[0].astype(jnp.bfloat16)  # what they are fed
    bonus = int(jnp.argmax(out.logits_BxTxV[0, -1]))

    def our_drafts(cache, bonus):
        """Greedy drafts; their top-2 logit gaps clear bf16 rounding (they compute in bf16),
        so a different token would be a different model, not a near-tie."""
        logits_Km1xV = np.asarray(draft(ours, cache, jnp.array([bonus])).logits_BxKm1xV[0])
        top2 = np.sort(logits_Km1xV, -1)[:, -2:]
        assert np.min(top2[:, 1] - top2[:, 0]) > 0.2
        return np.argmax(logits_Km1xV, -1).tolist()

    cache = ours.append_context(ours.init_context_cache(1, 32), feats[None].astype(jnp.float32))
    ours_1 = our_drafts(cache, bonus)
    # step 2: the target verified [bonus, drafts]; ACCEPTED drafts kept, then a new bonus
    block = jnp.array([bonus, *ours_1], jnp.int32)
    out = forward(target, jnp.concatenate([prompt, block])[None])
    block_feats = out.features_BxTxnD[0, len(PROMPT) :].astype(jnp.bfloat16)
    bonus_2 = int(jnp.argmax(out.logits_BxTxV[0, len(PROMPT) + ACCEPTED]))
    kept = block_feats[None, : ACCEPTED + 1].astype(jnp.float32)
    ours_2 = our_drafts(ours.append_context(cache, kept), bonus_2)

    theirs = tpu.TpuInferenceDrafter(root / "plain", root / "target", emb, head)
    assert theirs.rope[0][0] == 1e6  # the θ they use (the drafter's, by luck: see docs)
    theirs_1 = theirs.propose(prompt, feats, len(PROMPT), 0, bonus)
    rejected = K - 1 - ACCEPTED
    theirs_2 = theirs.propose(block, block_feats, len(PROMPT) + K, rejected, bonus_2)
    assert len(set(ours_1 + ours_2)) > 2  # not a constant drafter
    assert (theirs_1, theirs_2) == (ours_1, ours_2)
