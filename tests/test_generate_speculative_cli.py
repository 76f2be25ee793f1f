"""The generate CLI's speculative path: greedy output equals plain output, JSON statistics,
and clear errors for a drafter that does not fit the target."""

from __future__ import annotations

import json
import re

import pytest
from flax import nnx

from adaflash_jax.decode.slots import DEFAULT_BUCKETS, token_bucket_set
from adaflash_jax.decode.state import bucket_set
from adaflash_jax.decode.tree import TreeShape
from adaflash_jax.io.cost_table import VerifyCostTable
from adaflash_jax.model.checkpoint import save_target
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.tokenizer import CHATML_TEMPLATE, write_byte_tokenizer
from experiments import generate as generate_cli
from experiments import init_drafter


def _target(path, hidden: int) -> str:
    vocab = write_byte_tokenizer(path, chat_template=CHATML_TEMPLATE)
    cfg = target_preset(
        "test", vocab_size=vocab, hidden_size=hidden, max_position_embeddings=128, eos_token_id=256
    )
    save_target(TargetLM(cfg, rngs=nnx.Rngs(0)), path)
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_cli")
    target = _target(root / "target", 32)
    other = _target(root / "other", 48)
    drafter = str(root / "drafter")
    argv = ["--target", target, "--out", drafter, "--layers", "1", "--block-size", "4"]
    init_drafter.main(argv + ["--num-features", "2", "--dtype", "float32"])
    return {"target": target, "other": other, "drafter": drafter}


def _rows(capsys, argv):
    generate_cli.main(argv)
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def _tree_cost_table(path, k: int, tree: str, slots: int) -> str:
    """A synthetic cost table with the packed form at the tree engine's token buckets."""
    shape = TreeShape.parse(tree)
    widths = bucket_set(DEFAULT_BUCKETS, k)
    fills = tuple(p // slots for p in token_bucket_set(slots, (shape.row_width,)))
    VerifyCostTable(
        rows=(slots,), widths=widths, verify_ms=(tuple(1.0 + 0.2 * w for w in widths),),
        draft_ms=(0.3,), fills=fills, packed_ms=(tuple(1.0 + 0.2 * f for f in fills),),
        device="synthetic",
    ).save(path)  # fmt: skip
    return str(path)


def test_greedy_speculative_equals_plain(dirs, capsys, tmp_path):
    prompts = ["--prompt", "hello there", "--prompt-ids", "5,6,7,8,9,10,11", "--prompt", "x"]
    base = ["--target", dirs["target"], *prompts, "--max-new-tokens", "12", "--json"]
    plain = _rows(capsys, base)
    assert all("tau" not in r for r in plain)
    # 2 slots for 3 prompts (continuous batching) and a block-size override (4 → 3)
    spec_args = ["--drafter", dirs["drafter"], "--slots", "2", "--block-size", "3"]
    spec = _rows(capsys, base + spec_args)
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    assert [r["text"] for r in spec] == [r["text"] for r in plain]
    for r in spec:
        assert r["steps"] == len(r["accepted"]) >= 1
        assert all(0 <= a <= 2 for a in r["accepted"])  # at most K − 1 = 2 drafts
        assert r["tau"] == pytest.approx(sum(a + 1 for a in r["accepted"]) / r["steps"])
        # the prefill gives the first token, each step accepted + 1 (EOS/max may cut)
        assert len(r["output_ids"]) <= 1 + sum(a + 1 for a in r["accepted"])
    packed = _rows(capsys, base + spec_args + ["--verify", "packed"])  # each row's own tokens
    assert [r["output_ids"] for r in packed] == [r["output_ids"] for r in plain]
    assert [r["accepted"] for r in packed] == [r["accepted"] for r in spec]
    for tree in (
        ["--tree", "1x2"],
        ["--tree", "2x5", "--policy", "tree-batch", "--mean-nodes", "2"],
        # the verify attention as the Pallas kernel (interpreted on CPU)
        ["--tree", "2x5", "--verify-attention", "interpret"],
        # goodput fills the token bucket with the best nodes of both rows, or steps plainly
        ["--tree", "2x5", "--policy", "goodput", "--cost-table",
         _tree_cost_table(tmp_path / "tree_cost.json", 3, "2x5", 2)],
    ):  # fmt: skip
        by_tree = _rows(capsys, base + spec_args + tree)  # draft trees: packed, walked
        assert [r["output_ids"] for r in by_tree] == [r["output_ids"] for r in plain]
    # a 1-wide tree of K − 1 = 2 nodes is the chain, step for step
    assert [r["accepted"] for r in _rows(capsys, base + spec_args + ["--tree", "1x2"])] == [
        r["accepted"] for r in spec
    ]
    # text mode (same compiled programs) reports τ per prompt
    generate_cli.main([a for a in base if a != "--json"] + spec_args)
    assert capsys.readouterr().out.count("tau") == 3


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--drafter", "{drafter}", "--target", "{other}"], "does not fit target.*hidden_size"),
        (["--drafter", "{target}/missing"], "does not exist"),
        (["--drafter", "{drafter}", "--block-size", "1"], "block_size must be >= 2"),
        (["--drafter", "{drafter}", "--policy", "goodput", "--cost-table", "{target}/x"], "x"),
        (["--policy", "goodput"], "need --drafter"),
        (["--drafter", "{drafter}", "--estimator", "head"], "options of --policy goodput"),
        (["--drafter", "{drafter}", "--tree", "2by4"], "TOPKxNODES"),
        (["--drafter", "{drafter}", "--tree", "2x4", "--verify", "padded"], "verify packed"),
        (["--drafter", "{drafter}", "--tree", "2x4", "--policy", "adaflash"], "sizes chains"),
        (["--drafter", "{drafter}", "--tree", "2x4@head"], "surrogate 'head'.*accept_probs"),
        (["--drafter", "{drafter}", "--tree", "2x4@vibes"], "unknown tree surrogate"),
        (["--drafter", "{drafter}", "--verify-attention", "pallas"], "TPU kernel; this backend"),
        (["--verify-attention", "interpret"], "need --drafter"),
        (["--drafter", "{drafter}", "--policy", "tree-batch"], "--mean-nodes"),
        # refused before any verify-cost calibration: the drafter has no acceptance output
        (["--drafter", "{drafter}", "--policy", "goodput", "--estimator", "head"], "accept_probs"),
    ],
)
def test_errors(dirs, capsys, argv, match):
    argv = [a.format(**dirs) for a in argv]
    if "--target" not in argv:
        argv = ["--target", dirs["target"], *argv]
    argv += ["--prompt-ids", "1,2", "--max-new-tokens", "2"]
    with pytest.raises(SystemExit) as e:
        generate_cli.main(argv)
    msg = str(e.value) if e.value.code != 2 else capsys.readouterr().err
    assert e.value.code != 0
    assert re.search(match, msg), msg
