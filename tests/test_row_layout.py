"""Decoding rows split over the mesh (`sharding.rows`): the engine and regeneration with
their slots / batch split over (data, fsdp) decode exactly what the unsplit ones do, and the
state they return really is split (each chip holds B / 8 rows)."""

import jax
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.distill.regenerate import generate_greedy
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rows import RowLayout, fetch
from adaflash_jax.sharding.rules import TRAIN_RULES, state_shardings
from adaflash_jax.train.mesh import make_mesh

V = 128
CFG = target_preset("test", vocab_size=V, max_position_embeddings=256)
SLOTS = 8
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9], list(range(20, 32)), [7] * 5]
MAX_NEW = [9, 6, 13, 3, 11, 8]


def _on_mesh(module, mesh):
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, state_shardings(state, mesh, TRAIN_RULES)))
    return module


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(2, 4, 1)


@pytest.fixture(scope="module")
def models(mesh):
    target = _on_mesh(TargetLM(CFG, rngs=nnx.Rngs(0)), mesh)
    dcfg = DrafterConfig.for_target(
        CFG, mask_token_id=V - 1, num_layers=1, block_size=4, num_features=2
    )
    return target, _on_mesh(Drafter(dcfg, rngs=nnx.Rngs(1)), mesh)


def test_layout_of_rules(mesh):
    layout = RowLayout.of(mesh, TRAIN_RULES, SLOTS)
    assert layout.axes == ("data", "fsdp") and layout.size == 8
    assert RowLayout.of(mesh, TRAIN_RULES, 6) is None  # indivisible: rows stay whole
    assert RowLayout.of(None, TRAIN_RULES, SLOTS) is None


def test_engine_rows_split_decode_the_same(models, mesh):
    target, drafter = models
    requests = list(zip(PROMPTS, MAX_NEW, strict=True))
    outs = {}
    for name, rows in (("whole", None), ("split", RowLayout.of(mesh, TRAIN_RULES, SLOTS))):
        engine = SpeculativeEngine(target, drafter, slots=SLOTS, capacity=64, rows=rows)
        results = engine.generate(requests)
        outs[name] = [(r.output_ids, list(r.accepted)) for r in results]
        if rows is not None:
            state = engine.prefill(engine.init_state(0), [(0, PROMPTS[0], 4)])
            k = state.target_cache.layers[0].k_BxSxKvxDh
            assert k.sharding.spec[0] == ("data", "fsdp")
            assert k.addressable_shards[0].data.shape[0] == SLOTS // 8  # one row per chip
            ctx = state.context_cache.layers[0].k_BxSxKvxDh
            assert ctx.addressable_shards[0].data.shape[0] == SLOTS // 8
            state, *_ = engine.run(state, stop_on_finish=False)
            assert state.out_BxS.addressable_shards[0].data.shape[0] == SLOTS // 8
            assert fetch(state.num_out_B)[0] == 4
    assert outs["split"] == outs["whole"]
    assert all(len(o) == m for (o, _), m in zip(outs["whole"], MAX_NEW, strict=True))


def test_regeneration_rows_split_decode_the_same(models, mesh):
    target, _ = models
    split = nnx.split(target, nnx.Param)
    kw = dict(max_new_tokens=12, batch_size=SLOTS, eos_ids=(), progress=False)
    whole = generate_greedy(split, CFG, PROMPTS, **kw)
    rows = RowLayout.of(mesh, TRAIN_RULES, SLOTS)
    assert generate_greedy(split, CFG, PROMPTS, rows=rows, **kw) == whole
    assert all(len(r) == 12 for r in whole)
    np.testing.assert_array_equal(fetch(np.arange(3)), np.arange(3))
