"""Our export inside vLLM's own DFlash drafter (its PyPI wheel, `tests/vllm_stack.py`; issue 42):
vLLM's config path reads our config.json, its loader (`get_model` → `DFlashQwen3ForCausalLM
.load_weights`, then the proposer's `load_dflash_model`) takes the `--for vllm` layout with
every tensor consumed into a parameter of the same shape, dtype and value, refuses the
AdaFlash layout, and its drafter's logits for one block equal ours, fed the same target
features."""

from __future__ import annotations

import json

import numpy as np
import pytest
import vllm_stack as vs
from safetensors.torch import load_file
from stack_exports import LAYERS, WINDOW, K, V, fused, our_block_logits, write_exports

from adaflash_jax.drafter.checkpoint import load_drafter

pytestmark = pytest.mark.skipif(
    not vs.available(), reason=f"vLLM wheel not installed: {vs.INSTALL}"
)

SHARED = {"model.embed_tokens.weight", "lm_head.weight"}  # the target's, not in the export


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Our exports, and vLLM's target + drafter loaded from them (bf16, as served)."""
    root = tmp_path_factory.mktemp("vllm")
    target = write_exports(root)
    with vs.session():
        yield root, target, vs.VllmSession(root / "target", root / "vllm", block_size=K)


def test_their_config_path_reads_our_config(stack):
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    root, _, served = stack
    ours = json.loads((root / "vllm" / "config.json").read_text())
    hf, inner = served.hf_config, served.draft.model
    assert hf.architectures == ["DFlashDraftModel"]  # → their DFlashQwen3ForCausalLM
    assert type(served.draft).__name__ == "DFlashQwen3ForCausalLM"
    assert inner.mask_token_id == ours["mask_token_id"] == V - 1
    assert served.spec_config.num_speculative_tokens == K - 1
    assert served.draft.get_draft_attn_causal() == [False, False]  # our is_causal: false
    assert [layer.self_attn.sliding_window for layer in inner.layers] == [None, None]
    assert inner.fc.input_size == len(LAYERS) * hf.hidden_size
    rope = inner.layers[0].self_attn.rotary_emb
    assert (rope.base, rope.is_neox_style, rope.head_size) == (1e6, True, hf.head_dim)
    # the target layers they capture, in their convention (the stream entering layer i): our
    # `eagle_aux_hidden_state_layer_ids`, target_layer_ids + 1, which is also what they derive
    # from dflash_config.target_layer_ids when that key is absent
    aux = [i + 1 for i in LAYERS]
    assert list(get_eagle3_aux_layers_from_config(served.spec_config)) == aux
    assert hf.eagle_aux_hidden_state_layer_ids == aux


def test_their_layers_take_our_sliding_window(stack):
    """A sliding-window layer in our export is one in theirs, with our window (HF's
    convention, the current token included, as ours) and still non-causal."""
    root, _, _ = stack
    served = vs.VllmSession(root / "target", root / "vllm_sliding", block_size=K)
    windows = [layer.self_attn.sliding_window for layer in served.draft.model.layers]
    assert windows == [WINDOW, None]
    assert served.draft.get_draft_attn_causal() == [False, False]


def test_their_loader_consumes_every_tensor(stack):
    root, _, served = stack
    tensors = load_file(root / "vllm" / "model.safetensors")
    assert sorted(served.loaded) == sorted(tensors)  # every tensor handed to their loader
    expected = fused(tensors, prefix="model.")
    params = dict(served.draft.named_parameters())
    assert set(params) - set(expected) == SHARED | {"model.mask_embedding"}  # none missing
    assert set(expected) <= set(params)  # none unexpected
    for name, want in expected.items():
        got = params[name]
        assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype), name
        assert bool((got == want).all()), name
    # the embedding and LM head are the target's (vLLM's own sharing); the mask embedding is
    # unused: the mask token is embedded from the target's table, as ours
    assert served.draft.model.embed_tokens is served.target.model.embed_tokens
    assert served.draft.lm_head is served.target.lm_head
    assert not served.draft.model.has_separate_mask_embedding


def test_their_loader_refuses_the_adaflash_layout(stack):
    root, _, _ = stack
    with pytest.raises(ValueError, match="thresh_head_two_model"):
        vs.VllmSession(root / "target", root / "sglang", block_size=K)


def test_their_drafter_logits_equal_ours(stack):
    """One block after the prompt, float32 on both sides from the same bf16 export."""
    root, target, _ = stack
    served = vs.VllmSession(root / "target", root / "vllm", block_size=K, dtype="float32")
    feats, bonus, want = our_block_logits(load_drafter(root / "vllm"), target)
    got = served.draft_logits(feats, bonus)
    assert got.shape == want.shape == (K - 1, V)
    assert np.std(want) > 0.1 and len(set(np.argmax(want, -1))) > 1  # not a constant drafter
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
