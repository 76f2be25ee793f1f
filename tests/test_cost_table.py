"""The one cost table: its JSON format and reader, the producer (`bench.step_cost`) timing the
engine's own loop programs, and its readers: goodput, the benchmark's cost model, the
projection."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.bench import cost_model as cm
from adaflash_jax.bench import step_cost
from adaflash_jax.decode.build import build_engine
from adaflash_jax.decode.goodput.policy import GoodputPolicy
from adaflash_jax.decode.policy import Draft, FixedPolicy, PolicyError, Slots
from adaflash_jax.decode.slots import EngineError, SpeculativeEngine
from adaflash_jax.decode.tree import TreeShape
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io.cost_table import FORMAT, VerifyCostTable
from adaflash_jax.model.target import TargetLM
from experiments import project_throughput

TABLE = VerifyCostTable(
    rows=(1, 4, 16),
    widths=(1, 2, 4, 8),
    verify_ms=((1.0, 1.05, 1.1, 1.3), (1.2, 1.5, 2.0, 3.0), (2.0, 3.5, 6.0, 11.0)),
    draft_ms=(0.3, 0.5, 1.0),
    device="synthetic",
)


@pytest.fixture(scope="module")
def models(tiny_target_config):
    target = TargetLM(tiny_target_config, rngs=nnx.Rngs(0))
    dcfg = DrafterConfig.for_target(
        tiny_target_config, mask_token_id=63, num_layers=1, block_size=4, num_features=2
    )
    return target, Drafter(dcfg, rngs=nnx.Rngs(1))


def test_json_round_trip_interpolation_and_one_format(tmp_path):
    path = tmp_path / "t.json"
    TABLE.save(path)
    assert VerifyCostTable.load(path) == TABLE and json.loads(path.read_text())["format"] == FORMAT
    ms = np.asarray(jax.jit(TABLE.step_ms, static_argnums=1)(jnp.int32(10), (1, 8)))
    # 10 rows: halfway between the 4- and 16-row measurements
    np.testing.assert_allclose(ms, [(1.2 + 2.0) / 2 + 0.75, (3.0 + 11.0) / 2 + 0.75], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(TABLE.step_ms(64, (2,))), [3.5 + 1.0])  # clamped
    assert TABLE.at_rows(4).verify_ms == (TABLE.verify_ms[1],) and TABLE.at_rows(4).rows == (4,)
    with pytest.raises(ValueError, match="not 5"):
        TABLE.at_rows(5)
    with pytest.raises(ValueError, match="ascending"):
        VerifyCostTable(rows=(4, 1), widths=(1,), verify_ms=((1,), (1,)), draft_ms=(0, 0))
    with pytest.raises(ValueError, match="one row per"):
        VerifyCostTable(rows=(1,), widths=(1, 2), verify_ms=((1,),), draft_ms=(0,))
    # any other JSON: one line naming the format expected
    (tmp_path / "old.json").write_text(json.dumps({"target_forward_ms": []}))
    with pytest.raises(cm.CostError, match="adaflash_jax.verify_cost/1") as err:
        cm.read_cost_json(str(tmp_path / "old.json"))
    assert "\n" not in str(err.value)


def test_producer_decomposes_the_engine_steps(monkeypatch, models):
    """verify[1] = the plain loop's step; draft = the draft forward; draft + verify[W] = the
    loop step pinned to W. A step's cost is the difference of an n-step and a 1-step call,
    so a call's own overhead (the switch cost) never lands in it."""
    step = {1: 3.0, 2: 5.5, 4: 7.0}  # per loop step, by verify width (1: the plain loop)
    packed_step = {2: 4.5, 3: 5.0}  # per loop step, by packed fill (rows·fill tokens)
    calls = []

    def fake_loop_ms(engine, spec, *, steps, **_):
        calls.append(steps)
        width = 1 if engine.drafter is None else spec.buckets[-1]
        assert spec.buckets == (width,) and (width == 1 or spec.policy.name == "fixed")
        if spec.packed:  # every row at `width` tokens: the bucket holds exactly that
            assert spec.token_buckets == (engine.slots * width,)
            return 4.5 + steps * packed_step[width]
        return 4.5 + steps * step[width]

    monkeypatch.setattr(step_cost, "_loop_ms", fake_loop_ms)
    monkeypatch.setattr(step_cost, "_draft_ms", lambda engine, **_: 2.0)
    target, drafter = models
    table = step_cost.measure(
        target, drafter, rows=(2,), capacity=64, buckets=(1, 2, 4), fills=(1, 2, 3)
    )
    assert table.rows == (2,) and table.widths == (1, 2, 4) and table.draft_ms == (2.0,)
    np.testing.assert_allclose(table.verify_ms[0], (3.0, 3.5, 5.0))
    np.testing.assert_allclose(np.asarray(table.step_ms(2, (2, 4))), (5.5, 7.0))
    assert table.fills == (1, 2, 3)  # fill 1: every row verifies its bonus, the plain step
    np.testing.assert_allclose(table.packed_ms[0], (3.0, 2.5, 3.0))
    np.testing.assert_allclose(np.asarray(table.packed_step_ms(2, (2, 3))), (4.5, 5.0))
    assert VerifyCostTable.from_json(table.to_json()) == table
    assert table.switch_ms == pytest.approx(4.5)
    assert set(calls) == {1, 7}  # (capacity 64 − 2) // (2·K) steps fit the cache


def test_tree_tables_time_the_tree_engine_at_fills_past_the_block(monkeypatch, models):
    """With a tree the packed cases run the tree engine, each row verifying its root and
    first fill − 1 nodes, at fills beyond K (a tree's rows are wider than a block); the
    chain widths still time the chain engine. Goodput over that tree engine takes the table."""
    shape = TreeShape(topk=2, nodes=5)
    seen = []

    def fake_loop_ms(engine, spec, *, steps, **_):
        if spec.packed:
            assert spec.tree == shape and engine.spec.tree == shape
            (tokens,) = spec.token_buckets
            assert spec.policy == FixedPolicy(width=tokens // engine.slots)
            seen.append(tokens // engine.slots)
            return 1.0 + steps * (2.0 + 0.5 * tokens)
        assert spec.tree is None
        return 1.0 + steps * (2.0 + spec.buckets[-1])

    monkeypatch.setattr(step_cost, "_loop_ms", fake_loop_ms)
    monkeypatch.setattr(step_cost, "_draft_ms", lambda engine, **_: 1.0)
    target, drafter = models
    table = step_cost.measure(
        target, drafter, rows=(2,), capacity=64, buckets=(1, 2, 4), fills=(2, 3, 6), tree=shape
    )
    assert table.fills == (1, 2, 3, 6) and set(seen) == {2, 3, 6}
    np.testing.assert_allclose(table.packed_ms[0][1:], [2.0 + 0.5 * 2 * f - 1.0 for f in (2, 3, 6)])
    engine = SpeculativeEngine(
        target, drafter, slots=2, capacity=64, buckets=(1, 2, 4), tree=shape,
        token_buckets=(2, 4, 6, 12), policy=GoodputPolicy(cost=table),
    )  # fmt: skip
    assert engine.policy_slots.nodes == 5


def test_producer_times_the_engine_and_the_projection_reads_it(tmp_path, models, capsys):
    target, drafter = models
    table = step_cost.measure(
        target, drafter, rows=(1, 2), capacity=32, buckets=(1, 2, 4), steps=3, rounds=1
    )
    data = table.to_json()
    assert set(data) >= {"format", "rows", "widths", "verify_ms", "draft_ms", "switch_ms"}
    assert data["format"] == FORMAT and table.rows == (1, 2) and table.widths == (1, 2, 4)
    assert all(ms > 0 for row in table.verify_ms for ms in row) and min(table.draft_ms) > 0
    assert table.device == step_cost.device_kind() and step_cost.KIND in table.model
    path = tmp_path / "cost.json"
    table.save(path)
    assert VerifyCostTable.load(path) == table
    cells = [{"label": "d/fixed", "method": "d", "policy": "fixed", "policy_options": {},
              "concurrency": 1, "domain": "code", "block_size": 4, "buckets": [1, 2, 4],
              "accepted": ["30", "13"], "requested": ["33", "33"]}]  # fmt: skip
    traces = tmp_path / "traces.json"
    traces.write_text(json.dumps({"cells": cells, "cost_tables": {}}))
    out = tmp_path / "proj.json"
    argv = ["--traces", str(traces), "--cost", str(path), "--concurrency", "1,2"]
    assert project_throughput.main([*argv, "--json", str(out)]) == 0
    assert step_cost.KIND in capsys.readouterr().out  # the header names the table's model
    got = {(r["label"], r["concurrency"]): r for r in json.loads(out.read_text())["rows"]}
    assert got[("plain", 2)]["tokens_per_s"] == pytest.approx(2e3 / table.verify(2, 1))
    drafted_ms = table.draft_ms[0] + table.verify(1, 4)  # the loop step pinned to W = 4
    assert got[("d/fixed", 1)]["tokens_per_s"] == pytest.approx(1e3 * 2.75 / drafted_ms)


def test_engine_table_measures_once_and_caches(tmp_path, monkeypatch, models):
    target, drafter = models
    seen = []

    def fake_measure(target, drafter, *, rows, capacity, buckets, **kw):
        seen.append((rows, capacity, buckets, kw["temperature"]))
        return dataclasses_replace_rows(TABLE.at_rows(4), rows[0], buckets)

    monkeypatch.setattr(step_cost, "measure", fake_measure)
    kw = dict(slots=2, capacity=32, buckets=(1, 2, 4))
    measured = functools.partial(step_cost.engine_table, target, drafter, cache_dir=str(tmp_path))
    engine = build_engine(target, drafter, policy="goodput", cost_table=measured(**kw), **kw)
    assert seen == [((2,), 32, (1, 2, 4), 0.0)] and engine.policy.cost.rows == (2,)
    assert len(list(tmp_path.iterdir())) == 1
    assert measured(**kw) == engine.policy.cost and len(seen) == 1  # cached: measured once
    measured(**kw, temperature=1.0)  # another sampling mode: measured
    assert len(seen) == 2
    # goodput's options are checked before any measurement
    with pytest.raises(EngineError, match="length head|accept_probs"):
        measured(**kw, temperature=0.5, policy_kwargs={"estimator": "head"})
    assert len(seen) == 2
    given = build_engine(target, drafter, policy="goodput", cost_table=TABLE, **kw)
    assert len(seen) == 2 and given.policy.cost == TABLE
    with pytest.raises(PolicyError, match="verify-cost table"):
        build_engine(target, drafter, policy="goodput", **kw)


def dataclasses_replace_rows(table, rows, widths):
    cols = [table.widths.index(w) for w in widths]
    return VerifyCostTable(
        rows=(rows,),
        widths=widths,
        verify_ms=(tuple(table.verify_ms[0][c] for c in cols),),
        draft_ms=table.draft_ms,
    )


@functools.partial(jax.jit, static_argnames=("policy",))
def _widths(policy, draft):
    slots = Slots(count=draft.active_B.shape[0], block_size=8)
    return policy.widths(draft, policy.init(slots))[0]


def test_goodput_decides_the_same_from_the_produced_table(tmp_path, models):
    """Old path: the engine-step calibration's table (draft = step(drafted, W=1) −
    step(undrafted), verify[W] = step(drafted, W) − draft) given to `GoodputPolicy` as an
    object. New path: the producer's `table_from_steps` of the same steps (the draft forward
    timed on its own: the W = 1 drafted step is the plain step plus it), saved to JSON and
    read back by `build_engine`. Goodput picks the same width for every input."""
    plain = np.array([1.0, 1.2, 2.0])  # rows 1, 4, 16
    drafted = np.array([[1.35, 1.4, 1.6], [1.9, 2.4, 3.4], [4.3, 6.8, 11.8]])  # W = 2, 4, 8
    draft = np.array([0.3, 0.4, 0.8])
    at_1 = plain + draft  # a drafted step pinned to W = 1 (old path only)
    old_draft = at_1 - plain
    old = VerifyCostTable(
        rows=(1, 4, 16),
        widths=(1, 2, 4, 8),
        verify_ms=tuple((p, *(d - dr)) for p, d, dr in zip(plain, drafted, old_draft)),
        draft_ms=tuple(old_draft),
    )
    new = step_cost.table_from_steps(
        rows=(1, 4, 16), widths=(2, 4, 8), plain_ms=plain, draft_ms=draft, drafted_ms=drafted,
        device="synthetic", model="",
    )  # fmt: skip
    np.testing.assert_allclose(new.verify_ms, old.verify_ms, rtol=1e-12)
    new.save(tmp_path / "new.json")
    target, drafter = models
    dcfg = DrafterConfig.for_target(
        target.config, mask_token_id=63, num_layers=1, block_size=8, num_features=2
    )
    engine = build_engine(
        target, Drafter(dcfg, rngs=nnx.Rngs(2)), slots=16, capacity=64, buckets=(1, 2, 4, 8),
        policy="goodput", policy_kwargs={"estimator": "confidence"},
        cost_table=str(tmp_path / "new.json"),
    )  # fmt: skip
    assert engine.policy == GoodputPolicy(cost=new, estimator="confidence")
    old_policy = GoodputPolicy(cost=old, estimator="confidence")
    rng = np.random.default_rng(0)
    picked = set()
    for i in range(24):
        b = 16
        sharpness = rng.uniform(0.0, 12.0, size=(b, 1, 1))  # the drafter's confidence
        logits = rng.normal(size=(b, 7, 16)) * sharpness
        active = rng.random(b) < (i + 1) / 24
        active[0] = True
        draft = Draft(
            hidden_BxKxD=jnp.zeros((b, 8, 4)),
            logits_BxKm1xV=jnp.asarray(logits, jnp.float32),
            length_r_B=None,
            head_accept_BxKm1=None,
            active_B=jnp.asarray(active),
            num_running=jnp.asarray(active.sum(), jnp.int32),
            buckets=(1, 2, 4, 8),
        )
        want = np.asarray(_widths(old_policy, draft))
        np.testing.assert_array_equal(np.asarray(_widths(engine.policy, draft)), want)
        picked.add(int(want[0]))
    assert len(picked) >= 3  # the inputs exercise several widths
