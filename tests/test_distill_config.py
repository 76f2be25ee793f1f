"""Run configs: the shipped files load, overrides parse, bad fields are named, the 8B recipe
builds abstractly (eval_shape only)."""

import dataclasses
import os

import jax
import pytest

from adaflash_jax.distill.abstract import abstract_stage2_state, nbytes
from adaflash_jax.distill.config import ConfigError, RunConfig
from adaflash_jax.distill.config_file import load_config, load_config_file
from adaflash_jax.distill.overrides import override
from adaflash_jax.distill.shapes import run_drafter, run_mesh, run_target
from adaflash_jax.model.presets import target_preset

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs")


@pytest.mark.parametrize(
    "name",
    [
        "tiny",
        "small",
        "qwen3_8b_v5p",
        "qwen3_coder_30b_a3b_v5p",
        "qwen3_5_9b_v5p",
        "qwen3_6_35b_a3b_v5p",
    ],
)
def test_shipped_configs_load(name):
    cfg = load_config(os.path.join(CONFIGS, f"{name}.py"))
    assert isinstance(cfg, RunConfig) and cfg.name == name


def test_overrides_and_errors():
    cfg = override(
        RunConfig(),
        {"stage1.steps": "7", "mesh": "(1, 8, 1)", "stage2.methods": "['sft']", "run_dir": "x"},
    )
    assert cfg.stage1.steps == 7 and cfg.mesh == (1, 8, 1) and cfg.stage2.methods == ("sft",)
    assert override(cfg, {"draft.init_from": "None"}).draft.init_from is None
    with pytest.raises(ConfigError, match="stage1.stepz"):
        override(cfg, {"stage1.stepz": "1"})
    with pytest.raises(ConfigError, match="stage2.alpha"):
        override(cfg, {"stage2.alpha": "1.5"})
    with pytest.raises(ConfigError, match="stage2.methods"):
        override(cfg, {"stage2.methods": "('dpo',)"})
    with pytest.raises(ConfigError, match="collector"):
        override(cfg, {"stage2.collect_temperature": "1.0"})  # replay is greedy-only
    with pytest.raises(ConfigError, match="mesh"):
        run_mesh(cfg, 3)
    for field, value in (
        ("stage2.anchors", "'sequence'"),  # stage 2 draws over the response or visited starts
        ("stage2.pool", "'eval'"),
        ("head_init.anchors", "'visited'"),
        ("stage2.b2", "1.0"),
        ("loss_chunk", "-1"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            override(cfg, {field: value})


def test_reference_recipe_is_the_reference():
    """The 8B recipe trains with the reference's anchors, pool, optimizer and no
    acceptance network (not part of the reference)."""
    cfg = load_config(os.path.join(CONFIGS, "qwen3_8b_v5p.py"))
    s2, h = cfg.stage2, cfg.head_init
    assert (s2.anchors, s2.pool, s2.b2, s2.decay_all, s2.clip_norm) == (
        "response",
        "fresh",
        0.999,
        True,
        1.0,
    )
    assert (s2.lr, s2.head_lr, s2.alpha, s2.tau, s2.temperature) == (3e-4, 2e-4, 0.8, 0.01, 1.0)
    assert (h.lr, h.num_anchors, h.anchors, h.b2, h.decay_all) == (
        5e-5,
        64,
        "sequence",
        0.999,
        True,
    )
    assert cfg.draft.accept_dim == 0
    assert (cfg.num_anchors, cfg.draft.block_size, cfg.seq_len) == (512, 16, 2048)


def test_coder_recipe_is_the_8b_recipe_with_its_target_and_drafter():
    """The 30B-A3B recipe trains as the 8B one (512 anchors, loss chunks, optimisers) and
    differs only in the target and the reference's 8-layer drafter for it."""
    base = load_config(os.path.join(CONFIGS, "qwen3_8b_v5p.py"))
    coder = load_config(os.path.join(CONFIGS, "qwen3_coder_30b_a3b_v5p.py"))
    differ = {
        f.name
        for f in dataclasses.fields(RunConfig)
        if getattr(base, f.name) != getattr(coder, f.name)
    }
    assert differ == {"name", "target_path", "target_shape", "draft"}
    assert (coder.draft.layers, coder.draft.target_layer_ids) == (8, (1, 12, 23, 34, 45))
    same = dict(layers=base.draft.layers, target_layer_ids=base.draft.target_layer_ids)
    assert dataclasses.replace(coder.draft, **same) == base.draft
    assert (coder.num_anchors, coder.loss_chunk) == (512, 32)


# ZinYY/AdaFlash configs/qwen3.5-9b-dflash-thresh-head.json: the drafter's shape keys
REFERENCE_QWEN35_9B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 10_000_000,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "num_target_layers": 32,
    "block_size": 16,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
REFERENCE_QWEN35_9B_DFLASH = {
    "mask_token_id": 248070,
    "target_layer_ids": [1, 8, 15, 22, 29],
    "thresh_head_bottleneck_dim": 256,
    "use_thresh_head_two_model": True,
    "thresh_head_direct_len": True,
}


def test_qwen3_5_9b_recipe_has_the_references_drafter():
    """The 9B hybrid recipe's drafter, as exported, has the reference config's shape, and the
    recipe trains as the 8B one at the reference's scale (512 anchors, K = 16, seq 2048)."""
    from adaflash_jax.drafter.hf_config import config_to_hf

    base = load_config(os.path.join(CONFIGS, "qwen3_8b_v5p.py"))
    cfg = load_config(os.path.join(CONFIGS, "qwen3_5_9b_v5p.py"))
    target = run_target(cfg)
    assert target.is_hybrid and target.num_hidden_layers == 32
    hf = config_to_hf(run_drafter(cfg, target))
    assert {k: hf[k] for k in REFERENCE_QWEN35_9B} == REFERENCE_QWEN35_9B
    dflash = hf["dflash_config"]
    assert {k: dflash[k] for k in REFERENCE_QWEN35_9B_DFLASH} == REFERENCE_QWEN35_9B_DFLASH
    assert (cfg.num_anchors, cfg.draft.block_size, cfg.seq_len) == (512, 16, 2048)
    differ = {
        f.name
        for f in dataclasses.fields(RunConfig)
        if getattr(base, f.name) != getattr(cfg, f.name)
    }
    assert differ == {"name", "target_path", "target_shape", "draft"}


def test_qwen3_6_35b_a3b_recipe():
    """The hybrid MoE recipe: the 8B recipe with its target and z-lab's drafter shape for it
    (8 layers, MLP 6144, 32 q / 4 kv heads of 128, layers [1, 10, 19, 28, 37], mask 248070)."""

    cfg = load_config(os.path.join(CONFIGS, "qwen3_6_35b_a3b_v5p.py"))
    target = run_target(cfg)
    assert target.model_type == "qwen3_5_moe_text"
    d = run_drafter(cfg, target)
    shape = (d.num_hidden_layers, d.intermediate_size, d.num_attention_heads)
    assert shape + (d.num_key_value_heads, d.head_dim) == (8, 6144, 32, 4, 128)
    assert d.target_layer_ids == (1, 10, 19, 28, 37) == target.default_feature_layers(5)
    assert d.mask_token_id == 248070 and d.block_size == 16
    assert (cfg.num_anchors, cfg.loss_chunk) == (512, 32)


def test_qwen3_8b_recipe_builds_abstractly():
    cfg = load_config(os.path.join(CONFIGS, "qwen3_8b_v5p.py"))
    state = abstract_stage2_state(cfg, target_preset("qwen3-8b"))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    drafter_gb = nbytes(state.params) / 2**30
    target_gb = nbytes(state.frozen) / 2**30
    assert 14 < target_gb < 17  # 8.2B bf16 params
    assert 3.5 < drafter_gb < 5.5  # ~1.1B fp32 master weights (5 layers + fc + head)
    assert nbytes(state.opt_state) == pytest.approx(2 * nbytes(state.params), rel=0.01)
    assert run_mesh(cfg, 32) == (4, 8, 1)


def test_one_config_file_loader(tmp_path):
    """The planner reads config files through the run config's loader; a file whose object
    is not a RunConfig still plans, but does not run."""
    path = tmp_path / "plan_only.py"
    path.write_text("import types\nCONFIG = types.SimpleNamespace(batch_size=4)\n")
    assert load_config_file(path).batch_size == 4
    with pytest.raises(ConfigError, match="not RunConfig"):
        load_config(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.py")


def test_a_run_directory_resumes_only_with_its_process_count(tmp_path):
    """The first start records the process count; a resume with another count is refused
    at start with one line naming both and the way out (grain keeps one position per
    process)."""
    import json
    import types

    from adaflash_jax.distill.pipeline import PROCESSES_FILE, check_process_count

    ctx = types.SimpleNamespace(
        run_dir=str(tmp_path), is_main=True, path=lambda *p: os.path.join(tmp_path, *p)
    )
    check_process_count(ctx)
    assert json.loads((tmp_path / PROCESSES_FILE).read_text()) == {"process_count": 1}
    check_process_count(ctx)  # the same count resumes
    (tmp_path / PROCESSES_FILE).write_text(json.dumps({"process_count": 2}))
    with pytest.raises(ConfigError, match="written by 2 processes and this run has 1: resume"):
        check_process_count(ctx)
