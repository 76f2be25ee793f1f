"""Distillation losses against a plain NumPy reference (clip semantics included)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.distill import losses

B, N, K, V = 2, 3, 5, 11
GAMMA = 2.5


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_reference(student, teacher, mask, *, alpha, tau, temperature, objective):
    """Loops over every position, written independently of the library."""
    w = np.array([np.exp(-(k - 1) / GAMMA) for k in range(1, K)])
    nw = sum(w[p] for b in range(B) for n in range(N) for p in range(K - 1) if mask[b, n, p])
    ce = kl_clip = 0.0
    clipped = valid = 0
    for b in range(B):
        for n in range(N):
            for p in range(K - 1):
                if not mask[b, n, p]:
                    continue
                valid += 1
                ls = _np_log_softmax(student[b, n, p].astype(np.float64) / temperature)
                lt = _np_log_softmax(teacher[b, n, p].astype(np.float64) / temperature)
                label = int(np.argmax(teacher[b, n, p]))
                ce += w[p] * -_np_log_softmax(student[b, n, p].astype(np.float64))[label]
                if objective == "rkl":
                    kl = np.sum(np.exp(ls) * (ls - lt))
                else:
                    kl = np.sum(np.exp(lt) * (lt - ls))
                r = temperature**2 * kl / nw
                clipped += r > tau
                kl_clip += w[p] * min(r, tau)
    ce /= nw
    if objective == "sft":
        return ce, clipped / valid
    return alpha * ce + (1 - alpha) * kl_clip, clipped / valid


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    student = (rng.standard_normal((B, N, K - 1, V)) * 2.0).astype(np.float32)
    teacher = (rng.standard_normal((B, N, K - 1, V)) * 2.0).astype(np.float32)
    mask = rng.random((B, N, K - 1)) < 0.7
    mask[0, 0] = True
    return student, teacher, mask


@pytest.mark.parametrize("objective", ["rkl", "fkl", "sft"])
@pytest.mark.parametrize("tau,temperature", [(10.0, 1.0), (0.01, 1.0), (0.02, 2.0)])
def test_distill_loss_matches_numpy(inputs, objective, tau, temperature):
    student, teacher, mask = inputs
    weights = losses.position_weights(jnp.asarray(mask), GAMMA)
    loss, parts = losses.distill_loss(
        jnp.asarray(student),
        jnp.asarray(teacher),
        weights,
        objective=objective,
        alpha=0.3,
        tau=tau,
        temperature=temperature,
    )
    want, want_ratio = _np_reference(
        student, teacher, mask, alpha=0.3, tau=tau, temperature=temperature, objective=objective
    )
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    if objective != "sft":
        np.testing.assert_allclose(float(parts["clip_ratio"]), want_ratio)


def test_clip_is_applied_after_division_by_nw(inputs):
    """τ between max(KL)/Nw and max(KL) leaves the loss untouched: it clips r = KL/Nw."""
    student, teacher, mask = inputs
    weights = losses.position_weights(jnp.asarray(mask), GAMMA)
    kl = np.asarray(losses.reverse_kl(jnp.asarray(student), jnp.asarray(teacher)))
    nw = float(jnp.sum(weights))
    tau = 1.01 * kl[mask].max() / nw
    assert tau < kl[mask].min()  # a clip before the division would cap every position
    loss, parts = losses.distill_loss(
        jnp.asarray(student), jnp.asarray(teacher), weights, alpha=0.0, tau=tau
    )
    np.testing.assert_allclose(float(loss), float(parts["kl_mean"]), rtol=1e-6)
    assert float(parts["clip_ratio"]) == 0.0
    loss_tight, parts = losses.distill_loss(
        jnp.asarray(student), jnp.asarray(teacher), weights, alpha=0.0, tau=tau / 3
    )
    assert float(loss_tight) < float(loss) and float(parts["clip_ratio"]) > 0


def test_decayed_ce_and_weights(inputs):
    student, teacher, mask = inputs
    labels = np.argmax(teacher, -1)
    w = np.exp(-np.arange(K - 1) / GAMMA)
    np.testing.assert_allclose(losses.decay_weights(K, GAMMA), w, rtol=1e-6)
    ls = _np_log_softmax(student.astype(np.float64))
    ce = -np.take_along_axis(ls, labels[..., None], -1)[..., 0]
    wm = w * mask
    want = (wm * ce).sum() / wm.sum()
    got = losses.decayed_ce(
        jnp.asarray(student), jnp.asarray(labels), losses.position_weights(jnp.asarray(mask), GAMMA)
    )
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    acc = losses.accuracy(jnp.asarray(student), jnp.asarray(labels), jnp.asarray(mask))
    np.testing.assert_allclose(
        float(acc), ((student.argmax(-1) == labels) & mask).sum() / mask.sum()
    )


def test_sft_equals_decayed_ce_on_teacher_argmax(inputs):
    student, teacher, mask = inputs
    weights = losses.position_weights(jnp.asarray(mask), GAMMA)
    sft, _ = losses.distill_loss(
        jnp.asarray(student), jnp.asarray(teacher), weights, objective="sft"
    )
    ce = losses.decayed_ce(jnp.asarray(student), jnp.argmax(jnp.asarray(teacher), -1), weights)
    np.testing.assert_allclose(float(sft), float(ce), rtol=1e-6)


def test_kl_gradient_reaches_student_only(inputs):
    student, teacher, mask = inputs
    weights = losses.position_weights(jnp.asarray(mask), GAMMA)

    def f(s, t):
        return losses.distill_loss(s, t, weights, alpha=0.5, tau=10.0)[0]

    gs, gt = jax.grad(f, argnums=(0, 1))(jnp.asarray(student), jnp.asarray(teacher))
    assert float(jnp.abs(gs).sum()) > 0 and float(jnp.abs(gt).sum()) == 0.0


def test_accepted_streak_and_head_loss():
    draft = jnp.array([[[1, 2, 3, 4], [1, 9, 3, 4], [7, 2, 3, 4]]])
    target = jnp.array([[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]])
    mask = jnp.array([[[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]], bool)
    a = losses.accepted_streak(draft, target, mask)
    assert a.tolist() == [[3, 1, 0]]  # the masked tail stops the streak
    r = jnp.array([[0.8, 0.4, 0.2]])
    valid = jnp.array([[True, True, False]])
    mse, mae = losses.length_head_loss(r, a, valid, block_size=5)
    y = np.array([4 / 5, 2 / 5])
    np.testing.assert_allclose(float(mse), np.mean((np.array([0.8, 0.4]) - y) ** 2), atol=1e-7)
    np.testing.assert_allclose(float(mae), np.mean(np.abs(np.array([0.8, 0.4]) - y)), atol=1e-7)


def test_accept_head_loss_hand_computed():
    """BCE only where every earlier position matched and the position is valid."""
    z = np.array([[[2.0, -1.0, 0.5], [0.0, 3.0, -2.0]]], np.float32)  # [B=1, N=2, P=3]
    match = np.array([[[True, False, True], [True, True, False]]])
    mask = np.array([[[True, True, True], [True, False, True]]])
    # block 0: positions 0, 1 count (2 stops after the mismatch at 1)
    # block 1: position 0 counts; 1 is invalid, so 2 has no unbroken matched prefix
    counted = [(2.0, 1.0), (-1.0, 0.0), (0.0, 1.0)]
    want = np.mean([np.log1p(np.exp(-v)) if m else np.log1p(np.exp(v)) for v, m in counted])
    bce, parts = losses.accept_head_loss(jnp.asarray(z), jnp.asarray(match), jnp.asarray(mask))
    np.testing.assert_allclose(float(bce), want, rtol=1e-6)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    np.testing.assert_allclose(
        float(parts["accept_mae"]), np.mean([abs(sig(v) - m) for v, m in counted]), rtol=1e-6
    )
    np.testing.assert_allclose(float(parts["accept_rate"]), 2 / 3, rtol=1e-6)
    gap = abs(np.mean([sig(v) for v, _ in counted]) - 2 / 3)
    np.testing.assert_allclose(float(parts["accept_gap"]), gap, rtol=1e-5)
    # positions that do not count cannot move the loss, whatever their logits
    z2 = z.copy()
    z2[0, 0, 2] = z2[0, 1, 1] = z2[0, 1, 2] = 50.0
    np.testing.assert_allclose(
        float(losses.accept_head_loss(jnp.asarray(z2), jnp.asarray(match), jnp.asarray(mask))[0]),
        want,
        rtol=1e-6,
    )
    # stable from logits: huge logits give finite loss and gradient
    big = jnp.asarray(np.array([[[80.0, -80.0, 80.0]]], np.float32))
    m1 = jnp.asarray(np.array([[[False, True, True]]]))
    all_valid = jnp.ones((1, 1, 3), bool)
    val, grad = jax.value_and_grad(lambda x: losses.accept_head_loss(x, m1, all_valid)[0])(big)
    np.testing.assert_allclose(float(val), 80.0, rtol=1e-5)  # only position 0 counts
    assert np.all(np.isfinite(np.asarray(grad)))


def test_conditional_mask_is_the_accepted_streak_plus_one():
    rng = np.random.default_rng(0)
    match = jnp.asarray(rng.random((4, 6, 7)) < 0.7)
    mask = jnp.asarray(rng.random((4, 6, 7)) < 0.9)
    counted = losses.conditional_mask(match, mask)
    streak = np.asarray(losses.accepted_streak(match, jnp.ones_like(match), mask))
    for b in range(4):
        for n in range(6):
            row = np.asarray(counted[b, n])
            want = np.zeros(7, bool)
            want[: streak[b, n] + 1] = True  # the matched prefix and the first miss
            np.testing.assert_array_equal(row, want & np.asarray(mask[b, n]))
