"""Our target == transformers' model on the same checkpoint (fp32, tiny random models)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from adaflash_jax.decode.generate import generate  # noqa: E402
from adaflash_jax.model.checkpoint import load_target  # noqa: E402
from adaflash_jax.model.config import TargetConfig  # noqa: E402
from adaflash_jax.sharding.rules import DECODE_RULES, TRAIN_RULES  # noqa: E402

V = 256
# Three layers: layers 0 and 1 are plain layer outputs; HF's LAST hidden_states entry is after
# the final norm, and so is our feature of layer 2 (docs/design.md §2).
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,  # greedy generate never stops early
    pad_token_id=0,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so all three frequency bands occur
}
VARIANTS = ("qwen3_untied", "qwen3_tied", "llama3")


def _hf_model(variant: str):
    if variant.startswith("qwen3"):
        cfg = transformers.Qwen3Config(
            **COMMON,
            tie_word_embeddings=variant == "qwen3_tied",
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(
            **COMMON, tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE)
        )
        model = transformers.LlamaForCausalLM(cfg)
    # Larger weights than HF's 0.02 init: peaked attention and O(1) logits, so a wrong RoPE
    # or a misplaced norm weight shows up far above the tolerance. Norms get non-unit weights.
    gen = torch.Generator().manual_seed(len(variant))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """variant → (HF model, saved directory)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead on a 2-core box
    torch.manual_seed(0)
    out = {}
    for variant in VARIANTS:
        model = _hf_model(variant)
        path = tmp_path_factory.mktemp(variant)
        model.save_pretrained(path)
        out[variant] = (model, str(path))
    yield out
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, V, (2, 12)).astype(np.int32)


def _hf_forward(model, tokens):
    with torch.no_grad():
        out = model(torch.from_numpy(tokens).long(), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_hidden_states_match_transformers(hf_dirs, tokens, variant):
    hf_model, path = hf_dirs[variant]
    ours = load_target(path, dtype=jnp.float32)
    assert ours.config.tie_word_embeddings == (variant == "qwen3_tied")
    assert (ours.lm_head is None) == (variant == "qwen3_tied")
    hf_logits, hf_hidden = _hf_forward(hf_model, tokens)
    out = ours(jnp.asarray(tokens), feature_layers=(1, 0))
    assert np.abs(hf_logits).max() > 1.0  # the comparison is not between near-zero values
    np.testing.assert_allclose(np.asarray(out.logits_BxTxV), hf_logits, atol=1e-4, rtol=0)
    d = hf_model.config.hidden_size
    feats = np.asarray(out.features_BxTxnD)
    np.testing.assert_allclose(feats[..., :d], hf_hidden[2], atol=1e-4, rtol=0)  # layer 1
    np.testing.assert_allclose(feats[..., d:], hf_hidden[1], atol=1e-4, rtol=0)  # layer 0
    np.testing.assert_allclose(np.asarray(out.hidden_BxTxD), hf_hidden[3], atol=1e-4, rtol=0)


def test_last_layer_feature_is_hf_last_hidden_state_in_forward_and_verify(hf_dirs, tokens):
    """Layer L−1's feature == HF hidden_states[L] (post final norm), from the plain forward,
    a cached prefill, and the "read" cache mode (the engine's verify) after that prefill."""
    hf_model, path = hf_dirs["qwen3_untied"]
    ours = load_target(path, dtype=jnp.float32)
    _, hf_hidden = _hf_forward(hf_model, tokens)
    want = np.concatenate([hf_hidden[3], hf_hidden[1]], axis=-1)  # layers (2, 0)
    assert np.abs(hf_hidden[3] - hf_hidden[2]).max() > 0.5  # post-norm differs from pre-norm
    layers = (2, 0)
    p = 7  # prefill p tokens into the cache, then verify the rest without writing it

    @nnx.jit  # the three forwards as one program (eager dispatch compiles every op alone)
    def three_ways(model, tokens):
        plain = model(tokens, feature_layers=layers)
        prefill = model(tokens[:, :p], cache=model.init_cache(2, 16), feature_layers=layers)
        verify = model(tokens[:, p:], cache=prefill.cache, cache_mode="read", feature_layers=layers)
        return plain.features_BxTxnD, prefill.features_BxTxnD, verify

    plain, prefill_feats, verify = three_ways(ours, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(plain), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(prefill_feats), want[:, :p], atol=1e-4)
    logits, feats = verify.logits_BxTxV, verify.features_BxTxnD
    np.testing.assert_allclose(np.asarray(feats), want[:, p:], atol=1e-4, rtol=0)
    hf_logits, _ = _hf_forward(hf_model, tokens)
    np.testing.assert_allclose(np.asarray(logits), hf_logits[:, p:], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def hf_greedy(hf_dirs):
    """variant → (two prompts, transformers' 32 greedy tokens for each)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, V, 5).tolist(), rng.integers(1, V, 9).tolist()]
    out = {}
    for variant, (hf_model, _) in hf_dirs.items():
        expected = []
        for prompt in prompts:
            with torch.no_grad():
                seq = hf_model.generate(
                    torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0
                )
            expected.append(seq[0, len(prompt) :].tolist())
        assert all(len(e) == 32 for e in expected)
        out[variant] = (prompts, expected)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_matches_transformers(hf_dirs, hf_greedy, variant):
    prompts, expected = hf_greedy[variant]
    # Both prompts in ONE ragged batch.
    got = generate(load_target(hf_dirs[variant][1]), prompts, max_new_tokens=32, eos_ids=())
    assert got == expected


def test_old_and_new_rope_config_forms_agree(hf_dirs, tokens, tmp_path):
    """llama3 scaling written as top-level rope_theta + rope_scaling (older transformers)."""
    _, path = hf_dirs["llama3"]
    old = tmp_path / "old_form"
    shutil.copytree(path, old)
    with open(old / "config.json") as f:
        cfg = json.load(f)
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    with open(old / "config.json", "w") as f:
        json.dump(cfg, f)
    new_cfg, old_cfg = TargetConfig.from_pretrained(path), TargetConfig.from_pretrained(old)
    assert new_cfg == old_cfg
    assert new_cfg.rope_theta == 500_000.0 and new_cfg.rope_scaling.factor == 8.0
    a = load_target(path)(jnp.asarray(tokens)).logits_BxTxV
    b = load_target(old)(jnp.asarray(tokens)).logits_BxTxV
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


@pytest.mark.parametrize(
    "shape,names,rules",
    [
        ((2, 4), ("data", "tensor"), DECODE_RULES),
        ((1, 2, 4), ("data", "fsdp", "tensor"), TRAIN_RULES),
    ],
)
def test_sharded_loading_gives_same_logits(hf_dirs, tokens, shape, names, rules):
    hf_model, path = hf_dirs["qwen3_untied"]
    model = load_target(path, mesh=_mesh(shape, names), rules=rules)
    kernel = model.layers[0].self_attn.q_proj.kernel[...]  # [D, H*Dh] = [64, 64]
    assert "tensor" in jax.tree.leaves(tuple(kernel.sharding.spec))
    shard_shapes = {s.data.shape for s in kernel.addressable_shards}
    assert shard_shapes == ({(64, 16)} if rules is DECODE_RULES else {(32, 16)})
    embed = model.embed_tokens[...]  # vocab over tensor
    assert embed.addressable_shards[0].data.shape[0] == V // 4
    hf_logits, _ = _hf_forward(hf_model, tokens)
    logits = jax.jit(lambda m, t: m(t).logits_BxTxV)(model, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits), hf_logits, atol=1e-4, rtol=0)


def test_sharded_generate_matches_transformers(hf_dirs, hf_greedy):
    prompts, expected = hf_greedy["qwen3_untied"]
    mesh = _mesh((2, 4), ("data", "tensor"))
    model = load_target(hf_dirs["qwen3_untied"][1], mesh=mesh, rules=DECODE_RULES)
    assert generate(model, prompts, max_new_tokens=32, eos_ids=()) == expected


def test_sharded_checkpoint_with_index_loads(hf_dirs, tokens, tmp_path):
    hf_model, _ = hf_dirs["qwen3_untied"]
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert len([f for f in files if f.endswith(".safetensors")]) >= 2
    hf_logits, _ = _hf_forward(hf_model, tokens)
    logits = load_target(tmp_path)(jnp.asarray(tokens)).logits_BxTxV
    np.testing.assert_allclose(np.asarray(logits), hf_logits, atol=1e-4, rtol=0)
