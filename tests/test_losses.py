"""Distillation losses against a plain NumPy reference: per-sequence normalisation, the clip
in nats, and the chunked per-position computation against the all-at-once one (values and
gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaflash_jax.distill import losses

B, N, K, V, D = 3, 4, 5, 11, 6
GAMMA = 2.5


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_reference(student, teacher, mask, *, alpha, tau, temperature, objective):
    """Loops over every position, written independently of the library: each sequence is
    normalised by ITS OWN Σw (the reference's one-sequence micro-batch), then sequences with
    a valid position are averaged."""
    w = np.array([np.exp(-(k - 1) / GAMMA) for k in range(1, K)])
    per_seq, clipped, valid = [], 0, 0
    for b in range(B):
        nw = sum(w[p] for n in range(N) for p in range(K - 1) if mask[b, n, p])
        if nw == 0:
            continue
        ce = kl_clip = 0.0
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
        per_seq.append(ce if objective == "sft" else alpha * ce + (1 - alpha) * kl_clip)
    return float(np.mean(per_seq)), clipped / valid


@pytest.fixture(scope="module")
def inputs():
    """Logits made from hidden states and a head, so the chunked path (which takes hidden
    states) and the reference (which takes logits) see the same numbers. Sequence 0 has one
    valid block, sequence 1 all, sequence 2 none: very different Nw."""
    rng = np.random.default_rng(0)
    s_hidden = rng.standard_normal((B, N, K - 1, D)).astype(np.float32)
    t_hidden = rng.standard_normal((B, N, K - 1, D)).astype(np.float32)
    head = (rng.standard_normal((D, V)) * 1.5).astype(np.float32)
    mask = rng.random((B, N, K - 1)) < 0.8
    mask[0, 1:] = False
    mask[0, 0] = True
    mask[1] = True
    mask[2] = False
    return s_hidden, t_hidden, head, mask


def _logits(h, head):
    return (h.astype(np.float64) @ head.astype(np.float64)).astype(np.float32)


def _stats(inputs, *, chunk, temperature=1.0, divergence="rkl"):
    s_hidden, t_hidden, head, _ = inputs
    labels = jnp.zeros(s_hidden.shape[:3], jnp.int32)
    return losses.position_stats(
        jnp.asarray(s_hidden), jnp.asarray(head), labels, jnp.asarray(t_hidden),
        temperature=temperature, divergence=divergence, chunk=chunk,
    )  # fmt: skip


@pytest.mark.parametrize("objective", ["rkl", "fkl", "sft"])
@pytest.mark.parametrize("tau,temperature", [(10.0, 1.0), (0.01, 1.0), (0.02, 2.0)])
def test_distill_loss_matches_numpy(inputs, objective, tau, temperature):
    s_hidden, t_hidden, head, mask = inputs
    stats = _stats(
        inputs, chunk=0, temperature=temperature, divergence=objective.replace("sft", "rkl")
    )
    weights = losses.position_weights(jnp.asarray(mask), GAMMA)
    loss, parts = losses.distill_loss(
        stats.ce, stats.kl, weights, objective=objective, alpha=0.3, tau=tau
    )
    want, want_ratio = _np_reference(
        _logits(s_hidden, head), _logits(t_hidden, head), mask,
        alpha=0.3, tau=tau, temperature=temperature, objective=objective,
    )  # fmt: skip
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    if objective != "sft":
        np.testing.assert_allclose(float(parts["clip_ratio"]), want_ratio)


def test_normalisation_is_per_sequence(inputs):
    """A short sequence weighs as much as a long one: the batch loss is the mean of each
    sequence's own weighted mean, not one pooled Σ w·ℓ / Σ w."""
    _, _, _, mask = inputs
    ce = jnp.asarray(np.random.default_rng(1).random(mask.shape).astype(np.float32))
    w = np.asarray(losses.position_weights(jnp.asarray(mask), GAMMA))
    seq0 = (w[0] * ce[0]).sum() / w[0].sum()
    seq1 = (w[1] * ce[1]).sum() / w[1].sum()
    got = float(losses.decayed_ce(ce, jnp.asarray(w)))
    np.testing.assert_allclose(got, (seq0 + seq1) / 2, rtol=1e-6)  # sequence 2 has no weight
    pooled = (w * np.asarray(ce)).sum() / w.sum()
    assert abs(got - pooled) > 1e-3


def test_clip_acts_at_the_stated_nats(inputs):
    """τ caps a position's KL at τ·Nw_b/T² nats, Nw_b its own sequence's weight: a KL just
    under the cap passes whole, one just over is cut to the cap; `kl_cap_nats` reports it."""
    _, _, _, mask = inputs
    w = np.asarray(losses.position_weights(jnp.asarray(mask), GAMMA))
    nw = w.sum(axis=(1, 2))
    tau = 0.01
    cap = tau * nw  # nats, per sequence (T = 1)
    kl = np.zeros(mask.shape, np.float32)
    kl[0, 0, 0] = 0.99 * cap[0]  # under sequence 0's cap
    kl[1, 0, 0] = 1.5 * cap[1]  # over sequence 1's cap
    loss, parts = losses.distill_loss(
        jnp.zeros(mask.shape), jnp.asarray(kl), jnp.asarray(w), alpha=0.0, tau=tau
    )
    seq0 = w[0, 0, 0] * 0.99 * cap[0] / nw[0]
    seq1 = w[1, 0, 0] * cap[1] / nw[1]
    np.testing.assert_allclose(float(loss), (seq0 + seq1) / 2, rtol=1e-5)
    np.testing.assert_allclose(float(parts["kl_cap_nats"]), cap[:2].mean(), rtol=1e-6)
    assert float(parts["clip_ratio"]) == pytest.approx(1 / mask.sum())


@pytest.mark.parametrize("chunk", [1, 3, 4])
@pytest.mark.parametrize("divergence", ["rkl", "fkl"])
def test_chunked_stats_equal_all_at_once(inputs, chunk, divergence):
    """Chunks of blocks (dividing N or not) give the same numbers and the same gradients."""
    s_hidden, t_hidden, head, mask = inputs
    weights = losses.position_weights(jnp.asarray(mask), GAMMA)

    def loss(s_h, c):
        stats = losses.position_stats(
            s_h, jnp.asarray(head), jnp.zeros(mask.shape, jnp.int32), jnp.asarray(t_hidden),
            temperature=1.5, divergence=divergence, chunk=c,
        )  # fmt: skip
        value, _ = losses.distill_loss(stats.ce, stats.kl, weights, alpha=0.4, tau=0.05)
        return value, stats

    (v0, s0), g0 = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(s_hidden), 0)
    (v1, s1), g1 = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(s_hidden), chunk)
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-5, atol=1e-7)
    for name in ("ce", "kl", "max_logprob", "entropy"):
        np.testing.assert_allclose(getattr(s1, name), getattr(s0, name), rtol=1e-6, atol=1e-6)
    for name in ("labels", "draft"):
        np.testing.assert_array_equal(getattr(s1, name), getattr(s0, name))


def test_stats_without_teacher_use_the_data_labels(inputs):
    s_hidden, _, head, mask = inputs
    labels = np.random.default_rng(2).integers(0, V, mask.shape).astype(np.int32)
    stats = losses.position_stats(
        jnp.asarray(s_hidden), jnp.asarray(head), jnp.asarray(labels), chunk=3
    )
    assert stats.kl is None
    ls = _np_log_softmax(_logits(s_hidden, head).astype(np.float64))
    want = -np.take_along_axis(ls, labels[..., None], -1)[..., 0]
    np.testing.assert_allclose(stats.ce, want, rtol=1e-5)
    np.testing.assert_array_equal(stats.labels, labels)
    np.testing.assert_array_equal(stats.draft, ls.argmax(-1))


def test_decayed_ce_and_accuracy(inputs):
    s_hidden, _, head, mask = inputs
    logits = _logits(s_hidden, head)
    labels = np.random.default_rng(3).integers(0, V, mask.shape)
    w = np.exp(-np.arange(K - 1) / GAMMA)
    np.testing.assert_allclose(losses.decay_weights(K, GAMMA), w, rtol=1e-6)
    ce = -np.take_along_axis(_np_log_softmax(logits.astype(np.float64)), labels[..., None], -1)
    wm = w * mask
    want = np.mean([(wm[b] * ce[b, ..., 0]).sum() / wm[b].sum() for b in range(2)])
    got = losses.decayed_ce(
        losses.cross_entropy(jnp.asarray(logits), jnp.asarray(labels)),
        losses.position_weights(jnp.asarray(mask), GAMMA),
    )
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    acc = losses.accuracy(jnp.asarray(logits.argmax(-1)), jnp.asarray(labels), jnp.asarray(mask))
    np.testing.assert_allclose(
        float(acc), ((logits.argmax(-1) == labels) & mask).sum() / mask.sum()
    )


def test_kl_gradient_reaches_student_only(inputs):
    s_hidden, t_hidden, head, mask = inputs
    weights = losses.position_weights(jnp.asarray(mask), GAMMA)

    def f(s, t):
        stats = losses.position_stats(s, jnp.asarray(head), jnp.zeros(mask.shape, jnp.int32), t)
        return losses.distill_loss(stats.ce, stats.kl, weights, alpha=0.5, tau=10.0)[0]

    gs, gt = jax.grad(f, argnums=(0, 1))(jnp.asarray(s_hidden), jnp.asarray(t_hidden))
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
