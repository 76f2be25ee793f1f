"""Sampling distributions, per-row stopping, request validation and the generate CLI."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from adaflash_jax.decode.generate import GenerateError, generate
from adaflash_jax.decode.tokens import logits_to_probs as _logits_to_probs
from adaflash_jax.decode.tokens import pick_tokens as _pick_tokens
from adaflash_jax.model.checkpoint import load_target, save_target
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.tokenizer import CHATML_TEMPLATE, Tokenizer, write_byte_tokenizer
from experiments import generate as generate_cli

# Jitted: one compile per shape instead of eager dispatch of every op.
logits_to_probs = jax.jit(_logits_to_probs)
pick_tokens = jax.jit(_pick_tokens)
PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)


def test_top_p_keeps_the_smallest_head_reaching_p():
    logits_BxV = jnp.asarray(np.log(np.tile(PROBS, (5, 1))))
    top_p_B = jnp.array([0.4, 0.8, 0.81, 0.99, 1.0])
    probs = np.asarray(logits_to_probs(logits_BxV, 1.0, top_p_B))
    kept = [set(np.flatnonzero(row).tolist()) for row in probs]
    assert kept == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3}]
    for row, keep in zip(probs, kept):
        idx = sorted(keep)
        np.testing.assert_allclose(row[idx], PROBS[idx] / PROBS[idx].sum(), rtol=1e-5)

    # Temperature reshapes before the nucleus; temperature 0 is a one-hot at the argmax.
    logits = jnp.asarray(np.log(np.tile(PROBS, (3, 1))))
    probs = np.asarray(logits_to_probs(logits, jnp.array([2.0, 0.0, 0.5]), 1.0))
    tempered = PROBS**0.5 / (PROBS**0.5).sum()
    np.testing.assert_allclose(probs[0], tempered, rtol=1e-5)
    np.testing.assert_array_equal(probs[1], [1, 0, 0, 0])
    np.testing.assert_allclose(probs[2], PROBS**2 / (PROBS**2).sum(), rtol=1e-5)

    # Ties at the nucleus edge are all kept (no dependence on sort order); one token minimum.
    tied = logits_to_probs(jnp.array([[0.0, 2.0, 2.0, 1.0]]), 1.0, 0.3)
    assert set(np.flatnonzero(np.asarray(tied[0]))) == {1, 2}
    tiny = logits_to_probs(jnp.array([[0.0, 5.0, 1.0]]), 1.0, 1e-6)
    np.testing.assert_array_equal(np.asarray(tiny[0]), [0, 1, 0])


def test_picked_token_frequencies_follow_logits_to_probs():
    n = 40_000
    logits_1xV = jnp.asarray(np.log(PROBS))[None]
    for temperature, top_p in ((0.7, 1.0), (1.3, 0.85)):
        want = np.asarray(logits_to_probs(logits_1xV, temperature, top_p))[0]
        draws = pick_tokens(jax.random.key(0), jnp.tile(logits_1xV, (n, 1)), temperature, top_p)
        freq = np.bincount(np.asarray(draws), minlength=4) / n
        sigma = np.sqrt(want * (1 - want) / n)
        assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-12), (freq, want)
        assert np.all(freq[want == 0] == 0)  # filtered tokens are never drawn
    assert (top_p_set := set(np.flatnonzero(want))) == {0, 1, 2}, top_p_set
    greedy = pick_tokens(jax.random.key(1), jnp.tile(logits_1xV, (8, 1)), 0.0, 0.5)
    np.testing.assert_array_equal(np.asarray(greedy), 0)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random Qwen3 target with a byte tokenizer and a ChatML template."""
    path = tmp_path_factory.mktemp("tiny_target")
    vocab = write_byte_tokenizer(path, chat_template=CHATML_TEMPLATE)
    cfg = target_preset("test", vocab_size=vocab, max_position_embeddings=64, eos_token_id=256)
    model = TargetLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)  # peakier logits than the 0.02 init
    nnx.update(model, jax.tree.map(lambda x: x * 6.0 if x.ndim == 2 else x, params))
    save_target(model, path)
    return str(path)


@pytest.fixture(scope="module")
def model(target_dir):
    return load_target(target_dir)


def _truncate(tokens, max_new, eos):
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


def test_per_row_eos_and_max_new_tokens(model):
    prompts = [[72, 101, 108], [10, 20, 30, 40, 50], [7]]
    full = generate(model, prompts, max_new_tokens=12, eos_ids=())
    assert all(len(f) == 12 for f in full)
    eos = (full[0][4], full[1][6])  # each row may stop on ANY of the eos ids
    max_new = [12, 3, 9]
    got = generate(model, prompts, max_new_tokens=max_new, eos_ids=eos)
    want = [_truncate(f, m, eos) for f, m in zip(full, max_new)]
    assert got == want
    assert len(got[0]) <= 5 and got[0][-1] in eos  # stopped early, EOS kept
    assert len(got[1]) == 3  # stopped by its own max-new-tokens


@pytest.mark.parametrize(
    "prompts,kwargs,match",
    [
        ([], {}, "no prompts"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1, 260]], {}, r"outside the vocabulary \[0, 260\): \[260\]"),
        ([[-1]], {}, "outside the vocabulary"),
        ([[1] * 60], {"max_new_tokens": 5}, "exceeds the model's max_position_embeddings"),
        ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ([[1, 2]], {"capacity": 8, "max_new_tokens": 7}, "capacity 8 is smaller"),
        ([[1], [2]], {"max_new_tokens": [3]}, "max_new_tokens has 1 entries for 2 prompts"),
        ([[1]], {"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_requests_fail_before_compute(model, prompts, kwargs, match):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(GenerateError, match=match):
        generate(model, prompts, **kwargs)


def _cli_json(capsys, argv):
    generate_cli.main(argv)
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def test_cli_json(target_dir, model, capsys):
    tok = Tokenizer(target_dir)
    rows = _cli_json(
        capsys,
        ["--target", target_dir, "--prompt", "hi there", "--prompt-ids", "1,2,3"]
        + ["--max-new-tokens", "6", "--json"],
    )
    assert [r["prompt_ids"] for r in rows] == [tok.encode("hi there"), [1, 2, 3]]
    want = generate(model, [r["prompt_ids"] for r in rows], max_new_tokens=6, eos_ids=(256,))
    assert [r["output_ids"] for r in rows] == want
    assert [r["text"] for r in rows] == [tok.decode(w) for w in want]

    chat = ["--target", target_dir, "--prompt", "hello", "--chat", "--json"]
    chat += ["--temperature", "0.9", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "8"]
    first, second = _cli_json(capsys, chat), _cli_json(capsys, chat)
    assert first == second  # seeded
    assert first[0]["prompt_ids"] == tok.encode_chat([{"role": "user", "content": "hello"}])
    assert 1 <= len(first[0]["output_ids"]) <= 8

    with pytest.raises(SystemExit, match="outside the vocabulary"):
        generate_cli.main(["--target", target_dir, "--prompt-ids", "1,999"])
