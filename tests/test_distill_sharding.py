"""On 8 fake CPU devices the sharded train steps equal the single-device step."""

import jax
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.distill import steps
from adaflash_jax.distill.state import fresh_drafter, new_train_state, tree_shardings
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rows import RowLayout
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.mesh import make_mesh
from adaflash_jax.train.optimizer import OptimizerConfig

TARGET = target_preset("test")
B, S, N, K = 8, 32, 4, 4


def _batch():
    rng = np.random.default_rng(0)
    loss_mask = np.zeros((B, S), bool)
    for b in range(B):
        loss_mask[b, 6 + b : S - b] = True
    anchors = np.stack([np.sort(rng.choice(np.arange(8, 24), N, replace=False)) for _ in range(B)])
    valid = np.ones((B, N), bool)
    valid[0, -1] = False
    return {
        "tokens": rng.integers(0, 120, (B, S)).astype(np.int32),
        "loss_mask": loss_mask,
        "anchors": anchors.astype(np.int32),
        "valid": valid,
    }


@pytest.fixture(scope="module")
def setup():
    target = TargetLM(TARGET, rngs=nnx.Rngs(0))
    t_graph, t_params = nnx.split(target, nnx.Param)
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=127, num_layers=1, block_size=K, target_layer_ids=(0, 1)
    )
    one = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    d_graph, d_params = fresh_drafter(cfg, mesh=one, rules=TRAIN_RULES, seed=1)
    host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    return cfg, t_graph, host(t_params), d_graph, host(d_params)


def _run(setup, mesh_shape, kind, n_steps=2):
    cfg, t_graph, t_params, d_graph, d_params = setup
    devices = jax.devices()[:1] if mesh_shape == (1, 1, 1) else jax.devices()
    mesh = make_mesh(*mesh_shape, devices=devices)
    put = lambda tree: jax.device_put(tree, tree_shardings(tree, mesh, TRAIN_RULES))  # noqa: E731
    frozen, params = put(t_params), put(d_params)
    opt = OptimizerConfig(lr=1e-2, schedule="constant")
    groups = {
        "stage1": {"drafter": opt, "head": None},
        "head_init": {"drafter": None, "head": opt},
        "stage2": {"drafter": opt, "head": opt},
    }[kind]
    tx, schedules = steps.make_optimizer(groups, clip_norm=1.0)
    state, shardings = new_train_state(params, frozen, tx, mesh=mesh, rules=TRAIN_RULES, seed=0)
    rows = RowLayout.of(mesh, TRAIN_RULES, B)  # activations' rows split as the trainer's
    spec = steps.StepSpec(kind=kind, block_size=K, gamma=2.0, feature_layers=(0, 1), rows=rows)
    bsh = steps.batch_shardings(mesh, TRAIN_RULES, B)
    fn = steps.jit_step(
        steps.make_step(spec, d_graph, t_graph, tx, schedules),
        state_shardings=shardings,
        batch_shardings_=bsh,
    )
    metrics = []
    for _ in range(n_steps):
        state, m = fn(state, steps.put_batch(_batch(), bsh, {"alpha": 0.5, "tau": 0.05}))
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference(setup):
    return _run(setup, (1, 1, 1), "stage2")


@pytest.mark.parametrize(
    "mesh_shape", [(8, 1, 1), (1, 8, 1), (2, 1, 4)], ids=["data", "fsdp", "tensor"]
)
def test_sharded_step_equals_single_device(setup, reference, mesh_shape):
    """Stage-2 step (target forward, drafter, RKL+CE, head MSE, grouped AdamW), two steps."""
    want_m, want_p = reference
    got_m, got_p = _run(setup, mesh_shape, "stage2")
    for w, g in zip(want_m, got_m):
        for key in w:
            np.testing.assert_allclose(g[key], w[key], rtol=2e-4, atol=1e-6, err_msg=key)
    # lr 1e-2: a wrong update would differ by ~1e-2; reduction order noise stays ~1e-5.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4), got_p, want_p)


def test_head_init_moves_only_the_head(setup):
    _, _, _, _, d_params = setup
    metrics, params = _run(setup, (1, 1, 1), "head_init", n_steps=1)
    assert metrics[0]["head_mse"] > 0
    before = dict(jax.tree_util.tree_flatten_with_path(d_params)[0])
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        is_head = "length_head" in jax.tree_util.keystr(path)
        assert bool(np.any(value != before[path])) == is_head, jax.tree_util.keystr(path)
