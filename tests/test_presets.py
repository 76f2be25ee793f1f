"""The one registry of target shapes (`model/presets.py`): every entry builds and round-trips
through HF's config.json; the planner, the benchmarks and the pretraining presets read it."""

from __future__ import annotations

import json
import math

import jax
import pytest
from flax import nnx

from adaflash_jax.bench.loop_timing import build_random_target
from adaflash_jax.model.config import ConfigError, TargetConfig
from adaflash_jax.model.presets import PRESETS, target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.plan import inputs as plan_inputs
from adaflash_jax.plan.params import target_params
from adaflash_jax.train.presets import get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_round_trips(name, tmp_path):
    cfg = target_preset(name)
    assert target_preset(name.upper()) == cfg
    # config.json round trip, through a file as a checkpoint stores it
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert TargetConfig.from_pretrained(tmp_path) == cfg
    # the module builds (abstractly: no weights allocated) with the planner's parameter count
    params = nnx.state(nnx.eval_shape(lambda: TargetLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    assert count == sum(p.size for p in target_params(cfg))


def test_consumers_read_the_registry():
    # the planner's qwen3-8b is the benchmark's (--shape) and the one the registry holds
    assert plan_inputs.target_preset("qwen3-8b") == target_preset("qwen3-8b")
    assert plan_inputs.target_from(type("C", (), {"target": "QWEN3-8B"})()) == target_preset(
        "qwen3-8b"
    )
    assert target_preset("qwen3-8b").num_hidden_layers == 36
    assert target_preset("qwen3-8b").hidden_size == 4096
    for name in ("micro", "tiny", "small"):  # pretraining presets: the registry's shapes
        p = get_preset(name)
        assert p.target_config(p.vocab_size, None) == target_preset(name)
    model = build_random_target("micro")
    assert model.config == target_preset("micro")
    assert target_preset("test", vocab_size=96).vocab_size == 96
    with pytest.raises(ConfigError, match="unknown target shape 'qwen9-1t'"):
        target_preset("qwen9-1t")
