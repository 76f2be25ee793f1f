"""Cache equivalences: cached == uncached, ragged == alone, the plain decoder == a Python loop, read
mode + commit == write mode, a commit along a path == the commit of its tokens."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.decode.generate import generate
from adaflash_jax.decode.slots import SpeculativeEngine
from adaflash_jax.decode.tokens import pick_tokens
from adaflash_jax.model.cache import path_entries
from adaflash_jax.model.kv_cache import KVEntries, KVLayer
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.recurrent_state import RecurrentState
from adaflash_jax.model.target import TargetLM

V = 128
CFG = target_preset("test", vocab_size=V, max_position_embeddings=128)
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    m = TargetLM(CFG, rngs=nnx.Rngs(0))
    # ×6 on the matrices (std 0.12): peaked attention, so a stale or missing cache entry
    # changes the outputs far above the tolerance.
    params = nnx.state(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda x: x * 6.0 if x.ndim == 2 else x, params))
    return m


@functools.partial(jax.jit, static_argnames=("graphdef", "feature_layers"))
def _jit_forward(graphdef, state, tokens, cache, num_new_B, feature_layers):
    model = nnx.merge(graphdef, state)
    return model(tokens, cache=cache, num_new_B=num_new_B, feature_layers=feature_layers)


def fwd(model, tokens, *, cache=None, num_new_B=None, feature_layers=()):
    """The target forward, jitted (eager dispatch of every op is far slower on CPU)."""
    graphdef, state = nnx.split(model)
    return _jit_forward(graphdef, state, tokens, cache, num_new_B, tuple(feature_layers))


def _tokens(b, t, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (b, t)), jnp.int32)


def test_prefill_extend_rollback_extend_equals_full_forward(model):
    tokens = _tokens(2, 14)
    full = fwd(model, tokens, feature_layers=(0,))
    cache = model.init_cache(2, 32)

    pre = fwd(model, tokens[:, :5], cache=cache, feature_layers=(0,))
    np.testing.assert_allclose(pre.logits_BxTxV, full.logits_BxTxV[:, :5], atol=ATOL)
    np.testing.assert_allclose(pre.features_BxTxnD, full.features_BxTxnD[:, :5], atol=ATOL)

    # A speculative extend of 4: the true next 2 tokens, then 2 wrong ones.
    draft = tokens[:, 5:9].at[:, 2:].set((tokens[:, 7:9] + 1) % V)
    ext = fwd(model, draft, cache=pre.cache)
    np.testing.assert_array_equal(ext.cache.lengths, [9, 9])
    np.testing.assert_allclose(ext.logits_BxTxV[:, :2], full.logits_BxTxV[:, 5:7], atol=ATOL)
    assert np.abs(ext.logits_BxTxV[:, 3] - full.logits_BxTxV[:, 8]).max() > 1e-2  # can fail

    # Keep the 2 correct tokens, drop the wrong ones, then extend with the true rest.
    rolled = ext.cache.rollback(jnp.array([7, 7]))
    rest = fwd(model, tokens[:, 7:], cache=rolled, feature_layers=(0,))
    np.testing.assert_array_equal(rest.cache.lengths, [14, 14])
    np.testing.assert_allclose(rest.logits_BxTxV, full.logits_BxTxV[:, 7:], atol=ATOL)
    np.testing.assert_allclose(rest.features_BxTxnD, full.features_BxTxnD[:, 7:], atol=ATOL)


def test_per_row_rollback_and_ragged_extend(model):
    """Rows commit different counts (num_new_B), as a verify step does."""
    tokens = _tokens(2, 12, seed=1)
    full = fwd(model, tokens)
    pre = fwd(model, tokens[:, :4], cache=model.init_cache(2, 24))
    ext = fwd(model, tokens[:, 4:8], cache=pre.cache, num_new_B=jnp.array([1, 3]))
    np.testing.assert_array_equal(ext.cache.lengths, [5, 7])
    nxt = fwd(model, jnp.stack([tokens[0, 5:8], tokens[1, 7:10]]), cache=ext.cache)
    np.testing.assert_allclose(nxt.logits_BxTxV[0], full.logits_BxTxV[0, 5:8], atol=ATOL)
    np.testing.assert_allclose(nxt.logits_BxTxV[1], full.logits_BxTxV[1, 7:10], atol=ATOL)


def test_read_mode_equals_write_mode(model):
    """The "read" cache mode (what the engine verifies with inside `lax.switch`) == the
    "write" mode: same logits and features (the last layer's post-norm included), and
    `Cache.commit` of its entries == the cache the write mode returns, on ragged lengths
    with a ragged commit."""
    lengths = jnp.array([9, 4, 1])
    layers = (0, CFG.num_hidden_layers - 1)
    graphdef, state = nnx.split(model)

    @jax.jit
    def both(state, prompt, tokens):
        target = nnx.merge(graphdef, state)
        cache = target(prompt, cache=target.init_cache(3, 24), num_new_B=lengths).cache
        advance = jnp.array([4, 2, 1])
        want = target(tokens, cache=cache, num_new_B=advance, feature_layers=layers)
        got = target(tokens, cache=cache, cache_mode="read", feature_layers=layers)
        return want, got, cache.commit(got.entries, advance)

    want, got, written = both(state, _tokens(3, 9, seed=5), _tokens(3, 4, seed=6))
    assert got.cache is None and want.entries is None
    np.testing.assert_allclose(got.logits_BxTxV, want.logits_BxTxV, atol=ATOL)
    np.testing.assert_allclose(got.features_BxTxnD, want.features_BxTxnD, atol=ATOL)
    np.testing.assert_array_equal(written.lengths, want.cache.lengths)
    # Both modes attend the same way and commit through `Cache.commit`, but they are two
    # traced programs: allow 1e-5 of the largest entry (~80 ulp of float32 rounding); a
    # missing or stale committed entry, a wrong position or a misplaced write moves entries
    # by O(1) (0.75-1.9 measured).
    for got_k, want_k in zip(jax.tree.leaves(written.layers), jax.tree.leaves(want.cache.layers)):
        for b, n in enumerate([9, 4, 1]):  # committed prefix + the 4 new entries
            scale = float(np.abs(want_k[b, : n + 4]).max())
            assert scale > 0.5  # O(1) entries: the tolerance below is relative to them
            np.testing.assert_allclose(
                got_k[b, : n + 4], want_k[b, : n + 4], rtol=0, atol=1e-5 * scale
            )
    with pytest.raises(ValueError, match="cache_mode"):
        model(_tokens(1, 1), cache=model.init_cache(1, 4), cache_mode="append")


def test_ragged_batch_equals_each_prompt_alone(model):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, V, n).tolist() for n in (3, 9, 14)]
    batched = generate(model, prompts, max_new_tokens=[8, 5, 8], eos_ids=())
    alone = [
        generate(model, [p], max_new_tokens=n, eos_ids=())[0] for p, n in zip(prompts, (8, 5, 8))
    ]
    assert batched == alone
    assert [len(o) for o in batched] == [8, 5, 8]

    # Same prefill logits, padded batch vs alone (through the cache path, with num_new_B).
    lengths = jnp.array([3, 9, 14])
    padded = jnp.asarray([p + [0] * (14 - len(p)) for p in prompts], jnp.int32)
    out = fwd(model, padded, cache=model.init_cache(3, 16), num_new_B=lengths)
    np.testing.assert_array_equal(out.cache.lengths, lengths)
    for i, p in enumerate(prompts):
        # Alone and uncached; trailing padding cannot change causal logits before it.
        alone_logits = fwd(model, padded[i : i + 1]).logits_BxTxV[0, : len(p)]
        np.testing.assert_allclose(out.logits_BxTxV[i, : len(p)], alone_logits, atol=ATOL)


def test_greedy_generate_equals_uncached_python_loop(model):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, V, n).tolist() for n in (4, 7, 12)]
    got = generate(model, prompts, max_new_tokens=8, eos_ids=())
    for prompt, out in zip(prompts, got):
        seq = list(prompt)
        for _ in range(8):  # full recompute each step, no cache; fixed shape, causal padding
            padded = jnp.asarray([seq + [0] * (24 - len(seq))], jnp.int32)
            logits = fwd(model, padded).logits_BxTxV[0, len(seq) - 1]
            seq.append(int(jnp.argmax(logits)))
        assert out == seq[len(prompt) :]


def _python_loop_reference(model, prompts, max_new, temperature, top_p, eos, seed):
    """Step-by-step twin of the plain engine (`decode.generate`): the same RNG schedule
    (a split before the prefill's pick, then `rng, _, key = split(rng, 3)` per step), cache
    and EOS rules; prompts padded as its prefill pads them (16 here)."""
    b, p_pad = len(prompts), 16
    padded = jnp.asarray([p + [0] * (p_pad - len(p)) for p in prompts], jnp.int32)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    capacity = max(len(p) + m for p, m in zip(prompts, max_new))
    out = fwd(model, padded, cache=model.init_cache(b, capacity), num_new_B=lengths)
    logits_BxV = out.logits_BxTxV[jnp.arange(b), lengths - 1]
    temp, nucleus = jnp.float32(temperature), jnp.float32(top_p)
    rng, cache = jax.random.key(seed), out.cache
    rng, key = jax.random.split(rng)
    outputs, done = [[] for _ in range(b)], [False] * b
    while True:
        tok = pick_tokens(key, logits_BxV, temp, nucleus).tolist()
        for i in range(b):
            if not done[i]:
                outputs[i].append(tok[i])
                done[i] = tok[i] in eos or len(outputs[i]) >= max_new[i]
        if all(done):
            return outputs, cache
        last = jnp.asarray([[o[-1]] for o in outputs], jnp.int32)
        active = jnp.asarray([not d for d in done], jnp.int32)
        step = fwd(model, last, cache=cache, num_new_B=active)
        logits_BxV, cache = step.logits_BxTxV[:, 0], step.cache
        rng, _, key = jax.random.split(rng, 3)


def test_sampled_plain_decoder_equals_python_loop(model):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, V, n).tolist() for n in (5, 11, 8)]
    max_new, seed = [9, 12, 6], 7
    no_eos, _ = _python_loop_reference(model, prompts, max_new, 0.8, 0.9, (), seed)
    eos = (no_eos[0][4],)  # row 0 must stop at its 5th token or earlier
    expected, ref_cache = _python_loop_reference(model, prompts, max_new, 0.8, 0.9, eos, seed)
    got = generate(
        model, prompts, max_new_tokens=max_new, temperature=0.8, top_p=0.9, eos_ids=eos, seed=seed
    )
    assert got == expected
    assert got[0] == no_eos[0][: no_eos[0].index(eos[0]) + 1]
    # Finished rows stop advancing: committed = prompt + outputs − the last (never fed) token.
    engine = SpeculativeEngine(
        model, None, slots=3, capacity=23, temperature=0.8, top_p=0.9, eos_ids=eos, seed=seed
    )
    state = engine.prefill(
        engine.init_state(seed), [(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_new))]
    )
    state, *_ = engine.run(state, stop_on_finish=False)
    want_lengths = [len(p) + len(o) - 1 for p, o in zip(prompts, got)]
    np.testing.assert_array_equal(state.target_cache.lengths, want_lengths)
    np.testing.assert_array_equal(ref_cache.lengths, want_lengths)


def test_kv_commit_keeps_a_path_in_order():
    """A non-contiguous path: row 0 keeps pass tokens 0, 2, 3 (n = 2 of them), row 1 tokens
    1 and 0; they land at the row's next positions, in path order."""
    layer = KVLayer.create(batch=2, capacity=8, kv_heads=1, head_dim=1, dtype=jnp.float32)
    k_BxTx1x1 = jnp.arange(1.0, 9.0).reshape(2, 4, 1, 1)  # row 0: 1..4, row 1: 5..8
    entries = KVEntries(k_BxTx1x1, -k_BxTx1x1)
    lengths_B = jnp.array([3, 0])
    path_BxZ = jnp.array([[0, 2, 3], [1, 0, 0]])
    got = layer.commit(entries, lengths_B, path_BxZ, jnp.array([2, 2]))
    np.testing.assert_array_equal(got.k_BxSxKvxDh[0, 3:5, 0, 0], [1.0, 3.0])
    np.testing.assert_array_equal(got.k_BxSxKvxDh[1, 0:2, 0, 0], [6.0, 5.0])
    np.testing.assert_array_equal(got.v_BxSxKvxDh[1, 0:2, 0, 0], [-6.0, -5.0])
    np.testing.assert_array_equal(got.k_BxSxKvxDh[0, :3], 0.0)  # committed entries untouched


def test_commit_along_a_path_equals_commit_of_its_tokens():
    """On a hybrid target (attention K/V and Gated DeltaNet states): committing path
    0..T−1 equals the chain commit, and committing a non-contiguous path of a pass equals
    committing that pass's entries gathered along the path, for every layer kind."""
    cfg = target_preset("test-hybrid", vocab_size=V, max_position_embeddings=64)
    target = TargetLM(cfg, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(target)

    @jax.jit
    def run(state, prompt, tokens):
        target = nnx.merge(graphdef, state)
        cache = target(prompt, cache=target.init_cache(2, 24)).cache
        entries = target(tokens, cache=cache, cache_mode="read").entries
        n_B = jnp.array([3, 2])
        chain = cache.commit(entries, n_B)
        arange = cache.commit(entries, n_B, jnp.broadcast_to(jnp.arange(4), (2, 4)))
        path_BxZ = jnp.array([[0, 2, 3], [1, 3, 3]])
        along = cache.commit(entries, n_B, path_BxZ)
        gathered = cache.commit(tuple(path_entries(e, path_BxZ) for e in entries), n_B)
        return chain, arange, along, gathered

    chain, arange, along, gathered = run(state, _tokens(2, 5, seed=8), _tokens(2, 4, seed=9))
    kinds = {type(c) for c in chain.layers}
    assert kinds == {KVLayer, RecurrentState}
    for a, b in zip(jax.tree.leaves(chain), jax.tree.leaves(arange)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(along), jax.tree.leaves(gathered)):
        np.testing.assert_array_equal(a, b)
    # the path really changed what was kept (row 0 skipped token 1)
    assert any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(along), jax.tree.leaves(chain))
    )
    np.testing.assert_array_equal(along.lengths, [8, 7])
    with pytest.raises(ValueError, match="RecurrentState cannot roll back"):
        chain.rollback(jnp.array([5, 5]))
