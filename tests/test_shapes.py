"""What a run config implies before weights load (distill/shapes.py) and the one mesh filler."""

import pytest

from adaflash_jax.distill.config import DataSpec, DraftSpec, RunConfig
from adaflash_jax.distill.shapes import (
    engine_capacity,
    run_drafter,
    run_mesh,
    run_target,
    slot_capacity,
    target_shape,
)
from adaflash_jax.model.config import ConfigError
from adaflash_jax.model.presets import target_preset
from adaflash_jax.train.mesh_shape import fill_mesh


def test_slot_capacity_rounds_prompt_tokens_and_a_block_up_to_16():
    assert slot_capacity(10, 20, 2) == 32
    assert slot_capacity(10, 20, 18) == 48
    assert slot_capacity(0, 0, 16) == 16
    cfg = RunConfig(
        seq_len=256,
        data=DataSpec(max_prompt_len=100, max_new_tokens=60),
        draft=DraftSpec(block_size=8),
    )
    assert engine_capacity(cfg) == 176  # 168 rounded up


def test_fill_mesh_fills_one_axis_and_names_what_does_not_fit():
    assert fill_mesh((-1, 2, 1), 8) == (4, 2, 1)
    assert fill_mesh((2, 2, 2), None) == (2, 2, 2)
    with pytest.raises(ConfigError, match="'data' cannot be filled"):
        fill_mesh((-1, 3, 1), 8)
    with pytest.raises(ConfigError, match="uses 8 devices, but 4"):
        fill_mesh((2, 2, 2), 4)
    with pytest.raises(ConfigError, match="pass the device count"):
        fill_mesh((1, -1, 1), None)
    with pytest.raises(ConfigError, match="only one mesh axis"):
        RunConfig(mesh=(-1, -1, 1))
    with pytest.raises(ConfigError, match="fsdp=0"):
        RunConfig(mesh=(1, 0, 1))
    assert run_mesh(RunConfig(mesh=(2, -1, 1)), 8) == (2, 4, 1)


def test_run_shapes_need_no_weights():
    cfg = RunConfig(target_shape="qwen3-8b", draft=DraftSpec(layers=3))
    target = run_target(cfg)
    assert target == target_preset("qwen3-8b") == target_shape(shape="qwen3-8b")
    drafter = run_drafter(cfg, target)
    assert drafter.num_hidden_layers == 3 and drafter.mask_token_id == target.vocab_size - 1
    assert run_target(RunConfig()).num_hidden_layers > 0  # the embedded preset, unbuilt
    with pytest.raises(ConfigError, match="GCS"):
        target_shape(path="gs://bucket/model")
    with pytest.raises(ConfigError, match="names no target"):
        target_shape()


def test_the_planner_plans_the_drafter_the_run_trains():
    """Heads, MLP width and length head of a recipe's drafter reach the planner: the MoE
    recipe's drafter is a dense 6,144-wide MLP, not the target's per-expert width."""
    import os

    from adaflash_jax.distill.config_file import load_config
    from adaflash_jax.plan.inputs import inputs_from_config

    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs")
    cfg = load_config(os.path.join(path, "qwen3_6_35b_a3b_v5p.py"))
    drafter = run_drafter(cfg, run_target(cfg))
    shape = inputs_from_config(cfg, devices=32).drafter
    assert shape.intermediate_size == drafter.intermediate_size != run_target(cfg).intermediate_size
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (
        drafter.num_attention_heads, drafter.num_key_value_heads, drafter.head_dim
    )  # fmt: skip
    assert shape.accept_dim == drafter.length_head.accept_dim
