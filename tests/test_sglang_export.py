"""Our export inside SGLang's own DFlash drafter (its PyPI wheel, `tests/sglang_stack.py`;
issue 42): SGLang's DFLASH server-argument resolution and draft `ModelConfig` read our
config.json, its loader (`get_model` → `DFlashDraftModel.load_weights`) takes the
`--for sglang` (AdaFlash) layout with every DFlash tensor consumed into a parameter of the
same shape, dtype and value and the length head's tensors skipped (upstream SGLang has no
length head), and its drafter's logits for one block equal ours, fed the same target
features."""

from __future__ import annotations

import json

import numpy as np
import pytest
import sglang_stack as ss
from safetensors.torch import load_file
from stack_exports import LAYERS, WINDOW, K, V, fused, our_block_logits, write_exports

from adaflash_jax.drafter.checkpoint import load_drafter

pytestmark = pytest.mark.skipif(
    not ss.available(), reason=f"SGLang wheel not installed: {ss.INSTALL}"
)

HEAD = "thresh_head_two_model."


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Our exports, and SGLang's drafter loaded from the AdaFlash one (bf16, as served)."""
    root = tmp_path_factory.mktemp("sglang")
    target = write_exports(root)
    with ss.session():
        yield root, target, ss.SglangSession(root / "target", root / "sglang")


def test_their_server_args_and_config_read_ours(stack):
    from sglang.srt.layers.radix_attention import AttentionType

    root, _, served = stack
    ours = json.loads((root / "sglang" / "config.json").read_text())
    draft = served.draft
    assert type(draft).__name__ == "DFlashDraftModel"
    # no --speculative-num-draft-tokens given: SGLang takes our block_size
    assert served.spec("speculative_num_draft_tokens") == K
    assert (served.spec("speculative_num_steps"), served.spec("speculative_eagle_topk")) == (1, 1)
    assert draft.block_size == K
    assert draft.draft_config.mask_token_id == ours["mask_token_id"] == V - 1
    assert draft.num_context_features == len(LAYERS)
    assert list(draft.draft_config.target_layer_ids) == list(LAYERS)
    for layer in draft.layers:
        attn = layer.self_attn
        assert attn.attn_type == AttentionType.ENCODER_ONLY  # non-causal, our is_causal: false
        assert attn.sliding_window_size == -1
        rope = attn.rotary_emb
        assert (rope.base, rope.is_neox_style, rope.head_size) == (1e6, True, attn.head_dim)


def test_their_layers_take_our_sliding_window(stack):
    """A sliding-window layer in our export is one in theirs: SGLang stores the window's
    left extent (our window − 1: HF's window counts the current token) and keeps the layer
    non-causal because our config says `is_causal: false` (its default for a sliding layer
    is causal)."""
    from sglang.srt.layers.radix_attention import AttentionType

    root, _, _ = stack
    served = ss.SglangSession(root / "target", root / "sglang_sliding")
    attns = [layer.self_attn for layer in served.draft.layers]
    assert [a.sliding_window_size for a in attns] == [WINDOW - 1, -1]
    assert [a.attn_type for a in attns] == [AttentionType.ENCODER_ONLY] * 2


def test_their_loader_consumes_every_dflash_tensor_and_skips_the_head(stack):
    root, _, served = stack
    tensors = load_file(root / "sglang" / "model.safetensors")
    assert sorted(served.loaded) == sorted(tensors)  # every tensor handed to their loader
    head = {name for name in tensors if name.startswith(HEAD)}
    assert len(head) == 6  # the length head is in the AdaFlash layout...
    expected = fused({n: t for n, t in tensors.items() if n not in head})
    params = dict(served.draft.named_parameters())
    assert set(params) == set(expected)  # ...and has no parameter upstream: none missing
    for name, want in expected.items():
        got = params[name]
        assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype), name
        assert bool((got == want).all()), name


def test_their_drafter_logits_equal_ours(stack):
    """One block after the prompt, float32 on both sides from the same bf16 export."""
    root, target, _ = stack
    served = ss.SglangSession(root / "target", root / "sglang", dtype="float32")
    feats, bonus, want = our_block_logits(load_drafter(root / "sglang"), target)
    emb, head = np.asarray(target.embedding_VxD()), np.asarray(target.lm_head_DxV())
    got = served.draft_logits(feats, bonus, emb, head)
    assert got.shape == want.shape == (K - 1, V)
    assert np.std(want) > 0.1 and len(set(np.argmax(want, -1))) > 1  # not a constant drafter
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
