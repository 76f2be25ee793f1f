"""The length head's per-position acceptance output: interface, learning, training steps,
export as an optional part (and what loaders that do not know it see)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from adaflash_jax.distill import losses, steps
from adaflash_jax.distill.state import fresh_drafter, load_drafter_sharded, new_train_state
from adaflash_jax.drafter.checkpoint import ACCEPT_PREFIX, load_drafter, save_drafter
from adaflash_jax.drafter.config import DEFAULT_ACCEPT_DIM, DrafterConfig, LengthHeadConfig
from adaflash_jax.drafter.hf_config import ACCEPT_FILE, ACCEPT_KEY
from adaflash_jax.drafter.length_head import LengthHead, confidence_features
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.io.safetensors_io import SafetensorsFile, save_file
from adaflash_jax.model.checkpoint import CheckpointError
from adaflash_jax.model.config import ConfigError
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.sharding.rules import TRAIN_RULES
from adaflash_jax.train.mesh import make_mesh
from adaflash_jax.train.optimizer import OptimizerConfig, skip_nonfinite

TARGET = target_preset("test", vocab_size=64, intermediate_size=48)
K, A = 4, 16


def _drafter(accept_dim=A, head=True, seed=0):
    cfg = DrafterConfig.for_target(
        TARGET,
        mask_token_id=63,
        num_layers=1,
        block_size=K,
        target_layer_ids=(0, 1),
        length_head=head,
        accept_dim=accept_dim,
    )
    return Drafter(cfg, rngs=nnx.Rngs(seed))


def _inputs(k=K, seed=1, b=3):
    h = jax.random.normal(jax.random.key(seed), (b, k, TARGET.hidden_size))
    logits = 3.0 * jax.random.normal(jax.random.key(seed + 1), (b, k - 1, TARGET.vocab_size))
    return h, logits


def _randomise_accept(drafter, seed=5):
    """Non-trivial acceptance weights (the init has zero biases)."""
    net = drafter.length_head.accept
    for i, var in enumerate((net.proj_in.bias, net.proj_out.bias, net.position_bias)):
        shape = var[...].shape
        var.set_value(jax.random.normal(jax.random.key(seed + i), shape))
    return drafter


# ---- interface -------------------------------------------------------------------------------
def test_interface_shapes_and_features():
    d = _randomise_accept(_drafter())
    head = d.length_head
    assert head.has_accept_output and not _drafter(accept_dim=0).length_head.has_accept_output
    h, logits = _inputs()
    a = head.accept_probs(h, logits)
    assert a.shape == (3, K - 1) and a.dtype == jnp.float32
    assert np.all((np.asarray(a) > 0) & (np.asarray(a) < 1))
    np.testing.assert_allclose(
        a, jax.nn.sigmoid(head.accept_logits(h, logits)), rtol=1e-6, atol=1e-6
    )
    # the features, against a direct computation
    lp = jax.nn.log_softmax(logits, axis=-1)
    max_lp, ent = confidence_features(logits)
    np.testing.assert_allclose(max_lp, lp.max(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, -(jnp.exp(lp) * lp).sum(-1), rtol=1e-5, atol=1e-5)
    # r is unchanged by the extra network: same seed, same reference weights, same output
    plain = _drafter(accept_dim=0)
    np.testing.assert_array_equal(plain.length_head(h), head(h))
    with pytest.raises(ValueError, match="accept_dim = 0"):
        plain.length_head.accept_probs(h, logits)
    with pytest.raises(ValueError, match="K−1"):
        head.accept_probs(h, logits[:, :2])
    with pytest.raises(ConfigError, match="accept_dim"):
        LengthHeadConfig(accept_dim=-1)
    with pytest.raises(ConfigError, match="length_head"):
        DrafterConfig.for_target(TARGET, mask_token_id=63, length_head=False, accept_dim=8)


def test_other_block_sizes_slice_or_reuse_the_last_position_bias():
    head = _randomise_accept(_drafter()).length_head
    h, logits = _inputs(k=K)
    a = np.asarray(head.accept_probs(h, logits))
    short = head.accept_probs(h[:, :3], logits[:, :2])  # K' = 3 < K
    np.testing.assert_allclose(short, a[:, :2], rtol=1e-6)
    # K' = 7: positions past the trained K−1 = 3 reuse position 3's bias, so repeating
    # position 3's inputs repeats its probability
    h7 = jnp.concatenate([h, jnp.repeat(h[:, -1:], 3, axis=1)], axis=1)
    l7 = jnp.concatenate([logits, jnp.repeat(logits[:, -1:], 3, axis=1)], axis=1)
    long = np.asarray(head.accept_probs(h7, l7))
    assert long.shape == (3, 6)
    np.testing.assert_allclose(long[:, :3], a, rtol=1e-6)
    np.testing.assert_allclose(long[:, 3:], np.repeat(a[:, -1:], 3, axis=1), rtol=1e-6)


def test_accept_loss_never_reaches_the_drafter():
    """The drafter's own forward inside the differentiated function: the head detaches."""
    d = _drafter()
    graphdef, params = nnx.split(d, nnx.Param)
    emb = jax.random.normal(jax.random.key(1), (64, 32))
    feats = jax.random.normal(jax.random.key(2), (2, 5, 64))
    match = jnp.array([[True, False, True], [True, True, False]])[:, None]

    def loss(p):
        m = nnx.merge(graphdef, p)
        cache = m.append_context(m.init_context_cache(2, 8), feats)
        out = m.draft(cache, jnp.array([1, 2]), emb, emb.T)
        z = m.length_head.accept_logits(out.hidden_BxKxD, out.logits_BxKm1xV)
        return losses.accept_head_loss(z[:, None], match, jnp.ones_like(match))[0]

    grads = jax.tree_util.tree_flatten_with_path(jax.jit(jax.grad(loss))(params))[0]
    for path, g in grads:
        name = jax.tree_util.keystr(path)
        moved = bool(np.any(np.asarray(g) != 0))
        assert moved == ("accept" in name), name


# ---- learning --------------------------------------------------------------------------------
STEPS, BATCH = 300, 512  # measured: worst bin gap 0.026 (an untrained head: up to 0.48)


def test_learns_calibrated_acceptance():
    """Match probability depends on the drafter's confidence and the position; a few hundred
    Adam steps on the conditional BCE give calibrated a_i per (position, confidence) bin."""
    d, kk, v = 8, 5, 16
    head = LengthHead(d, LengthHeadConfig(accept_dim=16), block_size=kk, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(head, nnx.Param)
    offset = jnp.array([1.0, 0.0, -0.5, -1.0])

    def sample(key, n):
        k1, k2, k3 = jax.random.split(key, 3)
        s_NxP = jax.random.uniform(k1, (n, kk - 1), maxval=6.0)
        logits = jnp.zeros((n, kk - 1, v)).at[..., 0].set(s_NxP)
        p_NxP = jax.nn.sigmoid(1.5 * (s_NxP - 3.0) + offset)
        match = jax.random.uniform(k2, (n, kk - 1)) < p_NxP
        hidden = jax.random.normal(k3, (n, kk, d))
        return hidden, logits, match, s_NxP

    valid = jnp.ones((1, kk - 1), bool)
    tx = optax.adam(optax.cosine_decay_schedule(3e-2, STEPS, alpha=0.02))

    @jax.jit
    def train(params, key):
        def one(carry, key):
            params, opt = carry
            h, lg, m, _ = sample(key, BATCH)

            def loss(p):
                z = nnx.merge(graphdef, p).accept_logits(h, lg)
                return losses.accept_head_loss(z[:, None], m[:, None], valid[None])[0]

            g = jax.grad(loss)(params)
            upd, opt = tx.update(g, opt, params)
            return (optax.apply_updates(params, upd), opt), None

        (params, _), _ = jax.lax.scan(one, (params, tx.init(params)), jax.random.split(key, STEPS))
        return params

    params = train(params, jax.random.key(0))
    h, lg, m, s = sample(jax.random.key(99), 40000)
    a = np.asarray(nnx.merge(graphdef, params).accept_probs(h, lg))
    counted = np.asarray(losses.conditional_mask(m, jnp.ones_like(m)))
    m, s = np.asarray(m), np.asarray(s)
    for i in range(kk - 1):
        for lo, hi in ((0, 2), (2, 4), (4, 6)):
            sel = counted[:, i] & (s[:, i] >= lo) & (s[:, i] < hi)
            assert sel.sum() > 500, (i, lo)
            gap = abs(a[sel, i].mean() - m[sel, i].mean())
            assert gap < 0.05, (i, lo, a[sel, i].mean(), m[sel, i].mean())


# ---- export ----------------------------------------------------------------------------------
def test_round_trip_and_what_plain_loaders_see(tmp_path):
    d = _randomise_accept(_drafter())
    save_drafter(d, tmp_path / "x")  # bf16 main file; the acceptance part stays float32
    h, logits = _inputs()
    loaded = load_drafter(tmp_path / "x")
    assert loaded.config == d.config
    np.testing.assert_array_equal(
        loaded.length_head.accept_probs(h, logits), d.length_head.accept_probs(h, logits)
    )
    main = SafetensorsFile(tmp_path / "x" / "model.safetensors")
    assert not any(k.startswith(ACCEPT_PREFIX) or "accept" in k for k in main.keys())
    assert not list((tmp_path / "x").glob("*.safetensors"))[1:]  # one top-level file
    part = SafetensorsFile(tmp_path / "x" / ACCEPT_FILE)
    assert {k: part.shape(k) for k in part.keys()} == {
        "accept_head.in.weight": (A, 32 + 2),
        "accept_head.in.bias": (A,),
        "accept_head.out.weight": (1, A),
        "accept_head.out.bias": (1,),
        "accept_head.position_bias": (K - 1,),
    }
    assert all(str(part.dtype(k)) == "float32" for k in part.keys())
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["dflash_config"][ACCEPT_KEY] == {
        "file": ACCEPT_FILE,
        "accept_dim": A,
        "positions": K - 1,
        "features": ["hidden", "max_logprob", "entropy"],
    }
    # a loader that knows only model.safetensors: no part, no config key → DFlash + r
    shutil.copytree(tmp_path / "x", tmp_path / "plain")
    shutil.rmtree(tmp_path / "plain" / "adaflash_extra")
    del cfg["dflash_config"][ACCEPT_KEY]
    (tmp_path / "plain" / "config.json").write_text(json.dumps(cfg))
    plain = load_drafter(tmp_path / "plain")
    assert plain.length_head is not None and not plain.length_head.has_accept_output
    np.testing.assert_array_equal(plain.length_head(h), loaded.length_head(h))
    np.testing.assert_array_equal(plain.fc.kernel[...], loaded.fc.kernel[...])
    # asked-for parts only: no head, or a head without the acceptance network
    assert load_drafter(tmp_path / "x", with_length_head=False).length_head is None
    assert not load_drafter(tmp_path / "x", accept_dim=0).length_head.has_accept_output
    # a fresh acceptance network only when asked
    fresh = load_drafter(tmp_path / "plain", accept_dim=8)
    assert fresh.length_head.accept.proj_in.kernel[...].shape == (34, 8)


def test_bad_acceptance_parts(tmp_path):
    save_drafter(_drafter(), tmp_path / "ok", dtype=None)
    part = SafetensorsFile(tmp_path / "ok" / ACCEPT_FILE)
    tensors = {k: np.asarray(part.get(k)) for k in part.keys()}

    def variant(name, mutate_tensors=None, drop_file=False):
        shutil.copytree(tmp_path / "ok", tmp_path / name)
        if drop_file:
            os.remove(tmp_path / name / ACCEPT_FILE)
        if mutate_tensors is not None:
            bad = dict(tensors)
            mutate_tensors(bad)
            save_file(bad, tmp_path / name / ACCEPT_FILE)
        return tmp_path / name

    # a named but missing part is optional: one warning, and a drafter without it
    with pytest.warns(UserWarning, match="accept_head.safetensors.*missing") as caught:
        gone = load_drafter(variant("gone", drop_file=True))
    assert len(caught) == 1 and not gone.length_head.has_accept_output
    # ... and a loader asked for no acceptance output does not need the file
    assert load_drafter(tmp_path / "gone", accept_dim=0).length_head is not None
    shape = lambda t: t.update({"accept_head.position_bias": np.zeros(7, np.float32)})  # noqa: E731
    with pytest.raises(CheckpointError, match="accept_head.position_bias.*shape"):
        load_drafter(variant("shape", shape))
    with pytest.raises(CheckpointError, match="missing tensors.*accept_head.out.bias"):
        load_drafter(variant("missing", lambda t: t.pop("accept_head.out.bias")))
    extra = lambda t: t.update({"accept_head.bogus": np.zeros(2, np.float32)})  # noqa: E731
    with pytest.raises(CheckpointError, match="unexpected"):
        load_drafter(variant("extra", extra))
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    cfg["dflash_config"][ACCEPT_KEY]["positions"] = 7
    (variant("positions") / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="positions"):
        load_drafter(tmp_path / "positions")


def test_export_refuses_nan_and_drops_a_stale_part(tmp_path):
    d = _drafter()
    d.length_head.accept.position_bias.set_value(jnp.array([0.0, jnp.inf, 0.0]))
    with pytest.raises(ValueError, match="accept_head.position_bias"):
        save_drafter(d, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()
    save_drafter(_drafter(), tmp_path / "re")
    save_drafter(_drafter(accept_dim=0), tmp_path / "re")  # same directory, no part now
    assert not (tmp_path / "re" / ACCEPT_FILE).exists()
    assert not load_drafter(tmp_path / "re").length_head.has_accept_output


def test_remote_export_writes_the_part_and_marks_completion_last(tmp_path, monkeypatch):
    """The gs:// path, on fsspec's in-memory filesystem: every file goes straight to the
    remote directory, config.json (the completion marker) last."""
    import fsspec

    from adaflash_jax.io import fs

    order = []
    real = fs.write_bytes
    monkeypatch.setattr(fs, "write_bytes", lambda p, data: (order.append(p), real(p, data)))
    dest = "memory://exports/accept"
    save_drafter(_drafter(), dest)
    assert order[-1] == f"{dest}/config.json" and f"{dest}/{ACCEPT_FILE}" in order
    fsspec.filesystem("memory").get("/exports/accept", str(tmp_path / "copy"), recursive=True)
    save_drafter(_drafter(), tmp_path / "local")
    a, b = load_drafter(tmp_path / "local"), load_drafter(tmp_path / "copy")
    np.testing.assert_array_equal(
        a.length_head.accept.proj_in.kernel, b.length_head.accept.proj_in.kernel
    )


def test_sharded_loader_reads_the_part(tmp_path):
    d = _randomise_accept(_drafter())
    save_drafter(d, tmp_path / "x", dtype=None)
    mesh = make_mesh(2, 1, 4)
    cfg, graphdef, params = load_drafter_sharded(
        tmp_path / "x", mesh=mesh, rules=TRAIN_RULES, seed=3
    )
    assert cfg == d.config
    got = nnx.merge(graphdef, params)
    h, logits = _inputs()
    np.testing.assert_allclose(
        got.length_head.accept_probs(h, logits), d.length_head.accept_probs(h, logits), rtol=1e-6
    )
    want = dict(jax.tree_util.tree_flatten_with_path(nnx.state(d, nnx.Param))[0])
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want[path]))
    # a plain DFlash export: fresh head and a fresh DEFAULT_ACCEPT_DIM network for training
    save_drafter(_drafter(head=False, accept_dim=0), tmp_path / "dflash", dtype=None)
    cfg, _, _ = load_drafter_sharded(tmp_path / "dflash", mesh=mesh, rules=TRAIN_RULES, seed=0)
    assert cfg.length_head.accept_dim == DEFAULT_ACCEPT_DIM


def test_planner_counts_the_acceptance_network():
    from adaflash_jax.plan.params import DrafterShape, drafter_params

    d = _drafter()
    shape = DrafterShape.like_target(
        TARGET, num_layers=1, num_features=2, accept_dim=A, block_size=K
    )
    got = sorted((s.shape, s.logical_axes) for s in drafter_params(shape))
    leaves = jax.tree.leaves(nnx.state(d, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
    want = sorted(
        (tuple(v.get_value().shape), tuple(v.get_metadata()["logical_axes"])) for v in leaves
    )
    assert got == want


# ---- distillation steps ----------------------------------------------------------------------
B, S, N = 4, 24, 3


def _batch():
    rng = np.random.default_rng(0)
    loss_mask = np.zeros((B, S), bool)
    loss_mask[:, 6:] = True
    anchors = np.stack([np.sort(rng.choice(np.arange(6, 18), N, replace=False)) for _ in range(B)])
    return {
        "tokens": rng.integers(0, 60, (B, S)).astype(np.int32),
        "loss_mask": loss_mask,
        "anchors": anchors.astype(np.int32),
        "valid": np.ones((B, N), bool),
    }


@pytest.fixture(scope="module")
def step_setup():
    target = TargetLM(TARGET, rngs=nnx.Rngs(0))
    # A sharper LM head (teacher and student share it): the drafter's gradient norm then
    # exceeds the reference clip of 1.0, so the clip is active in the tests below.
    target.lm_head.kernel[...] = 5.0 * target.lm_head.kernel[...]
    return nnx.split(target, nnx.Param), make_mesh(1, 1, 1, devices=jax.devices()[:1])


CLIP = 1.0  # the reference's clip


# XLA:CPU's default fusion emitters (conftest turns them off for compile speed): the bitwise
# comparison below holds for the programs they emit, not for the older emitter's.
DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


def _step(step_setup, kind, accept_dim, compiler_options=None):
    (t_graph, t_params), mesh = step_setup
    cfg = _drafter(accept_dim=accept_dim).config
    d_graph, params = fresh_drafter(cfg, mesh=mesh, rules=TRAIN_RULES, seed=1)
    before = jax.device_get(params)
    opt = OptimizerConfig(lr=1e-2, schedule="constant")
    drafter = None if kind == "head_init" else opt
    tx, schedules = steps.make_optimizer(
        {"drafter": drafter, "head": opt, "accept": opt}, clip_norm=CLIP
    )
    state, shardings = new_train_state(params, t_params, tx, mesh=mesh, rules=TRAIN_RULES, seed=0)
    spec = steps.StepSpec(kind=kind, block_size=K, gamma=2.0, feature_layers=(0, 1))
    bsh = steps.batch_shardings(mesh, TRAIN_RULES, B)
    fn = steps.jit_step(
        steps.make_step(spec, d_graph, t_graph, tx, schedules),
        state_shardings=shardings,
        batch_shardings_=bsh,
    )
    batch = steps.put_batch(_batch(), bsh)
    state, metrics = fn.lower(state, batch).compile(compiler_options)(state, batch)
    flat = lambda t: dict(jax.tree_util.tree_flatten_with_path(t)[0])  # noqa: E731
    return jax.device_get(metrics), flat(before), flat(jax.device_get(state.params))


def test_head_init_trains_the_acceptance_output(step_setup):
    metrics, before, after = _step(step_setup, "head_init", A)
    assert np.isfinite(metrics["accept_bce"]) and metrics["accept_bce"] > 0
    assert 0 <= metrics["accept_mae"] <= 1 and 0 <= metrics["accept_rate"] <= 1
    np.testing.assert_allclose(metrics["loss"], metrics["head_mse"] + metrics["accept_bce"])
    for path, value in after.items():
        name = jax.tree_util.keystr(path)
        assert bool(np.any(value != before[path])) == ("length_head" in name), name


def test_stage2_accept_loss_leaves_the_drafter_update_unchanged(step_setup):
    """With the reference's clip 1.0 ACTIVE (the drafter's gradient norm exceeds it), the
    acceptance network (its own clip part) leaves the drafter and r-head update bitwise the
    same as a drafter without it."""
    m_acc, before, with_accept = _step(step_setup, "stage2", A, DEFAULT_EMITTERS)
    m_ref, _, without = _step(step_setup, "stage2", 0, DEFAULT_EMITTERS)
    assert m_ref["grad_norm"] > CLIP  # the clip really scales the drafter's step
    np.testing.assert_allclose(m_acc["grad_norm"], m_ref["grad_norm"], rtol=1e-6)
    assert m_acc["accept_grad_norm"] > 0 and m_ref["accept_grad_norm"] == 0
    assert np.isfinite(m_acc["accept_bce"]) and "accept_bce" not in m_ref
    np.testing.assert_allclose(m_acc["drafter_loss"], m_ref["drafter_loss"], rtol=1e-6)
    for path, value in without.items():  # drafter and r head: bitwise the same update
        np.testing.assert_array_equal(value, with_accept[path], err_msg=jax.tree_util.keystr(path))
    moved = [p for p in with_accept if p not in without]
    assert moved and all(np.any(with_accept[p] != before[p]) for p in moved)


def test_one_shared_clip_would_couple_them(step_setup):
    """The control: under ONE clip over everything (what the split prevents), adding the
    acceptance network's gradients to the norm changes the drafter's clipped update."""
    (t_graph, t_params), mesh = step_setup
    grads = {}
    for a in (A, 0):
        cfg = _drafter(accept_dim=a).config
        d_graph, params = fresh_drafter(cfg, mesh=mesh, rules=TRAIN_RULES, seed=1)
        tx = skip_nonfinite(_GradsOut())  # every step optimizer skips non-finite steps
        state, _ = new_train_state(params, t_params, tx, mesh=mesh, rules=TRAIN_RULES, seed=0)
        spec = steps.StepSpec(kind="stage2", block_size=K, gamma=2.0, feature_layers=(0, 1))
        capture = steps.make_step(spec, d_graph, t_graph, tx, None)
        bsh = steps.batch_shardings(mesh, TRAIN_RULES, B)
        new, _ = jax.jit(capture)(state, steps.put_batch(_batch(), bsh))
        grads[a] = new.params  # the raw gradients (see _GradsOut)
    shared = optax.clip_by_global_norm(CLIP)
    # jitted: eagerly, the clip over every leaf compiles each op per leaf shape on its own
    clipped_fc = jax.jit(lambda g: shared.update(g, shared.init(g))[0]["fc"]["kernel"][...])
    fc = lambda g: np.asarray(clipped_fc(g))  # noqa: E731
    assert not np.array_equal(fc(grads[A]), fc(grads[0]))


class _GradsOut(optax.GradientTransformation):
    """A 'transform' whose update is params ← grads (apply_updates adds grads − params)."""

    def __new__(cls):
        def update(grads, state, params):
            return jax.tree.map(lambda g, p: g - p, grads, params), state

        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)
