"""Our drafter export run by a second implementation (PyTorch, tests/torch_dflash.py) with the
target loaded by transformers: the same drafts, the same length-head ratio, and greedy
speculative decoding that commits the same tokens with the same per-step acceptance as
`experiments.generate --drafter`. Then the round trip PyTorch users make: transformers'
`save_pretrained` re-saves the export, and ours decodes the re-saved drafter identically."""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch_dflash as ref  # noqa: E402

from adaflash_jax.drafter.checkpoint import (  # noqa: E402
    ACCEPT_FILE,
    HEAD_PREFIX,
    load_drafter,
    save_drafter,
)
from adaflash_jax.io.safetensors_io import SafetensorsFile  # noqa: E402
from experiments import generate as generate_cli  # noqa: E402
from experiments import init_drafter  # noqa: E402

V, K, LAYER_IDS = 256, 4, (0, 2)  # layer 2 is the target's last: its feature is post-norm
TRAIN_PROMPTS = 4
NEW_TOKENS = 20
OTHER_PROMPT = [2, 7, 1, 8, 2, 8]  # not trained on


def _hf_target():
    cfg = transformers.Qwen3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,  # no early stop
        pad_token_id=0,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) logits and non-unit norms, as in test_target_parity
        for name, p in model.named_parameters():
            scale, base = (0.3, 1.0) if "norm" in name else (0.15, 0.0)
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
    return model.eval().requires_grad_(False)


def _train_briefly(drafter, tokens_BxS, feats_BxSxnD, emb_VxD, head_DxV, steps=40):
    """A few Adam steps of block CE on the target's own greedy text: the drafter then
    predicts those continuations in part, so acceptance varies from 0 to K − 1."""
    b, s = tokens_BxS.shape
    n = 8
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    tx = optax.adam(3e-3)

    def loss_fn(p, anchors_BxN):
        d = nnx.merge(graphdef, p, rest)
        h = d.train_hidden(feats_BxSxnD, tokens_BxS, anchors_BxN, jnp.ones((b, n), bool), emb_VxD)
        pos = (anchors_BxN[..., None] + jnp.arange(1, K)).reshape(b, -1)
        labels = jnp.take_along_axis(tokens_BxS, pos, axis=1).reshape(b, n, K - 1)
        logits = h[:, :, 1:] @ head_DxV
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @jax.jit
    def step(p, opt, key):
        anchors_BxN = jax.random.randint(key, (b, n), 5, s - K + 1)
        grads = jax.grad(loss_fn)(p, anchors_BxN)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt

    opt = tx.init(params)
    for key in jax.random.split(jax.random.key(0), steps):
        params, opt = step(params, opt, key)
    return nnx.merge(graphdef, params, rest)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The transformers target, its directory, training prompts and our trained fp32 export
    (written by init_drafter, then trained and re-exported by save_drafter)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("torch_ref")
    target = _hf_target()
    target.save_pretrained(root / "target")
    init_drafter.main(
        ["--target", str(root / "target"), "--out", str(root / "init"), "--layers", "2"]
        + ["--block-size", str(K), "--target-layer-ids", ",".join(map(str, LAYER_IDS))]
        + ["--mask-token-id", str(V - 1), "--dtype", "float32"]
    )
    prompts = np.random.default_rng(0).integers(1, V - 1, (TRAIN_PROMPTS, 6))
    with torch.no_grad():
        seqs = target.generate(torch.tensor(prompts), max_new_tokens=26, do_sample=False)
        feats = ref.target_features(
            target(seqs, output_hidden_states=True).hidden_states, LAYER_IDS
        )
    drafter = _train_briefly(
        load_drafter(root / "init"),
        jnp.asarray(seqs.numpy(), jnp.int32),
        jnp.asarray(feats.numpy()),
        jnp.asarray(target.get_input_embeddings().weight.numpy()),
        jnp.asarray(target.get_output_embeddings().weight.numpy().T),
    )
    save_drafter(drafter, root / "drafter", dtype=None)
    # two prompts trained on (long accepted runs), one not
    yield {"root": root, "target": target, "prompts": prompts.tolist()[:2] + [OTHER_PROMPT]}
    torch.set_num_threads(threads)


def _torch_drafter(path):
    return ref.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()


def _engine(setup, drafter_dir):
    """`python -m experiments.generate --drafter` (fixed policy) on the test prompts →
    (tokens, accepted drafts per step), per prompt."""
    argv = ["--target", str(setup["root"] / "target"), "--drafter", str(drafter_dir)]
    argv += ["--max-new-tokens", str(NEW_TOKENS), "--json"]
    for p in setup["prompts"]:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        generate_cli.main(argv)
    rows = [json.loads(line) for line in out.getvalue().strip().splitlines()]
    return [r["output_ids"] for r in rows], [r["accepted"] for r in rows]


@pytest.fixture(scope="module")
def engine_runs(setup):
    return _engine(setup, setup["root"] / "drafter")


@nnx.jit  # one program per drafter (eager dispatch would compile every op on its own)
def _our_draft(drafter, feats, bonus, emb, head):
    """Our drafter's draft (and its ratio r) from a context of `feats`."""
    cache = drafter.append_context(drafter.init_context_cache(2, 16), feats)
    out = drafter.draft(cache, bonus, emb, head)
    return out, drafter.length_head(out.hidden_BxKxD)


def test_drafts_and_ratio_match_ours(setup):
    """Same context features (transformers' target) into both drafters, fp32: logits, block
    states and r agree to 1e-4."""
    target = setup["target"]
    tokens = torch.tensor(np.random.default_rng(1).integers(1, V - 1, (2, 9)))
    bonus = torch.tensor([5, 77])
    with torch.no_grad():
        hidden_states = target(tokens, output_hidden_states=True).hidden_states
        feats = ref.target_features(hidden_states, LAYER_IDS)
        theirs = _torch_drafter(setup["root"] / "drafter")
        hidden_t = theirs(feats, bonus, target.get_input_embeddings())
        logits_t = theirs.draft_logits(hidden_t, target.get_output_embeddings()).numpy()
        r_t = theirs.ratio(hidden_t).numpy()
    ours = load_drafter(setup["root"] / "drafter")
    emb = jnp.asarray(target.get_input_embeddings().weight.numpy())
    head = jnp.asarray(target.get_output_embeddings().weight.numpy().T)
    out, r = _our_draft(
        ours, jnp.asarray(feats.numpy()), jnp.asarray(bonus.numpy(), jnp.int32), emb, head
    )
    assert np.abs(logits_t).max() > 1.0 and np.ptp(r_t) > 1e-3  # not near-constant outputs
    np.testing.assert_allclose(np.asarray(out.logits_BxKm1xV), logits_t, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(out.hidden_BxKxD), hidden_t.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(r), r_t, atol=1e-4, rtol=0)


def test_sliding_window_drafts_match_the_torch_reference_past_the_window(setup):
    """The trained drafter with its first layer made sliding (window 5) through config.json
    alone: on a 10-token context, longer than the window, both implementations draft the same
    logits, and those differ from the full-attention drafter's (the window is active)."""
    root, target = setup["root"], setup["target"]
    windowed = root / "windowed"
    windowed.mkdir()
    (windowed / "model.safetensors").write_bytes(
        (root / "drafter" / "model.safetensors").read_bytes()
    )
    raw = json.loads((root / "drafter" / "config.json").read_text())
    raw.update(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True)
    (windowed / "config.json").write_text(json.dumps({**raw, "sliding_window": 5}))
    tokens = torch.tensor(np.random.default_rng(2).integers(1, V - 1, (2, 10)))
    bonus = torch.tensor([9, 31])
    emb = jnp.asarray(target.get_input_embeddings().weight.numpy())
    head = jnp.asarray(target.get_output_embeddings().weight.numpy().T)
    with torch.no_grad():
        feats = ref.target_features(
            target(tokens, output_hidden_states=True).hidden_states, LAYER_IDS
        )
        theirs = _torch_drafter(windowed)
        want = theirs.draft_logits(
            theirs(feats, bonus, target.get_input_embeddings()), target.get_output_embeddings()
        )
    logits = {}
    for name in ("windowed", "drafter"):
        ours = load_drafter(root / name)
        out, _ = _our_draft(
            ours, jnp.asarray(feats.numpy()), jnp.asarray(bonus.numpy(), jnp.int32), emb, head
        )
        logits[name] = np.asarray(out.logits_BxKm1xV)
    assert theirs.layers[0].self_attn.window == 5 and theirs.layers[1].self_attn.window is None
    np.testing.assert_allclose(logits["windowed"], want.numpy(), atol=1e-4, rtol=0)
    assert np.abs(logits["windowed"] - logits["drafter"]).max() > 1e-2


def test_speculative_decoding_driven_by_the_torch_drafter_matches_ours(setup, engine_runs):
    theirs = _torch_drafter(setup["root"] / "drafter")
    for p, want_tokens, want_accepted in zip(setup["prompts"], *engine_runs, strict=True):
        got_tokens, got_accepted = ref.greedy_speculative(setup["target"], theirs, p, NEW_TOKENS)
        assert got_tokens == want_tokens
        assert got_accepted == want_accepted
    seen = {a for steps in engine_runs[1] for a in steps}
    assert {0, K - 1} <= seen and len(seen) >= 3, engine_runs[1]  # partial accepts too


# ---- the round trip through transformers' save_pretrained (issue 18) -------------------------
@pytest.fixture(scope="module")
def resaved(setup):
    """Our export with an acceptance part, as distill writes it (fp32 here), and
    transformers' re-save of it."""
    root = setup["root"]
    original = load_drafter(root / "drafter", accept_dim=8)  # a fresh acceptance network
    save_drafter(original, root / "original", dtype=None)
    ref.DFlashDraftModel.from_pretrained(root / "original").save_pretrained(root / "resaved")
    return root / "original", root / "resaved"


def _tensor_pairs(dir_a, dir_b):
    a, b = (SafetensorsFile(os.path.join(d, "model.safetensors")) for d in (dir_a, dir_b))
    assert set(a.keys()) == set(b.keys())
    return [(k, np.asarray(a.get(k)), np.asarray(b.get(k))) for k in sorted(a.keys())]


def test_transformers_reads_our_config_without_deprecation_warnings(resaved, capfd):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ref.DFlashDraftModel.from_pretrained(resaved[0])
    logged = capfd.readouterr().err
    assert not [w for w in caught if "deprecat" in str(w.message).lower()]
    assert "deprecat" not in logged.lower(), logged
    assert model.dtype == torch.float32 and model.config.layer_types == ["full_attention"] * 2
    assert model.config.sliding_window is None and model.config.num_target_layers == 3


def test_resaved_drafter_keeps_every_tensor_and_the_thresh_head(resaved):
    original, resaved_dir = resaved
    pairs = _tensor_pairs(original, resaved_dir)
    assert any(name.startswith(HEAD_PREFIX) for name, _, _ in pairs)
    for name, a, b in pairs:
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, name)
    assert not os.path.exists(resaved_dir / ACCEPT_FILE)  # transformers does not copy it
    cfg = json.loads((resaved_dir / "config.json").read_text())
    assert cfg["dflash_config"]["use_thresh_head_two_model"] is True


def test_ours_loads_the_resaved_drafter_with_one_warning_and_decodes_identically(
    setup, resaved, engine_runs
):
    original, resaved_dir = resaved
    with pytest.warns(UserWarning, match="acceptance-head part.*missing") as caught:
        loaded = load_drafter(resaved_dir)
    assert len(caught) == 1 and not loaded.length_head.has_accept_output
    h = jax.random.normal(jax.random.key(3), (2, K, 64))
    np.testing.assert_array_equal(  # the thresh head survived the round trip
        np.asarray(loaded.length_head(h)), np.asarray(load_drafter(original).length_head(h))
    )
    # The original's main file is the trained drafter's, bit for bit, and the fixed policy
    # never reads the acceptance part, so its decode is `engine_runs` (whose compiled
    # programs serve the re-saved drafter too: nothing recompiles here).
    for name, a, b in _tensor_pairs(original, setup["root"] / "drafter"):
        np.testing.assert_array_equal(a, b, name)
    with pytest.warns(UserWarning, match="missing"):
        assert _engine(setup, resaved_dir) == engine_runs
    # only what reads the part refuses, naming the fix
    argv = ["--target", str(setup["root"] / "target"), "--drafter", str(resaved_dir)]
    argv += ["--policy", "goodput", "--estimator", "head", "--prompt-ids", "1,2"]
    with pytest.warns(UserWarning), pytest.raises(SystemExit, match=r"missing.*export RUN"):
        generate_cli.main(argv)
