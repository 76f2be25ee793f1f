"""The stage-2 train step's memory-saving paths against the plain ones: the block-sparse
training attention and the chunked losses give the same loss, metrics and update as the
dense attention with all logits at once. Non-finite steps: skipped bit-exactly, counted, and
a run of them stops the stage with one line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from adaflash_jax.distill import steps
from adaflash_jax.distill.loop import StageRun, run_stage
from adaflash_jax.distill.state import fresh_drafter, new_train_state
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.mesh import make_mesh
from adaflash_jax.train.optimizer import (
    NonFiniteError,
    OptimizerConfig,
    nonfinite_metrics,
    path_labels,
    skip_counts,
    skip_nonfinite,
)
from adaflash_jax.train.state import TrainState

TARGET = target_preset("test", vocab_size=96, intermediate_size=48, num_hidden_layers=3)
B, S, N, K = 2, 40, 5, 4


def _batch():
    rng = np.random.default_rng(0)
    mask = np.zeros((B, S), bool)
    mask[0, 6:30], mask[1, 10:40] = True, True  # responses of different lengths
    anchors = np.stack([np.sort(rng.choice(np.arange(6, 28), N, replace=False)) for _ in range(B)])
    anchors[1, 0] = 10
    valid = np.ones((B, N), bool)
    valid[0, -1] = False  # a padding block
    return {
        "tokens": rng.integers(0, 90, (B, S)).astype(np.int32),
        "loss_mask": mask,
        "anchors": anchors.astype(np.int32),
        "valid": valid,
    }


@functools.cache
def _compiled(attention, loss_chunk, attention_chunk):
    """(jitted stage-2 step, a maker of fresh states, batch shardings): built once per
    setting, so tests that share one share its compilation."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    target = TargetLM(TARGET, rngs=nnx.Rngs(0))
    target.lm_head.kernel[...] = 5.0 * target.lm_head.kernel[...]  # a teacher with real KL
    t_graph, t_params = nnx.split(target, nnx.Param)
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=95, num_layers=2, block_size=K, target_layer_ids=(0, 1),
        accept_dim=8,
    )  # fmt: skip
    d_graph, params = fresh_drafter(cfg, mesh=mesh, rules=TRAIN_RULES, seed=3)
    opt = OptimizerConfig(lr=1e-2, schedule="constant", b2=0.999, decay_all=True)
    tx, schedules = steps.make_optimizer(
        {"drafter": opt, "head": opt, "accept": opt}, clip_norm=1.0
    )

    def fresh():
        return new_train_state(params, t_params, tx, mesh=mesh, rules=TRAIN_RULES, seed=0)

    shardings = fresh()[1]
    spec = steps.StepSpec(
        kind="stage2", block_size=K, gamma=2.0, feature_layers=(0, 1), loss_chunk=loss_chunk,
        attention=attention, attention_chunk=attention_chunk,
    )  # fmt: skip
    bsh = steps.batch_shardings(mesh, TRAIN_RULES, B)
    fn = steps.jit_step(
        steps.make_step(spec, d_graph, t_graph, tx, schedules),
        state_shardings=shardings,
        batch_shardings_=bsh,
    )
    return fn, fresh, bsh


def _build(attention, loss_chunk, attention_chunk):
    """(jitted stage-2 step, its fresh state, batch shardings)."""
    fn, fresh, bsh = _compiled(attention, loss_chunk, attention_chunk)
    return fn, fresh()[0], bsh


KNOBS = {"alpha": 0.6, "tau": 0.05, "temperature": 1.3}


def _run(attention, loss_chunk, attention_chunk):
    fn, state, bsh = _build(attention, loss_chunk, attention_chunk)
    state, metrics = fn(state, steps.put_batch(_batch(), bsh, KNOBS))
    return jax.device_get(metrics), jax.device_get(state.params)


def test_sparse_attention_and_chunked_losses_equal_the_plain_step():
    m0, p0 = _run("dense", 0, 512)
    m1, p1 = _run("sparse", 2, 7)  # chunks that divide neither N = 5 nor S = 40
    assert m0["clip_ratio"] > 0  # the clip acts in this batch
    for name in ("loss", "drafter_loss", "ce", "kl_clipped", "kl_mean", "head_mse", "accept_bce"):
        np.testing.assert_allclose(m1[name], m0[name], rtol=1e-5, err_msg=name)
    for name in ("ce_acc", "accepted_mean", "clip_ratio"):
        assert m1[name] == pytest.approx(m0[name]), name
    np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=1e-5)
    # Adam's first step is lr·g/(|g| + ε): float noise in a near-zero gradient moves a weight
    # by up to ~1e-3 of lr (1e-2), hence the absolute tolerance.
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def _same(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_a_nonfinite_step_leaves_the_weights_and_is_counted():
    """A batch whose loss is NaN (a NaN distillation temperature): the parameters and the
    optimizer's moments stay bit-identical and the step is counted; the next finite step
    trains as usual."""
    fn, state, bsh = _build("sparse", 2, 7)
    before = jax.device_get((state.params, state.opt_state.inner_state))
    nan_knobs = {**KNOBS, "temperature": float("nan")}
    state, m = fn(state, steps.put_batch(_batch(), bsh, nan_knobs))
    assert np.isnan(m["loss"]) and int(m["skipped"]) == 1
    assert _same(before, jax.device_get((state.params, state.opt_state.inner_state)))
    assert tuple(map(int, skip_counts(state.opt_state))) == (1, 1)
    state, m = fn(state, steps.put_batch(_batch(), bsh, KNOBS))
    assert int(m["skipped"]) == 0 and not _same(before[0], jax.device_get(state.params))
    assert tuple(map(int, skip_counts(state.opt_state))) == (0, 1)  # in a row, in all


def _by_group(params) -> dict[str, list]:
    labels = path_labels(steps.param_group)(params)
    out = {}
    for label, x in zip(jax.tree.leaves(labels), jax.tree.leaves(params), strict=True):
        out.setdefault(label, []).append(np.asarray(x))
    return out


def test_a_batch_the_head_must_not_learn_from_moves_the_drafter_only():
    """`head_on` 0 (stage2.head_fit "fresh" after a round's first pass): the length head and
    its acceptance network keep their weights bit-exactly, though Adam carries momentum from
    the step before; the drafter trains and the head's loss is still measured. With
    `head_on` 1 the same step moves the head."""
    results = {}
    for head_on in (0.0, 1.0):
        fn, state, bsh = _build("sparse", 2, 7)
        s1, _ = fn(state, steps.put_batch(_batch(), bsh, KNOBS))  # momentum in every group
        before = _by_group(jax.device_get(s1.params))
        s2, m = fn(s1, steps.put_batch(_batch(), bsh, {**KNOBS, "head_on": head_on}))
        results[head_on] = (_by_group(jax.device_get(s2.params)), jax.device_get(m))
    off, on = results[0.0][0], results[1.0][0]
    for group in ("head", "accept"):
        assert all(np.array_equal(a, b) for a, b in zip(off[group], before[group])), group
        assert not all(np.array_equal(a, b) for a, b in zip(on[group], before[group])), group
    assert not all(np.array_equal(a, b) for a, b in zip(off["drafter"], before["drafter"]))
    assert results[0.0][1]["head_mse"] == pytest.approx(results[1.0][1]["head_mse"])


def test_a_nonfinite_gradient_is_a_zero_update():
    """A finite loss with one NaN gradient entry: no parameter moves, the moments stay."""
    tx = skip_nonfinite(optax.adamw(1e-2))
    params = {"w": jnp.ones((3,)), "b": jnp.zeros((2,))}
    opt_state = tx.update({"w": jnp.ones((3,)), "b": jnp.ones((2,))}, tx.init(params), params)[1]
    grads = {"w": jnp.asarray([1.0, jnp.nan, 1.0]), "b": jnp.ones((2,))}
    updates, new_state = tx.update(grads, opt_state, params)
    assert _same(optax.apply_updates(params, updates), params)
    assert _same(new_state.inner_state, opt_state.inner_state)
    assert int(new_state.total_notfinite) == 1


def test_a_run_of_nonfinite_steps_stops_the_stage(tmp_path):
    """Every step non-finite, limit 3, logging every 2 steps: the stage stops at the first
    log point past the limit with one line naming it, the step and the last checkpoint."""
    tx = skip_nonfinite(optax.sgd(0.1))
    params = {"w": jnp.ones((2,))}
    state = TrainState(
        step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jnp.zeros(2, jnp.uint32)
    )

    def step_fn(state, batch):
        grads = {"w": jnp.full((2,), jnp.nan)}
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new, {"loss": jnp.float32(jnp.nan), **nonfinite_metrics(opt_state)}

    run = StageRun(
        name="stage1", step_fn=jax.jit(step_fn), put=lambda b: b, batches=iter(range(100)),
        total_steps=50, tokens_per_step=1, log_every=2, progress=False, max_skips=3,
    )  # fmt: skip
    with pytest.raises(NonFiniteError, match=r"stage1: 4 train steps in a row up to step 4"):
        run_stage(run, state, ckpt=None, guard=None)


def test_head_phases_split_a_round_at_its_first_pass():
    """ "fresh": round r's head learns for floor(buffer / batch) steps, then stops until the
    next round; "all" (the reference) learns every step."""
    from adaflash_jax.distill.config import RunConfig, Stage2Spec
    from adaflash_jax.distill.stages import head_phases

    s2 = Stage2Spec(steps_per_round=25, head_fit="fresh")
    cfg = RunConfig(batch_size=8, stage2=s2)
    assert head_phases(cfg, 0, 100) == [(12, 1.0), (25, 0.0)]
    assert head_phases(cfg, 2, 100) == [(62, 1.0), (75, 0.0)]
    assert head_phases(cfg, 0, 5) == [(1, 1.0), (25, 0.0)]  # under one batch: one step
    assert head_phases(cfg, 0, 10_000) == [(25, 1.0), (25, 0.0)]  # never a second pass
    reference = RunConfig(batch_size=8, stage2=Stage2Spec(steps_per_round=25))
    assert head_phases(reference, 1, 100) == [(50, 1.0)]
