"""Hybrid Gated-DeltaNet targets (Qwen3.5 / Qwen3.6, docs/design.md §2.1) == transformers.

Tiny random checkpoints saved by transformers, EVERY parameter randomised (zero-centred norms,
A_log and dt_bias included: at init they would hide a misplaced (1 + w) or decay). Odd shapes:
three value heads per key head, conv kernel 3, an attention layer every third layer, partial
RoPE 0.25; tied (text), untied multimodal (with a vision tower and mtp.* tensors to skip) and a
MoE with a shared expert (fused experts, as transformers 5 writes them).
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from adaflash_jax.decode.generate import generate  # noqa: E402
from adaflash_jax.decode.slots import SpeculativeEngine  # noqa: E402
from adaflash_jax.drafter.config import DrafterConfig  # noqa: E402
from adaflash_jax.drafter.model import Drafter  # noqa: E402
from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file  # noqa: E402
from adaflash_jax.model.checkpoint import CheckpointError, load_target, save_target  # noqa: E402
from adaflash_jax.model.config import ConfigError, TargetConfig  # noqa: E402
from adaflash_jax.model.delta_rule import chunked_form, l2_normalize, recurrent_form  # noqa: E402
from adaflash_jax.sharding.rules import DECODE_RULES, TRAIN_RULES  # noqa: E402

V = 96
TEXT = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=3,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=6,  # three value heads per key head
    full_attention_interval=3,  # linear, linear, full, linear
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,  # greedy generate never stops early
    pad_token_id=0,
)
VARIANTS = ("dense_tied", "multimodal", "moe")
PARTS = ("gate_proj", "up_proj", "down_proj")


def _hf_model(variant: str):
    if variant == "moe":
        cfg = transformers.Qwen3_5MoeTextConfig(
            **TEXT,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
        )
        model = transformers.Qwen3_5MoeForCausalLM(cfg)
    elif variant == "multimodal":
        vision = dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32
        )
        text = transformers.Qwen3_5TextConfig(**TEXT, intermediate_size=48)
        cfg = transformers.Qwen3_5Config(
            text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False
        )
        model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    else:
        cfg = transformers.Qwen3_5TextConfig(**TEXT, intermediate_size=48, tie_word_embeddings=True)
        model = transformers.Qwen3_5ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(len(variant))
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if p.ndim == 1 or "conv1d" in name else 0.15
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """variant → (HF model, saved directory); the multimodal one also holds mtp.* tensors."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for variant in VARIANTS:
        model = _hf_model(variant)
        path = tmp_path_factory.mktemp(variant)
        model.save_pretrained(path)
        if variant == "multimodal":
            f = SafetensorsFile(str(path / "model.safetensors"))
            tensors = {n: np.asarray(f.get(n)) for n in f.keys()}
            tensors["mtp.fc.weight"] = np.zeros((32, 64), np.float32)
            save_file(tensors, str(path / "model.safetensors"))
        out[variant] = (model, str(path))
    yield out
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, V, (2, 13)).astype(np.int32)


def _hf_forward(model, tokens):
    with torch.no_grad():
        out = model(torch.from_numpy(tokens).long(), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_features_match_transformers(hf_dirs, tokens, variant, caplog):
    hf_model, path = hf_dirs[variant]
    with caplog.at_level(logging.INFO, logger="adaflash_jax.model.checkpoint"):
        ours = load_target(path, chunk=4)  # 13 tokens: three full chunks and a padded one
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    if variant == "multimodal":  # the vision tower and mtp.* are skipped, logged once
        assert len(skips) == 1 and "outside the text decoder" in skips[0]
    else:
        assert skips == []
    assert ours.config.is_hybrid and ours.config.layer_types[2] == "full_attention"
    assert (ours.lm_head is None) == (variant == "dense_tied")
    hf_logits, hf_hidden = _hf_forward(hf_model, tokens)
    out = ours(jnp.asarray(tokens), feature_layers=(1, 2, 3))
    assert np.abs(hf_logits).max() > 1.0
    np.testing.assert_allclose(np.asarray(out.logits_BxTxV), hf_logits, atol=1e-4, rtol=0)
    feats = np.asarray(out.features_BxTxnD).reshape(*tokens.shape, 3, 32)
    for j, layer in enumerate((1, 2, 3)):  # HF hidden_states[i + 1]; L−1 after the final norm
        want = hf_hidden[layer + 1]
        np.testing.assert_allclose(feats[..., j, :], want, atol=1e-4 * np.abs(want).max())


@pytest.fixture(scope="module")
def hf_greedy(hf_dirs):
    """variant → (two prompts, transformers' 32 greedy tokens for each)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, V, 5).tolist(), rng.integers(1, V, 11).tolist()]
    out = {}
    for variant, (hf_model, _) in hf_dirs.items():
        expected = []
        for prompt in prompts:
            with torch.no_grad():
                seq = hf_model.generate(
                    torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0
                )
            expected.append(seq[0, len(prompt) :].tolist())
        out[variant] = (prompts, expected)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_matches_transformers(hf_dirs, hf_greedy, variant):
    """Plain decoding with the recurrent state: a ragged batch (prefill, then one token a
    step through the recurrent form) == transformers' generate, 32 tokens."""
    prompts, expected = hf_greedy[variant]
    target = load_target(hf_dirs[variant][1])
    assert generate(target, prompts, max_new_tokens=32, eos_ids=()) == expected


def test_engine_slots_reset_a_rows_state_for_its_next_request(hf_dirs, hf_greedy):
    """Two slots, four requests: a slot's recurrent state (conv history + delta state) is the
    new request's alone, so every result equals transformers' generate."""
    prompts, expected = hf_greedy["dense_tied"]
    engine = SpeculativeEngine(load_target(hf_dirs["dense_tied"][1]), None, slots=2, capacity=64)
    requests = [(prompts[i % 2], 32 - 4 * i) for i in range(4)]
    results = engine.generate(requests)
    for i, r in enumerate(results):
        assert r.output_ids == expected[i % 2][: 32 - 4 * i]


@pytest.mark.parametrize("variant", ["multimodal", "moe"])
def test_speculative_greedy_equals_transformers(hf_dirs, hf_greedy, variant):
    """Speculative decoding (a DFlash drafter on two of the target's layers, block 4, widths
    1, 2 and 4, two ragged rows) on the multimodal and MoE checkpoints: transformers' tokens."""
    prompts, expected = hf_greedy[variant]
    target = load_target(hf_dirs[variant][1])
    dcfg = DrafterConfig.for_target(
        target.config, mask_token_id=V - 1, num_layers=1, block_size=4, num_features=2
    )
    drafter = Drafter(dcfg, rngs=nnx.Rngs(1))
    engine = SpeculativeEngine(target, drafter, slots=2, capacity=64, buckets=(1, 2, 4))
    results = engine.generate([(p, 32) for p in prompts])
    assert [r.output_ids for r in results] == expected


def test_chunked_form_equals_recurrent_form():
    """The two forms of the gated delta rule agree from a non-zero state, for chunk lengths
    that divide T, that do not (padded last chunk) and that exceed it."""
    rng = np.random.default_rng(0)
    b, t, j, dk, dv = 2, 19, 3, 8, 5
    q = l2_normalize(rng.normal(size=(b, t, j, dk)))
    k = l2_normalize(rng.normal(size=(b, t, j, dk)))
    v = jnp.asarray(rng.normal(size=(b, t, j, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 2.0, (b, t, j)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, j)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(b, j, dk, dv)), jnp.float32)
    want_out, want_state = recurrent_form(q, k, v, g, beta, state)
    assert float(jnp.abs(want_state - state).max()) > 0.1
    for chunk in (1, 4, 7, 19, 64):
        out, final = chunked_form(q, k, v, g, beta, state, chunk)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-5)
        np.testing.assert_allclose(np.asarray(final), np.asarray(want_state), atol=2e-5)


def test_fused_expert_checkpoint_and_save_round_trip(hf_dirs, tokens, tmp_path):
    """Experts fused per layer (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj`
    [E, D, F]) load as the one-tensor-per-expert layout transformers wrote does, also read
    slice by slice onto 8 devices; `save_target` writes a checkpoint transformers reads back
    to the same logits."""
    hf_model, path = hf_dirs["moe"]
    f = SafetensorsFile(path + "/model.safetensors")
    tensors = {n: np.asarray(f.get(n)) for n in f.keys()}
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in tensors  # per expert as written
    for layer in range(4):
        head = f"model.layers.{layer}.mlp.experts"
        part = {p: [tensors.pop(f"{head}.{e}.{p}.weight") for e in range(4)] for p in PARTS}
        gate_up = [np.concatenate([g, u]) for g, u in zip(part["gate_proj"], part["up_proj"])]
        tensors[f"{head}.gate_up_proj"] = np.stack(gate_up)
        tensors[f"{head}.down_proj"] = np.stack(part["down_proj"])
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(tensors, str(fused / "model.safetensors"))
    (fused / "config.json").write_text(open(path + "/config.json").read())
    a = load_target(path)(jnp.asarray(tokens)).logits_BxTxV
    b = load_target(fused)(jnp.asarray(tokens)).logits_BxTxV
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sharded = load_target(fused, mesh=_mesh((1, 8), ("data", "tensor")), rules=DECODE_RULES)
    np.testing.assert_array_equal(
        np.asarray(sharded.layers[1].mlp.up_proj[...]),
        np.asarray(load_target(path).layers[1].mlp.up_proj[...]),
    )
    for variant in ("moe", "multimodal"):  # multimodal saves as its text CausalLM
        hf_model, path = hf_dirs[variant]
        out = tmp_path / f"saved_{variant}"
        save_target(load_target(path), out)
        cls = (
            transformers.Qwen3_5MoeForCausalLM
            if variant == "moe"
            else transformers.Qwen3_5ForCausalLM
        )
        reloaded = cls.from_pretrained(out).eval()
        np.testing.assert_allclose(
            _hf_forward(reloaded, tokens)[0], _hf_forward(hf_model, tokens)[0], atol=1e-5
        )


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


@pytest.mark.parametrize(
    "shape,names,rules",
    [
        ((2, 4), ("data", "tensor"), DECODE_RULES),
        ((1, 2, 4), ("data", "fsdp", "tensor"), TRAIN_RULES),
    ],
)
def test_sharded_equals_single_device(hf_dirs, hf_greedy, tokens, shape, names, rules):
    """Weights (DeltaNet ones included) split over 8 devices give the same logits as one
    device; under the decode rules plain greedy decoding, its recurrent state split over the
    data axis, still gives transformers' tokens."""
    hf_model, path = hf_dirs["moe"]
    sharded = load_target(path, mesh=_mesh(shape, names), rules=rules)
    qkv = sharded.layers[0].linear_attn.in_proj_qkv.kernel[...]
    assert "tensor" in jax.tree.leaves(tuple(qkv.sharding.spec))  # the DeltaNet's channels
    logits = jax.jit(lambda m, t: m(t).logits_BxTxV)(sharded, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits), _hf_forward(hf_model, tokens)[0], atol=1e-4)
    if rules is DECODE_RULES:
        prompts, expected = hf_greedy["moe"]
        assert generate(sharded, prompts, max_new_tokens=32, eos_ids=()) == expected


def _write_config(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_bad_configs_and_checkpoints_are_named(hf_dirs, tmp_path):
    _, path = hf_dirs["dense_tied"]
    cfg = json.loads(open(path + "/config.json").read())
    with pytest.raises(ConfigError, match="unknown layer_types \\['sliding_attention'\\]"):
        TargetConfig.from_hf_dict(
            {**cfg, "layer_types": ["sliding_attention"] + cfg["layer_types"][1:]}
        )
    with pytest.raises(ConfigError, match="needs a text_config"):
        TargetConfig.from_hf_dict({"model_type": "qwen3_5", "vision_config": {}})
    with pytest.raises(ConfigError, match="qwen3_next.*in_proj_qkvz"):
        TargetConfig.from_hf_dict({**cfg, "model_type": "qwen3_next"})
    with pytest.raises(ConfigError, match="supported: .*qwen3_5_moe"):
        TargetConfig.from_hf_dict({**cfg, "model_type": "mamba2"})
    f = SafetensorsFile(path + "/model.safetensors")
    gone = "model.layers.1.linear_attn.A_log"
    tensors = {n: np.asarray(f.get(n)) for n in f.keys() if n != gone}
    broken = tmp_path / "missing"
    broken.mkdir()
    save_file(tensors, str(broken / "model.safetensors"))
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=gone.replace(".", "\\.")):
        load_target(broken)
