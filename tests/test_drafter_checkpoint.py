"""Drafter export format (docs/design.md §6): round trip, published-checkpoint import, bad input."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.drafter.checkpoint import HEAD_PREFIX, load_drafter, save_drafter
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.hf_config import config_from_hf
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file
from adaflash_jax.model.checkpoint import CheckpointError, save_target
from adaflash_jax.model.config import ConfigError, TargetConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.tokenizer import write_byte_tokenizer
from experiments import export as export_cli
from experiments import init_drafter

TARGET = target_preset("test", vocab_size=64, intermediate_size=48, num_hidden_layers=6)


def _drafter(head=True):
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=63, num_layers=2, block_size=4, num_features=2, length_head=head
    )
    return Drafter(cfg, rngs=nnx.Rngs(0))


def _leaves(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_round_trip_is_bitwise_and_drafts_identically(tmp_path):
    drafter = _drafter()
    save_drafter(drafter, tmp_path, dtype=None)
    loaded = load_drafter(tmp_path)
    assert loaded.config == drafter.config
    for a, b in zip(_leaves(drafter), _leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    emb = jax.random.normal(jax.random.key(1), (64, 32))
    feats = jax.random.normal(jax.random.key(2), (2, 5, 64))
    outs = []
    for d in (drafter, loaded):
        cache = d.append_context(d.init_context_cache(2, 8), feats)
        outs.append(d.draft(cache, jnp.array([1, 2]), emb, emb.T).logits_BxKm1xV)
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


def test_export_layout_names_and_config(tmp_path):
    save_drafter(_drafter(), tmp_path)  # bf16 by default
    f = SafetensorsFile(tmp_path / "model.safetensors")
    keys = set(f.keys())
    assert "fc.weight" in keys and f.shape("fc.weight") == (32, 64)  # [out, in]
    assert f.shape("layers.0.self_attn.k_proj.weight") == (16, 32)
    assert f.shape(HEAD_PREFIX + "down.weight") == (256, 64)
    assert f.shape(HEAD_PREFIX + "res.0.weight") == (256, 256)
    assert f.shape(HEAD_PREFIX + "out.bias") == (1,)
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in keys)
    assert str(f.dtype("fc.weight")) == "bfloat16"
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    assert cfg["dflash_config"]["use_thresh_head_two_model"] is True
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4]
    # what serving stacks read without defaults of their own, and current transformers' dtype
    assert cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None
    assert cfg["num_target_layers"] == 6
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    # every key a stack reads, in both places where stacks differ (issue 27)
    assert cfg["mask_token_id"] == cfg["dflash_config"]["mask_token_id"] == 63
    assert cfg["target_layer_ids"] == [1, 3] and cfg["is_causal"] is False
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == TARGET.rope_theta
    assert cfg["rope_parameters"]["rope_type"] == "default" and cfg["rope_scaling"] is None
    # bf16 export reloads to the bf16-rounded weights exactly
    loaded = load_drafter(tmp_path)
    want = np.asarray(_drafter().fc.kernel[...]).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(loaded.fc.kernel[...]), want)


def test_config_dtype_names_the_stored_dtype(tmp_path):
    save_drafter(_drafter(), tmp_path, dtype=None)  # float32 parameters, kept as they are
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert str(SafetensorsFile(tmp_path / "model.safetensors").dtype("fc.weight")) == "float32"


def test_missing_target_layer_ids_take_the_format_default(tmp_path):
    """DFlash's rule: one target layer per drafter layer, spread as docs/design.md §2 says."""
    published = {
        "block_size": 16,
        "dflash_config": {"mask_token_id": 500},
        "num_target_layers": 36,
        "num_hidden_layers": 5,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "vocab_size": 512,
    }
    assert config_from_hf(published).target_layer_ids == (1, 9, 17, 25, 33)
    assert config_from_hf({**published, "num_hidden_layers": 1}).target_layer_ids == (18,)
    with pytest.raises(ValueError, match="target_layer_ids.*num_target_layers"):
        config_from_hf({k: v for k, v in published.items() if k != "num_target_layers"})
    # an export whose layers are the default loads the same without the key
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=63, num_layers=3, block_size=4, num_features=3, length_head=False
    )
    save_drafter(Drafter(cfg, rngs=nnx.Rngs(0)), tmp_path, dtype=None)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["dflash_config"]["target_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_drafter(tmp_path).config == cfg and cfg.target_layer_ids == (1, 2, 3)


def test_declared_head_without_its_tensors_is_refused(tmp_path):
    save_drafter(_drafter(), tmp_path / "ok", dtype=None)
    f = SafetensorsFile(tmp_path / "ok" / "model.safetensors")
    os.makedirs(tmp_path / "stripped")
    save_file(
        {k: np.asarray(f.get(k)) for k in f.keys() if not k.startswith(HEAD_PREFIX)},
        tmp_path / "stripped" / "model.safetensors",
    )
    raw = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "stripped" / "config.json").write_text(json.dumps(raw))
    for kw in ({}, {"with_length_head": True}):
        with pytest.raises(CheckpointError, match=r"declares a length head.*down\.weight") as e:
            load_drafter(tmp_path / "stripped", **kw)
        assert "\n" not in str(e.value)
    # asked for no head, it loads as a plain DFlash drafter
    assert load_drafter(tmp_path / "stripped", with_length_head=False).length_head is None


def test_imports_published_dflash_checkpoint_without_head(tmp_path):
    """Published drafters (bigger shapes, bf16, no length head) load; a fresh head is added."""
    import torch
    from safetensors.torch import save_file as torch_save

    d, heads, kv, hd, inter, layers, n_feat = 128, 4, 2, 32, 256, 2, 5
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    t = {"fc.weight": w(d, n_feat * d), "hidden_norm.weight": w(d), "norm.weight": w(d)}
    for i in range(layers):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": w(d),
            p + "post_attention_layernorm.weight": w(d),
            p + "self_attn.q_proj.weight": w(heads * hd, d),
            p + "self_attn.k_proj.weight": w(kv * hd, d),
            p + "self_attn.v_proj.weight": w(kv * hd, d),
            p + "self_attn.o_proj.weight": w(d, heads * hd),
            p + "self_attn.q_norm.weight": w(hd),
            p + "self_attn.k_norm.weight": w(hd),
            p + "mlp.gate_proj.weight": w(inter, d),
            p + "mlp.up_proj.weight": w(inter, d),
            p + "mlp.down_proj.weight": w(d, inter),
        }
    torch_save(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": 16,
        "dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 9, 17, 25, 33]},
        "num_target_layers": 36,
        "hidden_size": d,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "vocab_size": 512,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    plain = load_drafter(tmp_path)
    assert plain.length_head is None and plain.config.block_size == 16
    q = t["layers.1.self_attn.q_proj.weight"].float().numpy()
    np.testing.assert_array_equal(np.asarray(plain.layers[1].self_attn.q_proj.kernel[...]), q.T)
    with_head = load_drafter(tmp_path, with_length_head=True)
    assert with_head.length_head is not None
    assert with_head.length_head.down.kernel[...].shape == (2 * d, 256)


def test_bad_drafter_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(tmp_path / "nope")
    save_drafter(_drafter(head=False), tmp_path / "ok", dtype=None)
    with pytest.raises(FileNotFoundError, match="config.json"):
        os.makedirs(tmp_path / "noconfig")
        (tmp_path / "noconfig" / "model.safetensors").write_bytes(
            (tmp_path / "ok" / "model.safetensors").read_bytes()
        )
        load_drafter(tmp_path / "noconfig")
    f = SafetensorsFile(tmp_path / "ok" / "model.safetensors")
    tensors = {k: np.asarray(f.get(k)) for k in f.keys()}
    cfg_text = (tmp_path / "ok" / "config.json").read_text()
    for name, mutate, msg in (
        ("missing", lambda t: t.pop("norm.weight"), "missing tensors.*norm.weight"),
        ("extra", lambda t: t.update({"bogus.weight": np.zeros(2, np.float32)}), "unexpected"),
        ("shape", lambda t: t.update({"fc.weight": np.zeros((32, 32), np.float32)}), "shape"),
    ):
        bad = dict(tensors)
        mutate(bad)
        os.makedirs(tmp_path / name)
        save_file(bad, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(cfg_text)
        with pytest.raises(CheckpointError, match=msg):
            load_drafter(tmp_path / name)


def test_export_refuses_nan_weights(tmp_path):
    drafter = _drafter()
    drafter.norm.weight.set_value(drafter.norm.weight[...].at[0].set(jnp.nan))
    with pytest.raises(ValueError, match="norm.weight"):
        save_drafter(drafter, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()


def test_init_drafter_cli(tmp_path):
    target = TargetLM(TARGET, rngs=nnx.Rngs(0))
    save_target(target, tmp_path / "target")
    init_drafter.main(
        [
            "--target",
            str(tmp_path / "target"),
            "--out",
            str(tmp_path / "d"),
            "--layers",
            "2",
            "--block-size",
            "8",
            "--mask-token-id",
            "63",
            "--num-features",
            "3",
        ]
    )
    d = load_drafter(tmp_path / "d")
    assert d.config.block_size == 8 and d.config.target_layer_ids == (1, 2, 3)
    assert d.config.num_hidden_layers == 2 and d.length_head is not None
    # no tokenizer: the last rows are the candidates
    with pytest.raises(SystemExit, match=r"pass --mask-token-id ID.*last rows, e.g. 63, 62, 61"):
        init_drafter.main(["--target", str(tmp_path / "target"), "--out", str(tmp_path / "e")])


@pytest.mark.parametrize(
    "specials, vocab_extra, match",
    [
        # every row is a token; placeholder specials are the candidates
        (
            ("<|endoftext|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>"),
            0,
            r"unused special token, e.g. 257 '<\|reserved_special_token_0\|>', 258 ",
        ),
        (("<|endoftext|>", "<|im_end|>"), 0, r"last rows, e.g. 257, 256, 255, 254"),
        # rows past the tokenizer's ids (DFlash's choice for Qwen3) come first
        (("<|endoftext|>",), 3, r"spare row \(257\.\.259\), e\.g\. 257, 258, 259"),
    ],
)
def test_init_drafter_without_mask_token_names_the_flag_and_candidates(
    tmp_path, capsys, specials, vocab_extra, match
):
    vocab = write_byte_tokenizer(tmp_path / "target", special_tokens=specials)
    cfg = dict(TARGET.__dict__, vocab_size=vocab + vocab_extra)
    save_target(TargetLM(TargetConfig(**cfg), rngs=nnx.Rngs(0)), tmp_path / "target")
    with pytest.raises(SystemExit) as e:
        init_drafter.main(["--target", str(tmp_path / "target"), "--out", str(tmp_path / "d")])
    msg = str(e.value)
    assert msg.startswith("error: ") and "\n" not in msg and "pass --mask-token-id ID" in msg
    assert re.search(match, msg), msg
    assert not (tmp_path / "d").exists()


# ---- sliding-window drafters, published configs, per-stack exports (issue 27) ---------------
def _windowed(window=8, head=True):
    cfg = DrafterConfig.for_target(
        TARGET,
        mask_token_id=63,
        num_layers=3,
        block_size=4,
        num_features=8,
        length_head=head,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        sliding_window=window,
    )
    return Drafter(cfg, rngs=nnx.Rngs(0))


def test_window_round_trips_with_its_keys(tmp_path):
    drafter = _windowed()
    save_drafter(drafter, tmp_path, dtype=None)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert raw["use_sliding_window"] is True and raw["sliding_window"] == 8
    assert raw["max_window_layers"] == 3 and len(raw["dflash_config"]["target_layer_ids"]) == 8
    loaded = load_drafter(tmp_path)
    assert loaded.config == drafter.config and loaded.config.layer_window(2) is None


def _published(**changes):
    """A z-lab Qwen3.5-style DFlash config: sliding layers but the last, rope_parameters θ 1e7,
    8 target layers (shapes shrunk)."""
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 16,
        "dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29]},
        "num_target_layers": 32,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "max_window_layers": 3,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
        "vocab_size": 512,
        "tie_word_embeddings": True,
        "is_causal": False,
    }
    raw.update(changes)
    return raw


def test_published_sliding_window_config_is_honoured():
    cfg = config_from_hf(_published())
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert cfg.sliding_window == 4096 and cfg.rope_theta == 1e7 and cfg.num_features == 8
    # transformers' rule without layer_types: layers from max_window_layers on slide
    derived = config_from_hf(_published(layer_types=None, max_window_layers=1))
    assert derived.layer_types == ("full_attention", "sliding_attention", "sliding_attention")


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"use_sliding_window": False}, "use_sliding_window"),
        ({"sliding_window": None}, "sliding_window"),
        ({"sliding_window": 8}, "sliding_window"),  # below the block (16)
        (
            {"layer_types": ["sliding_attention", "linear_attention", "full_attention"]},
            "layer_types",
        ),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"is_causal": True}, "is_causal"),
        ({"dflash_config": {"mask_token_id": 500, "causal": True}}, "dflash_config.causal"),
        ({"dflash_config": {"mask_token_id": 500, "use_swa": True}}, "dflash_config.use_swa"),
        ({"architectures": ["DFlash2DraftModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_configs_we_cannot_honour_are_refused_naming_the_key(changes, key):
    with pytest.raises(ConfigError, match=re.escape(key)) as e:
        config_from_hf(_published(**changes))
    assert "\n" not in str(e.value)


def test_export_for_each_stack(tmp_path, capsys):
    """--for vllm / tpu-inference / sglang-jax: the plain layout (no head tensors or keys),
    loaded by ours as plain DFlash with the same weights; the AdaFlash layout keeps the head;
    each stack's differences print as warning lines."""
    drafter = _windowed()
    save_drafter(drafter, tmp_path / "adaflash")
    assert export_cli.main([str(tmp_path / "adaflash"), "--for", "tpu-inference"]) == 0
    err = capsys.readouterr().err
    plain = tmp_path / "adaflash-tpu-inference"
    assert "warning: tpu-inference 0.32.0" in err and "theta 1e+06" in err
    assert "runs the sliding_attention layers (window 8) as full attention" in err
    names = set(SafetensorsFile(plain / "model.safetensors").keys())
    assert names and not any(n.startswith(HEAD_PREFIX) for n in names)
    raw = json.loads((plain / "config.json").read_text())
    assert "use_thresh_head_two_model" not in raw["dflash_config"]
    assert raw["layer_types"][0] == "sliding_attention"
    loaded = load_drafter(plain)
    assert loaded.length_head is None
    np.testing.assert_array_equal(
        np.asarray(loaded.fc.kernel[...]),
        np.asarray(load_drafter(tmp_path / "adaflash").fc.kernel[...]),
    )
    assert str(SafetensorsFile(plain / "model.safetensors").dtype("fc.weight")) == "bfloat16"
    assert (
        export_cli.main(
            [str(tmp_path / "adaflash"), "--for", "sglang", "--out", str(tmp_path / "s")]
        )
        == 0
    )
    assert any(
        n.startswith(HEAD_PREFIX)
        for n in SafetensorsFile(tmp_path / "s" / "model.safetensors").keys()
    )
    with pytest.raises(SystemExit, match="--out must differ"):
        export_cli.main([str(tmp_path / "adaflash"), "--out", str(tmp_path / "adaflash")])


def test_last_target_layer_is_warned_at_init_and_export(tmp_path, capsys):
    target = TargetLM(TARGET, rngs=nnx.Rngs(0))
    save_target(target, tmp_path / "target")
    argv = ["--target", str(tmp_path / "target"), "--out", str(tmp_path / "d"), "--layers", "2"]
    init_drafter.main(argv + ["--mask-token-id", "63", "--target-layer-ids", "1,5"])
    err = capsys.readouterr().err
    assert "include the target's last layer 5" in err and "tpu-inference feeds the un-normed" in err
    export_cli.main([str(tmp_path / "d"), "--for", "sglang-jax"])
    assert "sglang-jax never captures that layer" in capsys.readouterr().err
    init_drafter.main(argv[:3] + [str(tmp_path / "e")] + argv[4:] + ["--mask-token-id", "63"])
    assert "last layer" not in capsys.readouterr().err
