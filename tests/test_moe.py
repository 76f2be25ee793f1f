"""Qwen3-MoE target == transformers' Qwen3MoeForCausalLM (fp32, tiny random checkpoints),
sharded == single device, and the checkpoint/config errors name the problem."""

from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from adaflash_jax.decode.generate import generate  # noqa: E402
from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file  # noqa: E402
from adaflash_jax.model.checkpoint import CheckpointError, load_target, save_target  # noqa: E402
from adaflash_jax.model.config import ConfigError, TargetConfig  # noqa: E402
from adaflash_jax.model.moe import MoEBlock, group_sizes  # noqa: E402
from adaflash_jax.sharding.rows import RowLayout  # noqa: E402
from adaflash_jax.sharding.rules import DECODE_RULES, TRAIN_RULES  # noqa: E402

V = 256
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,  # greedy generate never stops early
    pad_token_id=0,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
)
# name → (HF overrides, which layers are sparse)
VARIANTS = {
    # 8 experts, top-2 renormalised, every layer sparse.
    "all_sparse": (
        dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        (True, True, True),
    ),
    # An odd expert count, raw (unnormalised) top-2 weights, layer 1 dense by mlp_only_layers.
    "mlp_only": (
        dict(
            num_hidden_layers=3,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
        (True, False, True),
    ),
    # decoder_sparse_step 2: layers 1 and 3 sparse; 3 experts, top-3 (every expert every token).
    "step2": (
        dict(
            num_hidden_layers=4,
            num_experts=3,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
        (False, True, False, True),
    ),
}


def _hf_model(variant: str):
    cfg = transformers.Qwen3MoeConfig(**COMMON, **VARIANTS[variant][0])
    model = transformers.Qwen3MoeForCausalLM(cfg)
    # Weights larger than HF's init: O(1) logits and a peaked router, so a wrong top-k, a
    # missed renormalisation or a swapped expert shows far above the tolerance.
    gen = torch.Generator().manual_seed(len(variant))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """variant → (HF model, saved directory)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
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


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_hidden_states_match_transformers(hf_dirs, tokens, variant):
    hf_model, path = hf_dirs[variant]
    ours = load_target(path)
    sparse = VARIANTS[variant][1]
    assert tuple(isinstance(layer.mlp, MoEBlock) for layer in ours.layers) == sparse
    assert tuple(ours.config.is_moe_layer(i) for i in range(len(sparse))) == sparse
    hf_logits, hf_hidden = _hf_forward(hf_model, tokens)
    layers = (1, 0, 2)
    out = jax.jit(lambda m, t: m(t, feature_layers=layers))(ours, jnp.asarray(tokens))
    assert np.abs(hf_logits).max() > 1.0
    np.testing.assert_allclose(np.asarray(out.logits_BxTxV), hf_logits, atol=1e-4, rtol=0)
    want = np.concatenate([hf_hidden[i + 1] for i in layers], axis=-1)
    np.testing.assert_allclose(np.asarray(out.features_BxTxnD), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(out.hidden_BxTxD), hf_hidden[-1], atol=1e-4, rtol=0)


def test_router_is_not_trivial(hf_dirs, tokens):
    """The tokens spread over the experts (the parity above is not one expert's output)."""
    ours = load_target(hf_dirs["mlp_only"][1])
    x = ours.embed(jnp.asarray(tokens)).reshape(-1, 64)
    weights, experts = ours.layers[0].mlp.route(ours.layers[0].post_attention_layernorm(x))
    assert len(np.unique(np.asarray(experts))) == 5
    assert np.abs(np.asarray(weights).sum(-1) - 1).max() > 0.05  # norm_topk_prob=False


def test_group_sizes_count_each_expert():
    """The grouped matmuls' row counts == a bincount, experts with no rows included."""
    experts_M = jnp.asarray(np.random.default_rng(0).choice([0, 2, 3, 6], size=37))
    got = group_sizes(experts_M, 8)
    np.testing.assert_array_equal(got, np.bincount(np.asarray(experts_M), minlength=8))


def test_cached_prefill_and_read_mode_match_transformers(hf_dirs, tokens):
    """Prefill 7 tokens into the cache, then the engine's verify ("read" mode) on the rest."""
    hf_model, path = hf_dirs["mlp_only"]
    ours = load_target(path)
    hf_logits, hf_hidden = _hf_forward(hf_model, tokens)
    p = 7
    run = jax.jit(
        lambda m, t, c, mode: m(t, cache=c, cache_mode=mode, feature_layers=(0,)),
        static_argnums=3,
    )
    prefill = run(ours, jnp.asarray(tokens[:, :p]), ours.init_cache(2, 16), "write")
    np.testing.assert_allclose(np.asarray(prefill.features_BxTxnD), hf_hidden[1][:, :p], atol=1e-4)
    verify = run(ours, jnp.asarray(tokens[:, p:]), prefill.cache, "read")
    np.testing.assert_allclose(np.asarray(verify.logits_BxTxV), hf_logits[:, p:], atol=1e-4)
    np.testing.assert_allclose(np.asarray(verify.features_BxTxnD), hf_hidden[1][:, p:], atol=1e-4)


@pytest.mark.parametrize("variant", ["all_sparse", "mlp_only"])
def test_greedy_generation_matches_transformers(hf_dirs, variant):
    hf_model, path = hf_dirs[variant]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, V, 5).tolist(), rng.integers(1, V, 9).tolist()]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            seq = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0
            )
        expected.append(seq[0, len(prompt) :].tolist())
    assert generate(load_target(path), prompts, max_new_tokens=32, eos_ids=()) == expected


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


@pytest.fixture(scope="module")
def single_forward(hf_dirs, tokens):
    """The all-sparse target's forward on one device (jitted: eager dispatch compiles every
    op on its own), shared by both sharded layouts below."""
    fwd = jax.jit(lambda m, t: m(t, feature_layers=(1,)))
    return fwd(load_target(hf_dirs["all_sparse"][1]), jnp.asarray(tokens))


@pytest.mark.parametrize(
    "shape,names,rules,expert_shard",
    [
        # decoding: every chip holds all 8 experts, a quarter of each expert's F
        ((2, 4), ("data", "tensor"), DECODE_RULES, (8, 64, 8)),
        # training: experts over fsdp, F over tensor
        ((1, 2, 4), ("data", "fsdp", "tensor"), TRAIN_RULES, (4, 64, 8)),
    ],
)
def test_sharded_forward_equals_single_device(
    hf_dirs, tokens, single_forward, shape, names, rules, expert_shard
):
    single = single_forward
    model = load_target(hf_dirs["all_sparse"][1], mesh=_mesh(shape, names), rules=rules)
    up = model.layers[0].mlp.up_proj[...]  # [E, D, F] = [8, 64, 32]
    assert {s.data.shape for s in up.addressable_shards} == {expert_shard}
    fwd = jax.jit(lambda m, t: m(t, feature_layers=(1,)))
    out = fwd(model, jnp.asarray(tokens))
    for name in ("logits_BxTxV", "features_BxTxnD"):
        got, want = np.asarray(getattr(out, name)), np.asarray(getattr(single, name))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_routing_per_row_shard_equals_global(hf_dirs, tokens):
    """With the batch's rows split over (data, fsdp), each chip routes and multiplies only
    its own rows (every sort in the program covers a quarter of the routed rows), and the
    output equals the single-device forward."""
    path = hf_dirs["all_sparse"][1]
    batch = jnp.asarray(np.concatenate([tokens] * 4))  # [4 · B, T]: 4 row shards
    fwd = jax.jit(lambda m, t, r: m(t, feature_layers=(1,), rows=r), static_argnums=2)
    single = fwd(load_target(path), batch, None)  # one device
    mesh = _mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    model = load_target(path, mesh=mesh, rules=TRAIN_RULES)
    rows = RowLayout.of(mesh, TRAIN_RULES, batch.shape[0])
    # each sharded program compiled once: run, and its HLO inspected below
    compiled = {r: fwd.lower(model, batch, r).compile() for r in (None, rows)}
    out = compiled[rows](model, batch)
    for name in ("logits_BxTxV", "features_BxTxnD"):
        got, want = np.asarray(getattr(out, name)), np.asarray(getattr(single, name))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)

    def sorted_rows(r):
        hlo = compiled[r].as_text()
        return {int(m.group(1)) for m in re.finditer(r"= \(?s32\[(\d+)\][^=]*sort\(", hlo)}

    routed = batch.size * 2  # top-2
    assert sorted_rows(None) == {routed}  # global routing: one sort over every row
    assert sorted_rows(rows) == {routed // 4}


def test_decode_step_gathers_no_expert_weights(hf_dirs):
    """Under DECODE_RULES the compiled decode step (rows split over data, each shard routed on
    its own chips) moves activations, never an expert's weights: every all-gather in the
    program is smaller than one expert's local F-slice."""
    mesh = _mesh((2, 4), ("data", "tensor"))
    model = load_target(hf_dirs["all_sparse"][1], mesh=mesh)
    cache, rows = model.init_cache(2, 16), RowLayout.of(mesh, DECODE_RULES, 2)
    step = jax.jit(lambda m, t, c: m(t, cache=c, rows=rows).logits_BxTxV)
    hlo = step.lower(model, jnp.zeros((2, 1), jnp.int32), cache).compile().as_text()
    gathered = [
        math.prod(int(d) for d in m.group(1).split(",") if d)
        for m in re.finditer(r"= f32\[([\d,]*)\][^ ]* all-gather\(", hlo)
    ]
    assert "all-reduce(" in hlo  # the program is partitioned at all
    assert max(gathered, default=0) < 64 * 32 // 4  # D · F / tensor: one expert's slice


def test_save_target_round_trips_through_transformers(hf_dirs, tokens, tmp_path):
    hf_model, path = hf_dirs["mlp_only"]
    save_target(load_target(path), tmp_path)
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    want, _ = _hf_forward(hf_model, tokens)
    got, _ = _hf_forward(reloaded, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert TargetConfig.from_pretrained(tmp_path) == TargetConfig.from_pretrained(path)


def test_missing_expert_tensor_is_named(hf_dirs, tmp_path):
    _, path = hf_dirs["mlp_only"]
    f = SafetensorsFile(os.path.join(path, "model.safetensors"))
    gone = "model.layers.2.mlp.experts.4.up_proj.weight"
    save_file(
        {k: np.asarray(f.get(k)) for k in f.keys() if k != gone},
        str(tmp_path / "model.safetensors"),
    )
    with open(os.path.join(path, "config.json")) as src:
        (tmp_path / "config.json").write_text(src.read())
    with pytest.raises(CheckpointError, match=r"missing tensors: \['" + gone.replace(".", r"\.")):
        load_target(tmp_path)


def test_config_errors_name_the_problem(hf_dirs):
    with open(os.path.join(hf_dirs["mlp_only"][1], "config.json")) as f:
        raw = json.load(f)
    with pytest.raises(ConfigError, match="supported: .*'qwen3_moe'"):
        TargetConfig.from_hf_dict({**raw, "model_type": "mixtral"})
    cfg = TargetConfig.from_hf_dict(raw)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_only_layers) == (5, 2, (1,))
    # the published checkpoints spell the expert count `num_experts`
    legacy = {k: v for k, v in raw.items() if k != "num_local_experts"} | {"num_experts": 5}
    assert TargetConfig.from_hf_dict(legacy) == cfg
    with pytest.raises(ConfigError, match="num_experts_per_tok must be in"):
        TargetConfig.from_hf_dict({**raw, "num_experts_per_tok": 6})
    with pytest.raises(ConfigError, match=r"mlp_only_layers \[7\]"):
        TargetConfig.from_hf_dict({**raw, "mlp_only_layers": [7]})


def test_gpt_oss_variant_matches_transformers():
    """MoEVariant(router_bias, expert_bias, clamped_swiglu, softmax_after_topk) == transformers'
    GptOssMLP with random weights; its interleaved gate_up_proj maps to gate_proj / up_proj."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from adaflash_jax.model.moe import MoEVariant

    e, d, f, k = 6, 16, 12, 2
    cfg = transformers.GptOssConfig(
        hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k
    )
    hf = GptOssMLP(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():  # large enough that the ±limit clamps bite
            p.copy_(torch.randn(p.shape, generator=gen))
    variant = MoEVariant(
        router_bias=True,
        expert_bias=True,
        activation="clamped_swiglu",
        alpha=cfg.swiglu_alpha,
        limit=cfg.swiglu_limit,
        softmax_after_topk=True,
    )
    ours = MoEBlock(
        d,
        f,
        e,
        k,
        norm_topk_prob=False,
        rngs=nnx.Rngs(0),
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        variant=variant,
    )
    t = {n: p.detach().numpy() for n, p in hf.named_parameters()}
    ours.gate.kernel[...] = t["router.weight"].T
    ours.gate.bias[...] = t["router.bias"]
    ours.gate_proj[...] = t["experts.gate_up_proj"][..., ::2]
    ours.up_proj[...] = t["experts.gate_up_proj"][..., 1::2]
    ours.gate_proj_bias[...] = t["experts.gate_up_proj_bias"][..., ::2]
    ours.up_proj_bias[...] = t["experts.gate_up_proj_bias"][..., 1::2]
    ours.down_proj[...] = t["experts.down_proj"]
    ours.down_proj_bias[...] = t["experts.down_proj_bias"]
    x = np.random.default_rng(0).normal(size=(2, 9, d)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.from_numpy(x))[0].numpy()
        gate_up = torch.from_numpy(x).reshape(-1, d) @ hf.experts.gate_up_proj[0]
    assert (gate_up[:, ::2] > cfg.swiglu_limit).any() and (
        gate_up[:, 1::2].abs() > cfg.swiglu_limit
    ).any()
    got = np.asarray(jax.jit(lambda m, x: m(x))(ours, jnp.asarray(x)))
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
