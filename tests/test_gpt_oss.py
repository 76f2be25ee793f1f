"""gpt-oss targets (docs/design.md §2.3) == transformers' GptOssForCausalLM.

One tiny random checkpoint, EVERY parameter randomised (sinks, q/k/v/o biases, router and
expert biases, norms), odd shapes: 5 experts (top 2), three query heads per kv head, sliding
(window 4) and full layers alternating, YaRN RoPE, a SwiGLU limit that clamps. Its experts
hold MXFP4 values (random blocks and scales dequantized by transformers' own function), so the
same model is saved twice: float, as transformers writes it, and MXFP4 (`*_blocks` +
`*_scales`, as the published checkpoints store the experts).
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from adaflash_jax.decode.generate import generate  # noqa: E402
from adaflash_jax.decode.slots import SpeculativeEngine  # noqa: E402
from adaflash_jax.decode.tree import TreeShape  # noqa: E402
from adaflash_jax.drafter.config import DrafterConfig  # noqa: E402
from adaflash_jax.drafter.model import Drafter  # noqa: E402
from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file  # noqa: E402
from adaflash_jax.model.checkpoint import load_target, save_target  # noqa: E402
from adaflash_jax.model.config import ConfigError, TargetConfig, YarnScaling  # noqa: E402
from adaflash_jax.model.mxfp4 import dequantize  # noqa: E402
from adaflash_jax.model.rope import attention_factor, inverse_frequencies  # noqa: E402
from adaflash_jax.sharding.rules import DECODE_RULES  # noqa: E402
from adaflash_jax.tokenizer import Tokenizer, TokenizerError, write_byte_tokenizer  # noqa: E402
from experiments import generate as generate_cli  # noqa: E402

V, D, F, E, WINDOW = 101, 96, 32, 5, 4  # MXFP4 groups 32 inputs: D and F are multiples
HF_CONFIG = dict(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=F,
    num_hidden_layers=4,  # sliding, full, sliding, full
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=E,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    swiglu_limit=1.0,
    max_position_embeddings=128,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 1000.0,
        "factor": 4.0,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,  # greedy generate never stops early
)


def _mxfp4(gen, e, out_features, in_features):
    """Random MXFP4 blocks [E, O, I/32, 16] (every nibble) and scales 2^-6..2^-3."""
    blocks = torch.randint(0, 256, (e, out_features, in_features // 32, 16), generator=gen)
    scales = torch.randint(121, 125, (e, out_features, in_features // 32), generator=gen)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """(HF model, its float directory, the same model with MXFP4 experts)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**HF_CONFIG))
    gen = torch.Generator().manual_seed(0)
    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith("sinks") else 0.3 if p.ndim == 1 else 0.15
            p.copy_(scale * torch.randn(p.shape, generator=gen))
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for part, (o, n) in (("gate_up_proj", (2 * F, D)), ("down_proj", (D, F))):
                blocks, scales = _mxfp4(gen, E, o, n)
                weight = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                getattr(experts, part).copy_(weight)
                packed[f"model.layers.{i}.mlp.experts.{part}"] = (blocks, scales)
    model.eval()
    root = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(root / "float")
    shutil.copytree(root / "float", root / "mxfp4")
    f = SafetensorsFile(str(root / "float" / "model.safetensors"))
    tensors = {n: np.asarray(f.get(n)) for n in f.keys() if n not in packed}
    for name, (blocks, scales) in packed.items():
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.numpy(), scales.numpy()
    save_file(tensors, str(root / "mxfp4" / "model.safetensors"))
    cfg_path = root / "mxfp4" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    cfg_path.write_text(json.dumps(cfg))
    yield model, str(root / "float"), str(root / "mxfp4")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, V, (2, 13)).astype(np.int32)


def test_config_from_hf(hf_dirs):
    cfg = TargetConfig.from_pretrained(hf_dirs[1])
    assert cfg.model_type == "gpt_oss" and cfg.num_experts == E and cfg.moe_intermediate_size == F
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert cfg.attention_bias and cfg.attention_sinks and not cfg.qk_norm
    assert cfg.swiglu_limit == 1.0 and cfg.rms_norm_eps == 1e-5 and not cfg.tie_word_embeddings
    assert isinstance(cfg.rope_scaling, YarnScaling) and not cfg.rope_scaling.truncate
    assert TargetConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert TargetConfig.from_pretrained(hf_dirs[2]) == cfg  # MXFP4: the same model


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quantization_config": {"quant_method": "gptq"}}, "'gptq' is not supported"),
        ({"sliding_window": None}, "no sliding_window"),
        ({"layer_types": ["linear_attention"] * 4}, "unknown layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "original_max_position"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "wild": 1}},
            "does not honour: \\['wild'\\]",
        ),
        ({"num_local_experts": None}, "needs num_local_experts"),
    ],
)
def test_what_gpt_oss_cannot_honour_is_refused(hf_dirs, change, message):
    with open(f"{hf_dirs[1]}/config.json") as f:
        cfg = {**json.load(f), **change}
    cfg = {k: v for k, v in cfg.items() if v is not None or k != "num_local_experts"}
    with pytest.raises(ConfigError, match=message):
        TargetConfig.from_hf_dict(cfg)


def test_generate_refuses_an_unsupported_quantization_in_one_line(hf_dirs, tmp_path, capsys):
    """Through the CLI: a gpt-oss checkpoint in another quantization ends generate with one
    line naming it (exit 2, no traceback)."""
    with open(f"{hf_dirs[1]}/config.json") as f:
        cfg = {**json.load(f), "quantization_config": {"quant_method": "bitsandbytes"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        generate_cli.main(["--target", str(tmp_path), "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "'bitsandbytes' is not supported" in err


def test_other_families_still_refuse_biases_and_quantization():
    base = dict(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8)
    base.update(num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ConfigError, match="attention_bias=true"):
        TargetConfig.from_hf_dict({**base, "attention_bias": True})
    with pytest.raises(ConfigError, match="quantization_config"):
        TargetConfig.from_hf_dict({**base, "quantization_config": {"quant_method": "mxfp4"}})


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("extra", [{}, {"mscale": 2.0, "mscale_all_dim": 1.0}])
def test_yarn_frequencies_equal_transformers(truncate, extra):
    """gpt-oss-20b's YaRN spec (theta 150000, factor 32 over 4096) and a tiny one: inverse
    frequencies and the attention factor == transformers' rope init."""
    for theta, factor, original, fast in ((150_000.0, 32.0, 4096, 32.0), (1000.0, 4.0, 32, 8.0)):
        rope = dict(rope_type="yarn", rope_theta=theta, factor=factor, beta_fast=fast)
        rope.update(beta_slow=1.0, truncate=truncate, original_max_position_embeddings=original)
        hf = transformers.GptOssConfig(
            num_hidden_layers=2,
            head_dim=64,
            rope_parameters={**rope, **extra},
            max_position_embeddings=int(factor * original),
        )
        want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        ours = TargetConfig.from_hf_dict(hf.to_dict())
        got = inverse_frequencies(64, ours.rope_theta, ours.rope_scaling)
        np.testing.assert_allclose(got, want.numpy(), rtol=3e-7, atol=0)
        assert attention_factor(ours.rope_scaling) == pytest.approx(want_factor, rel=1e-12)


def test_mxfp4_dequantization_equals_transformers():
    """Every byte value and a spread of scales, on [E, O, G, 16] blocks."""
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen).to(torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # both nibbles equal
    scales = torch.randint(100, 140, (3, 5, 4), generator=gen).to(torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()  # [E, I, O]
    got = dequantize(blocks.numpy(), scales.numpy())  # [E, O, I]
    np.testing.assert_array_equal(got.transpose(0, 2, 1), want)


def _hf_forward(model, tokens):
    with torch.no_grad():
        out = model(torch.from_numpy(tokens).long(), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


@pytest.mark.parametrize("stored", ["float", "mxfp4"])
def test_logits_and_features_match_transformers(hf_dirs, tokens, stored):
    """13 tokens, three windows' worth: the training path (no cache) == transformers."""
    hf_model, float_dir, mxfp4_dir = hf_dirs
    ours = load_target(float_dir if stored == "float" else mxfp4_dir)
    hf_logits, hf_hidden = _hf_forward(hf_model, tokens)
    out = ours(jnp.asarray(tokens), feature_layers=(0, 1, 3))
    assert np.abs(hf_logits).max() > 1.0
    np.testing.assert_allclose(np.asarray(out.logits_BxTxV), hf_logits, atol=1e-4, rtol=0)
    feats = np.asarray(out.features_BxTxnD).reshape(*tokens.shape, 3, D)
    for j, layer in enumerate((0, 1, 3)):  # HF hidden_states[i + 1]; L−1 after the final norm
        want = hf_hidden[layer + 1]
        np.testing.assert_allclose(feats[..., j, :], want, atol=1e-4 * np.abs(want).max())


def test_sharded_mxfp4_loading_gives_the_same_logits(hf_dirs, tokens):
    """Each device dequantizes only its slice: experts' F over the tensor axis (the gate and
    up halves of the interleaved columns, the down projection's MXFP4 input groups)."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = load_target(hf_dirs[2], mesh=mesh, rules=DECODE_RULES)
    mlp = model.layers[0].mlp
    assert {s.data.shape for s in mlp.up_proj[...].addressable_shards} == {(E, D, F // 4)}
    assert {s.data.shape for s in mlp.down_proj[...].addressable_shards} == {(E, F // 4, D)}
    want, _ = _hf_forward(hf_dirs[0], tokens)
    logits = jax.jit(lambda m, t: m(t).logits_BxTxV)(model, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4, rtol=0)


def test_the_clamp_the_window_and_the_sinks_bite(hf_dirs, tokens):
    """Guards that the parity above tests something: transformers' logits move without the
    clamp, the window or the sinks."""
    hf_model = hf_dirs[0]
    base, _ = _hf_forward(hf_model, tokens)
    for change in ({"swiglu_limit": 1e3}, {"sliding_window": 64}, {}):
        other = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**HF_CONFIG, **change}))
        other.load_state_dict(hf_model.state_dict())
        if not change:
            with torch.no_grad():
                for layer in other.model.layers:
                    layer.self_attn.sinks.fill_(-1e4)
        moved, _ = _hf_forward(other.eval(), tokens)
        assert np.abs(moved - base).max() > 1e-2, change


def test_save_writes_what_transformers_and_load_read(hf_dirs, tokens, tmp_path):
    """save_target of the MXFP4-loaded model: the float layout (gate and up interleaved
    again) that transformers loads to the same logits."""
    hf_model, _, mxfp4_dir = hf_dirs
    save_target(load_target(mxfp4_dir), tmp_path)
    reloaded = transformers.GptOssForCausalLM.from_pretrained(tmp_path).eval()
    want, _ = _hf_forward(hf_model, tokens)
    got, _ = _hf_forward(reloaded, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def hf_greedy(hf_dirs):
    """(two prompts, transformers' 32 greedy tokens for each): 37 and 43 positions, many
    windows."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, V, 5).tolist(), rng.integers(1, V, 11).tolist()]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            seq = hf_dirs[0].generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0
            )
        expected.append(seq[0, len(prompt) :].tolist())
    return prompts, expected


@pytest.fixture(scope="module")
def target(hf_dirs):
    return load_target(hf_dirs[2])


def test_greedy_generation_matches_transformers(target, hf_greedy):
    """Plain decoding (a ragged prefill into the cache, then one token a step) == transformers'
    generate, 32 tokens."""
    prompts, expected = hf_greedy
    assert generate(target, prompts, max_new_tokens=32, eos_ids=()) == expected


def _drafter(target):
    dcfg = DrafterConfig.for_target(
        target.config, mask_token_id=V - 1, num_layers=1, block_size=4, num_features=2
    )
    return Drafter(dcfg, rngs=nnx.Rngs(1))


@pytest.mark.parametrize(
    "engine",
    [dict(buckets=(2, 4)), dict(tree=TreeShape(topk=2, nodes=6))],
    ids=["chain", "tree"],
)
def test_speculative_greedy_is_lossless(target, hf_greedy, engine):
    """Speculative decoding (a DFlash drafter on two of the target's layers, block 4) through
    the verify paths that read the cache (chains in the row layout; trees packed, under
    ancestor masks and at their depths' positions): transformers' greedy tokens."""
    prompts, expected = hf_greedy
    spec = SpeculativeEngine(target, _drafter(target), slots=2, capacity=64, **engine)
    assert [r.output_ids for r in spec.generate([(p, 32) for p in prompts])] == expected


def test_the_verify_kernel_decodes_transformers_greedy(hf_dirs, hf_greedy):
    """The Pallas verify kernel (interpret mode), with sinks and the window, in the engine."""
    prompts, expected = hf_greedy
    target = load_target(hf_dirs[1], verify_attention="interpret")
    spec = SpeculativeEngine(target, _drafter(target), slots=2, capacity=64, buckets=(4,))
    assert [r.output_ids for r in spec.generate([(p, 32) for p in prompts])] == expected


# The harmony format's shape (OpenAI's harmony guide): a system message with the date and the
# reasoning effort, the user turns, the assistant's generation prompt; <|return|> ends a reply
HARMONY_SPECIALS = ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>", "<|call|>")
HARMONY_TEMPLATE = (
    "{% if reasoning_effort is not defined %}{% set reasoning_effort = 'medium' %}{% endif %}"
    "<|start|>system<|message|>Current date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort }}<|end|>"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_harmony_prompts_take_the_reasoning_effort_and_the_date(tmp_path):
    """The tokenizer renders a harmony template as transformers does: `strftime_now` for its
    date, `reasoning_effort` passed through to it, its markers one token each; a template
    that needs a helper we lack fails in one line."""
    write_byte_tokenizer(tmp_path, special_tokens=HARMONY_SPECIALS, eos_token="<|return|>",
                         chat_template=HARMONY_TEMPLATE)  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [260, 261]}))
    tok = Tokenizer(tmp_path)
    user = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(user, reasoning_effort="high")
    assert "Reasoning: high<|end|>" in text and text.endswith(
        "<|start|>user<|message|>hi<|end|><|start|>assistant"
    )
    assert "Reasoning: medium" in tok.apply_chat_template(user)
    assert "Current date: 20" in text
    ids = tok.encode_chat(user, reasoning_effort="low")
    start = tok.token_to_id("<|start|>")
    assert ids[0] == start and ids.count(start) == 3  # system, user, the assistant's prompt
    assert tok.eos_token_ids == (260, 261) and tok.token_to_id("<|return|>") == 260
    tok.chat_template = "{{ today() }}"
    with pytest.raises(TokenizerError, match="failed to render.*today"):
        tok.apply_chat_template(user)
