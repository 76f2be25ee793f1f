"""A tiny hybrid Qwen3.5-MoE target (Gated DeltaNet and gated attention layers, routed experts
plus a shared expert) through the unchanged CLIs: init_drafter, generate (plain and
speculative: greedy outputs equal), distill --target (stage 1 → head init → one stage-2 round
collected through the engine, τ, export loads), experiments.export; and the default feature
layers of the 48-layer Qwen3-30B-A3B and the Qwen3.5 / Qwen3.6 hybrids."""

from __future__ import annotations

import json
import os

import pytest
from doubles import THINKING_TEMPLATE
from flax import nnx

from adaflash_jax.drafter.checkpoint import load_drafter
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.model.checkpoint import save_target
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.tokenizer import write_byte_tokenizer
from experiments import distill as distill_cli
from experiments import export as export_cli
from experiments import generate as generate_cli
from experiments import init_drafter

CONFIG = """
from adaflash_jax.distill.config import *

def get_config():
    return RunConfig(
        name="moe_micro", batch_size=8, seq_len=32, num_anchors=4,
        log_every=1,
        data=DataSpec(train_prompts={prompts!r}, eval_prompts={prompts!r}, train_per_domain=4,
                      eval_per_domain=2, max_prompt_len=12, max_new_tokens=12, regen_batch=8,
                      chat_template=True, max_bad_lines=1),
        draft=DraftSpec(layers=1, block_size=4, target_layer_ids=(0, 2)),
        stage1=Stage1Spec(steps=2), head_init=HeadInitSpec(steps=1),
        stage2=Stage2Spec(rounds=1, steps_per_round=1, prompts_per_round=8,
                          methods=("adaflash",)),
        checkpoint=CheckpointSpec(every=2),
    )
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A random 3-layer hybrid MoE target (DeltaNet, attention, DeltaNet; 5 experts, top 2,
    and a shared expert) with a byte tokenizer, and a 1-layer drafter for it from
    init_drafter."""
    root = tmp_path_factory.mktemp("moe_cli")
    target = str(root / "target")
    vocab = write_byte_tokenizer(target, chat_template=THINKING_TEMPLATE)
    cfg = target_preset(
        "test-hybrid",
        model_type="qwen3_5_moe_text",
        vocab_size=vocab,
        max_position_embeddings=128,
        eos_token_id=256,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        shared_expert_intermediate_size=24,
    )
    save_target(TargetLM(cfg, rngs=nnx.Rngs(0)), target)
    drafter = str(root / "drafter")
    argv = ["--target", target, "--out", drafter, "--layers", "1", "--block-size", "4"]
    init_drafter.main(argv + ["--num-features", "2", "--dtype", "float32"])
    return {"root": root, "target": target, "drafter": drafter}


def _rows(capsys, argv):
    generate_cli.main(argv)
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def test_init_drafter_reads_the_moe_target(dirs):
    drafter = load_drafter(dirs["drafter"])
    assert drafter.config.num_target_layers == 3
    assert drafter.config.target_layer_ids == (1, 0)  # docs/design.md §2 defaults for L = 3, n = 2
    assert drafter.config.intermediate_size == 64  # the target's MLP width (DFlash shape)


def test_speculative_greedy_equals_plain(dirs, capsys):
    prompts = ["--prompt", "hello there", "--prompt-ids", "5,6,7,8,9,10,11", "--prompt", "x"]
    base = ["--target", dirs["target"], *prompts, "--max-new-tokens", "12", "--json"]
    plain = _rows(capsys, base)
    spec = _rows(capsys, base + ["--drafter", dirs["drafter"], "--slots", "2"])
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    assert all(len(r["output_ids"]) >= 1 and r["steps"] >= 1 for r in spec)


def test_distill_and_export_with_a_hybrid_moe_target(dirs):
    root = dirs["root"]
    prompts = str(root / "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(16):
            f.write(json.dumps({"domain": "code", "prompt": f"def f{i}(x):"}) + "\n")
        f.write('{"domain": "code", "prompt": "def broken(\n')  # line 17: not JSON
    config = str(root / "moe_micro.py")
    with open(config, "w") as f:
        f.write(CONFIG.format(target=dirs["target"], prompts=prompts))
    run_dir = str(root / "run")
    argv = ["--config", config, "--run-dir", run_dir, "--target", dirs["target"], "--no-progress"]
    assert distill_cli.main(argv) == 0
    with open(os.path.join(run_dir, "report.json")) as f:
        report = json.load(f)
    assert set(report["tau"]) == {"stage1", "adaflash"}
    issues = report["data_issues"]  # the broken line, skipped (max_bad_lines=1) and named
    assert issues["broken_lines_skipped"] == {prompts: [17]}
    assert set(issues["empty_responses"]) == {"train", "eval"}
    # per split encoded: train, eval and (a "fresh" stage-2 pool) stage2
    assert set(issues["prompts_truncated"]) == set(issues["prompts_skipped"]) >= {"train", "eval"}
    assert not any(issues["prompts_skipped"].values())  # data.long_prompts "truncate"
    stages = {"stage1", "head_init", "stage2_adaflash", "head_refit_adaflash"}
    assert set(report["nonfinite_skipped"]) == stages
    assert not any(report["nonfinite_skipped"].values())
    assert all(1.0 <= t <= 4.0 for per in report["tau"].values() for t in per.values())
    exported = load_drafter(os.path.join(run_dir, "export", "adaflash"))
    with open(os.path.join(run_dir, "export", "adaflash", "config.json")) as f:
        # prompts were chat-templated with thinking off (the reference's setting), recorded
        assert json.load(f)["adaflash_prompt_format"] == {
            "chat_template": True,
            "enable_thinking": False,
        }
    assert exported.config.target_layer_ids == (0, 2) and exported.length_head is not None
    out = str(root / "exported_again")
    assert export_cli.main([run_dir, "--out", out]) == 0
    assert load_drafter(out).config.target_layer_ids == (0, 2)


def test_default_feature_layers_of_a_48_layer_target():
    """Qwen3-(Coder-)30B-A3B: the reference drafter reads target layers [1, 12, 23, 34, 45]."""
    target = target_preset("qwen3-30b-a3b")
    assert target.num_hidden_layers == 48 and all(map(target.is_moe_layer, range(48)))
    dcfg = DrafterConfig.for_target(target, mask_token_id=151669, num_layers=8)
    assert dcfg.target_layer_ids == (1, 12, 23, 34, 45)
    assert (dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_key_value_heads) == (2048, 6144, 4)


def test_default_feature_layers_and_drafter_of_the_hybrids():
    """Qwen3.5-9B (32 layers): the reference's configs/qwen3.5-9b-dflash-thresh-head.json reads
    target layers [1, 8, 15, 22, 29] with 32 q / 8 kv heads of 128, MLP 12288, θ 1e7, vocab
    248320; Qwen3.6-35B-A3B (40 layers) gets [1, 10, 19, 28, 37]. A feature is the residual
    stream after its layer, DeltaNet or attention alike."""
    nine = target_preset("qwen3.5-9b")
    dcfg = DrafterConfig.for_target(nine, mask_token_id=248070, heads=(32, 8, 128))
    assert dcfg.target_layer_ids == (1, 8, 15, 22, 29)
    kinds = [nine.layer_types[i][:4] for i in dcfg.target_layer_ids]
    assert kinds == ["line", "line", "full", "line", "line"]  # both mixers feed the drafter
    assert (dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim) == (32, 8, 128)
    assert (dcfg.intermediate_size, dcfg.rope_theta, dcfg.vocab_size) == (12288, 1e7, 248320)
    moe = target_preset("qwen3.6-35b-a3b")
    assert DrafterConfig.for_target(moe, mask_token_id=248070).target_layer_ids == (
        1,
        10,
        19,
        28,
        37,
    )


def test_mfu_counts_active_expert_flops():
    """A token multiplies the router and its k experts only: tiny-moe (8 experts of F 64,
    2 per token) costs its dense twin (F 128) plus the router, 2·D·E per token per layer."""
    from adaflash_jax.aot import flops

    shape_config = target_preset
    moe, dense = shape_config("micro-moe"), shape_config("micro")
    b, s = 3, 40
    extra = flops.target_forward(moe, b, s) - flops.target_forward(dense, b, s)
    assert extra == 2.0 * b * s * moe.num_hidden_layers * moe.hidden_size * moe.num_experts
    a3b = shape_config("qwen3-30b-a3b")  # 3.3e9 active of 30.5e9 (with the embedding, head)
    active = sum(flops.target_layer_active(a3b, i) for i in range(48)) + 2 * 151936 * 2048
    assert 3.3e9 < active < 3.4e9
