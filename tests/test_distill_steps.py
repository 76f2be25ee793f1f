"""The stage-2 train step's memory-saving paths against the plain ones: the block-sparse
training attention and the chunked losses give the same loss, metrics and update as the
dense attention with all logits at once."""

import jax
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.distill import steps
from adaflash_jax.distill.state import fresh_drafter, new_train_state
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.mesh import make_mesh
from adaflash_jax.train.optimizer import OptimizerConfig

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


def _run(attention, loss_chunk, attention_chunk):
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
    state, shardings = new_train_state(params, t_params, tx, mesh=mesh, rules=TRAIN_RULES, seed=0)
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
    knobs = {"alpha": 0.6, "tau": 0.05, "temperature": 1.3}
    state, metrics = fn(state, steps.put_batch(_batch(), bsh, knobs))
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
