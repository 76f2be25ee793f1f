"""Greedy replay (one batched drafter forward) == step-by-step cached speculative decoding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from adaflash_jax.distill import collect
from adaflash_jax.distill.regenerate import build_sequences
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM

# A 5-token vocabulary makes chance agreement frequent, so accepted streaks are non-trivial.
TARGET = target_preset("test", vocab_size=5)
K, LAYERS, NEW = 4, (0, 1), 14


@functools.partial(jax.jit, static_argnames=("tg", "dg"))
def _prefill(tg, tp, dg, dp, prompt_1xP, length_1, cap):
    target, drafter = nnx.merge(tg, tp), nnx.merge(dg, dp)
    cache = target.init_cache(1, cap.shape[0])
    out = target(prompt_1xP, cache=cache, num_new_B=length_1, feature_layers=LAYERS)
    dcache = drafter.init_context_cache(1, cap.shape[0])
    dcache = drafter.append_context(dcache, out.features_BxTxnD, num_new_B=length_1)
    return out.cache, dcache, jnp.argmax(out.logits_BxTxV[0, length_1[0] - 1])


@functools.partial(jax.jit, static_argnames=("tg", "dg"))
def _step(tg, tp, dg, dp, tcache, dcache, bonus_1):
    """Draft, verify, accept (greedy), commit: one serving step."""
    target, drafter = nnx.merge(tg, tp), nnx.merge(dg, dp)
    emb, head = target.embedding_VxD(), target.lm_head_DxV()
    drafts = jnp.argmax(drafter.draft(dcache, bonus_1, emb, head).logits_BxKm1xV[0], axis=-1)
    block = jnp.concatenate([bonus_1, drafts])[None]
    ver = target(block, cache=tcache, feature_layers=LAYERS)
    best = jnp.argmax(ver.logits_BxTxV[0], axis=-1)
    acc = jnp.sum(jnp.cumprod(drafts == best[:-1]))
    new_len = tcache.lengths + acc + 1
    dcache = drafter.append_context(dcache, ver.features_BxTxnD, num_new_B=(acc + 1)[None])
    return ver.cache.with_lengths(new_len), dcache, drafts, best, acc


def _speculative(target, drafter, prompt):
    """Reference serving loop (docs/design.md §5), greedy, one row: step by step with caches."""
    tg, tp = nnx.split(target)
    dg, dp = nnx.split(drafter)
    padded = jnp.zeros((1, 8), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt))
    cap = jnp.zeros(8 + NEW + K + 1)
    tcache, dcache, first = _prefill(tg, tp, dg, dp, padded, jnp.asarray([len(prompt)]), cap)
    response, steps = [int(first)], []
    while len(response) < NEW:
        a = len(prompt) + len(response) - 1  # position of the bonus token
        tcache, dcache, drafts, best, acc = _step(
            tg, tp, dg, dp, tcache, dcache, jnp.asarray(response[-1:])
        )
        acc = int(acc)
        steps.append((a, acc))
        response += [int(t) for t in drafts[:acc]] + [int(best[acc])]
    return response[:NEW], steps


def test_replay_equals_speculative_decoding():
    target = TargetLM(TARGET, rngs=nnx.Rngs(3))
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=4, num_layers=1, block_size=K, target_layer_ids=LAYERS
    )
    drafter = Drafter(cfg, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4, n).tolist() for n in (5, 7, 6)]
    runs = [_speculative(target, drafter, p) for p in prompts]
    data = build_sequences(
        prompts, [r for r, _ in runs], [0, 1, 0], seq_len=24, pad_id=0, domains=("a", "b")
    )
    trajs = collect.replay(
        nnx.split(drafter), nnx.split(target), data, block_size=K, feature_layers=LAYERS,
        span=NEW, batch_size=2,
    )  # fmt: skip
    total_accepted = 0
    for (response, steps), traj in zip(runs, trajs):
        end = len(response) - 1  # relative to the response start
        want = [(a, min(acc, (traj.anchors[0] + end) - a)) for a, acc in steps]
        assert list(zip(traj.anchors.tolist(), traj.accepted.tolist())) == want
        total_accepted += sum(acc for _, acc in want)
    assert total_accepted > 3  # the comparison is not vacuous
    tau = collect.tau_by_domain(data, trajs)
    pooled_a = [t for t, d in zip(trajs, (0, 1, 0)) if d == 0]
    steps_a = sum(len(t.accepted) for t in pooled_a)
    assert np.isclose(tau["a"], sum(int((t.accepted + 1).sum()) for t in pooled_a) / steps_a)
    visited = collect.with_visited(data, trajs).visited
    assert visited[0, : len(trajs[0].anchors)].tolist() == trajs[0].anchors.tolist()


def test_engine_collection_matches_replay():
    """The serving engine (greedy, full block) and replay record the same steps."""
    target = TargetLM(TARGET, rngs=nnx.Rngs(3))
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=4, num_layers=1, block_size=K, target_layer_ids=LAYERS
    )
    drafter = Drafter(cfg, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 4, n).tolist() for n in (5, 7, 6, 4)]
    responses, trajs = collect.engine_collect(
        target, drafter, prompts, max_new_tokens=NEW, slots=2, eos_ids=()
    )
    data = build_sequences(prompts, responses, [0] * 4, seq_len=24, pad_id=0, domains=("a",))
    replayed = collect.replay(
        nnx.split(drafter), nnx.split(target), data, block_size=K, feature_layers=LAYERS,
        span=NEW, batch_size=2,
    )  # fmt: skip
    assert sum(int(t.accepted.sum()) for t in trajs) > 3
    for got, want, prompt, resp in zip(trajs, replayed, prompts, responses):
        end = len(prompt) + len(resp) - 1
        capped = np.minimum(got.accepted, end - got.anchors)  # the engine's last step may overrun
        assert got.anchors.tolist() == want.anchors.tolist()
        assert capped.tolist() == want.accepted.tolist()


def test_replay_with_the_head_gives_each_blocks_r():
    """`replay(head=True)` records, per step, the length head's r of the block drafted there:
    the head over the training path's states of a block at that anchor. The steps are those
    of a replay without the head."""
    target = TargetLM(TARGET, rngs=nnx.Rngs(3))
    cfg = DrafterConfig.for_target(
        TARGET, mask_token_id=4, num_layers=1, block_size=K, target_layer_ids=LAYERS,
        length_head=True,
    )  # fmt: skip
    drafter = Drafter(cfg, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 4, n).tolist() for n in (5, 7)]
    responses = [rng.integers(0, 4, NEW).tolist() for _ in prompts]
    data = build_sequences(prompts, responses, [0, 0], seq_len=24, pad_id=0, domains=("a",))
    args = (nnx.split(drafter), nnx.split(target), data)
    kw = dict(block_size=K, feature_layers=LAYERS, span=NEW, batch_size=2, progress=False)
    plain = collect.replay(*args, **kw)
    headed = collect.replay(*args, **kw, head=True)
    out = target(jnp.asarray(data.tokens), feature_layers=LAYERS, compute_logits=False)
    for row, (a, b) in enumerate(zip(plain, headed)):
        assert a.head_r is None and a.anchors.tolist() == b.anchors.tolist()
        assert a.accepted.tolist() == b.accepted.tolist()
        anchors_1xN = jnp.asarray(b.anchors)[None]
        hidden = drafter.train_hidden(
            out.features_BxTxnD[row : row + 1],
            jnp.asarray(data.tokens[row : row + 1]),
            anchors_1xN,
            jnp.ones_like(anchors_1xN, bool),
            target.embedding_VxD(),
        )
        want = drafter.length_head(hidden[0])
        np.testing.assert_allclose(b.head_r, np.asarray(want), rtol=1e-5, atol=1e-6)
