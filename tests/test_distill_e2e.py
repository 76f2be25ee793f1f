"""End-to-end micro runs of `python -m experiments.distill` → loadable exports + report."""

import json
import os

import numpy as np
import pytest
from flax import nnx

from adaflash_jax.distill import schedule
from adaflash_jax.distill.batches import SequenceData
from adaflash_jax.distill.config_file import load_config
from adaflash_jax.distill.overrides import override
from adaflash_jax.drafter.checkpoint import load_drafter
from adaflash_jax.model.checkpoint import save_target
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.tokenizer import write_byte_tokenizer
from adaflash_jax.train.tensorboard import read_scalars
from experiments import distill as cli

CONFIG = """
from adaflash_jax.distill.config import *

def get_config():
    return RunConfig(
        name="micro", target_path={target!r}, batch_size=8, seq_len=32, num_anchors=4,
        log_every=1,
        data=DataSpec(train_prompts={prompts!r}, eval_prompts={prompts!r}, train_per_domain=4,
                      eval_per_domain=2, max_prompt_len=12, max_new_tokens=16, regen_batch=8,
                      regen_dir={regen!r}),
        draft=DraftSpec(layers=1, block_size=4, target_layer_ids=(0, 1)),
        stage1=Stage1Spec(steps=3), head_init=HeadInitSpec(steps=2),
        stage2=Stage2Spec(rounds=2, steps_per_round=1, prompts_per_round=8,
                          methods=("adaflash", "sft", "stage1_long")),
        checkpoint=CheckpointSpec(every=2),
    )
"""


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A random micro target with a byte tokenizer, prompts in two domains, a config file."""
    root = tmp_path_factory.mktemp("micro")
    target_dir = str(root / "target")
    vocab = write_byte_tokenizer(target_dir)  # its specials include <|mask|>
    cfg = target_preset("test", vocab_size=vocab, eos_token_id=256)
    save_target(TargetLM(cfg, rngs=nnx.Rngs(0)), target_dir)
    prompts = str(root / "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(24):  # stage 1 takes 4 per domain; the stage-2 pool 16 others
            rec = {"domain": "code", "prompt": f"def f{i}(x):"}
            if i % 2:
                rec = {"domain": "chat", "messages": [{"role": "user", "content": f"Hi {i}"}]}
            f.write(json.dumps(rec) + "\n")
    config = str(root / "micro.py")
    with open(config, "w") as f:
        f.write(CONFIG.format(target=target_dir, prompts=prompts, regen=str(root / "regen")))
    return config, root


def _check_export(path):
    drafter = load_drafter(path)
    assert drafter.length_head is not None and drafter.config.block_size == 4
    assert drafter.length_head.has_accept_output  # DraftSpec.accept_dim defaults to 64
    assert load_drafter(os.path.join(path, "dflash")).length_head is None  # plain layout


def test_full_micro_pipeline(micro):
    config, root = micro
    run_dir = str(root / "run")
    args = ["--config", config, "--run-dir", run_dir, "--no-progress"]
    args += ["--set", "eval.head_calibration=True"]  # after head init and every round
    assert cli.main(args) == 0
    with open(os.path.join(run_dir, "report.json")) as f:
        report = json.load(f)
    assert set(report["tau"]) == {"stage1", "adaflash", "sft", "stage1_long"}
    for per_domain in report["tau"].values():
        assert set(per_domain) == {"code", "chat"}
        assert all(1.0 <= t <= 4.0 for t in per_domain.values())
    assert report["wall_s"] > 0 and set(report["summary"]["adaflash"]) == {"mean", "cv"}
    for method in ("stage1", "adaflash", "sft", "stage1_long"):
        _check_export(os.path.join(run_dir, "export", method))
    # stage1_long trained stage 1 for its 3 steps plus the 2 × 1 stage-2 steps
    assert report["final_metrics"]["stage1_long"]["step"] == 5
    # every round collected NEW prompts: none of stage 1's, none of another round's
    assert report["stage2_pool"] == 16
    prompts = lambda d: {tuple(r[: np.argmax(m)]) for r, m in zip(d.tokens, d.loss_mask)}  # noqa: E731
    stage1 = prompts(SequenceData.load(os.path.join(root, "regen", "train")))
    rounds = [prompts(SequenceData.load(os.path.join(run_dir, "stage2", "adaflash", f"round{r}")))
              for r in (0, 1)]  # fmt: skip
    assert len(rounds[0]) == len(rounds[1]) == 8
    assert not (rounds[0] & rounds[1]) and not ((rounds[0] | rounds[1]) & stage1)
    for png in ("tau.png", "losses.png"):
        assert os.path.getsize(os.path.join(run_dir, png)) > 1000
    scalars = read_scalars(os.path.join(run_dir, "tb"))
    tags = set(scalars)
    for tag in (
        "stage1/ce",
        "stage1/ce_acc",
        "stage1/lr_drafter",
        "stage1/grad_norm",
        "stage1/tokens_per_s",
        "head_init/head_mae",
        "stage2_adaflash/kl_clipped",
        "stage2_adaflash/clip_ratio",
        "stage2_adaflash/head_mse",
        "stage2_adaflash/lr_head",
        "stage2_adaflash/collect_tau",
        "head_init/accept_bce",
        "stage2_adaflash/accept_bce",
        "head_refit_adaflash/head_mse",  # stage2.head_refit: the head fitted again
    ):
        assert tag in tags, tag
    for tag in ("head_init/accept_bce", "stage2_adaflash/accept_bce"):
        assert np.all(np.isfinite([v for _, v in scalars[tag]])), (tag, scalars[tag])
    points = ["head_init", "stage2_adaflash_round0", "stage2_adaflash_round1"]
    points += ["head_refit_adaflash", "stage2_sft_round0", "stage2_sft_round1"]
    points += ["head_refit_sft", "head_init_stage1_long"]
    calibration = report["head_calibration"]
    assert list(calibration) == points
    # the run trained and measured exactly the schedule's stages and points, in its order
    cfg = override(load_config(config), {"eval.head_calibration": "True"})
    assert list(calibration) == schedule.calibration_points(cfg)
    assert list(report["final_metrics"]) == [step.name for step in schedule.steps(cfg)]
    for entry in calibration.values():
        assert entry["blocks"] > 0 and 0 <= entry["mse"] <= 1 and 0 <= entry["width_exact"] <= 1
        assert 1 <= entry["realised_len"] <= 4 and 0 < entry["predicted_len"] < 4
    # a rerun resumes: every stage restores from its final checkpoint, same τ
    assert cli.main(args) == 0
    with open(os.path.join(run_dir, "report.json")) as f:
        again = json.load(f)
    assert again["head_calibration"] == calibration  # the saved points, read back
    for method, per_domain in report["tau"].items():
        for domain, t in per_domain.items():
            np.testing.assert_allclose(again["tau"][method][domain], t)
    # experiments.export turns a checkpoint into the same export
    from experiments import export

    out = str(root / "exported")
    assert export.main([run_dir, "--out", out]) == 0
    a, b = load_drafter(out), load_drafter(os.path.join(run_dir, "export", "adaflash"))
    np.testing.assert_array_equal(a.fc.kernel[...], b.fc.kernel[...])
    acc_a, acc_b = a.length_head.accept, b.length_head.accept
    np.testing.assert_array_equal(acc_a.proj_in.kernel[...], acc_b.proj_in.kernel[...])


def test_untrained_export(micro):
    config, root = micro
    run_dir = str(root / "run0")
    args = ["--config", config, "--run-dir", run_dir, "--stage1-steps", "0", "--rounds", "0"]
    assert cli.main([*args, "--head-steps", "0", "--no-progress"]) == 0
    _check_export(os.path.join(run_dir, "export", "stage1"))


@pytest.mark.parametrize(
    "flags,field",
    [
        (["--mesh", "3,1,1"], "mesh"),
        (["--set", "draft.mask_token_id=9999"], "draft.mask_token_id"),
        (["--set", "draft.block_size=64"], "draft.block_size"),
        (["--set", "batch_size=12"], "batch_size"),
        (["--set", "stage1.stepz=1"], "stage1.stepz"),
    ],
)
def test_bad_configs_fail_before_compute(micro, capsys, flags, field):
    config, root = micro
    run_dir = str(root / "bad")
    assert cli.main(["--config", config, "--run-dir", run_dir, *flags]) == 2
    assert field in capsys.readouterr().err
    assert not os.path.exists(run_dir)  # nothing was written


def test_init_from_plain_dflash_export(micro, capsys):
    """--init-drafter skips stage 1; a DFlash export without a length head gets a fresh one."""
    from adaflash_jax.drafter.checkpoint import save_drafter
    from adaflash_jax.drafter.init import drafter_for_target

    config, root = micro
    target_dir = str(root / "target")
    plain = drafter_for_target(
        target_dir, num_layers=1, block_size=4, target_layer_ids=(0, 1), length_head=False
    )
    dflash_dir = str(root / "dflash")
    save_drafter(plain, dflash_dir, dtype=None)
    run_dir = str(root / "run_init")
    args = ["--config", config, "--run-dir", run_dir, "--init-drafter", dflash_dir]
    # the import has no acceptance network: it gets a fresh one of the run's width
    flags = ["--rounds", "1", "--set", "draft.accept_dim=8", "--no-progress"]
    methods = ["--set", "stage2.methods=('adaflash', 'sft')"]  # stage1_long needs stage 1
    flags += methods
    flags += ["--set", "stage2.collector='engine'"]  # the fresh pool through the engine
    assert cli.main([*args, *flags]) == 0
    assert not os.path.exists(os.path.join(run_dir, "ckpt", "stage1"))
    collected = SequenceData.load(os.path.join(run_dir, "stage2", "adaflash", "round0"))
    assert len(collected) == 8 and collected.visited is not None  # decoded by the engine
    assert not os.path.exists(os.path.join(run_dir, "data", "stage2"))  # nothing regenerated
    out = load_drafter(os.path.join(run_dir, "export", "adaflash"))
    assert out.length_head is not None and out.config.length_head.accept_dim == 8
    # a trained acceptance network keeps its width: another width is refused before compute
    again = str(root / "run_again")
    args = ["--config", config, "--run-dir", again, "--init-drafter", run_dir + "/export/adaflash"]
    assert cli.main([*args, *methods, "--set", "draft.accept_dim=16", "--no-progress"]) == 2
    assert "draft.accept_dim=8" in capsys.readouterr().err and not os.path.exists(again)
    # stage 1 was skipped: the "stage1" export is the import plus its initialised head
    stage1 = load_drafter(os.path.join(run_dir, "export", "stage1"))
    np.testing.assert_allclose(
        np.asarray(stage1.fc.kernel[...], np.float32),
        np.asarray(plain.fc.kernel[...], np.float32),
        atol=1e-2,  # the export is bf16
    )


def test_sampled_and_positional_tau_in_the_report(micro):
    """The optional evaluations on an untrained run (no training compiles): sampled τ per
    temperature next to greedy τ (its "0" is the greedy table), τ by block position on the
    long-response set, both in report.json, sampled τ in tau.png."""
    config, root = micro
    run_dir = str(root / "run_extra")
    args = ["--config", config, "--run-dir", run_dir, "--stage1-steps", "0", "--rounds", "0"]
    args += ["--head-steps", "0", "--no-progress", "--set", "stage2.methods=('adaflash',)"]
    args += ["--set", "eval.temperatures=(0, 1.0)", "--set", "eval.long_new_tokens=40"]
    assert cli.main([*args, "--set", "eval.long_per_domain=1"]) == 0
    with open(os.path.join(run_dir, "report.json")) as f:
        report = json.load(f)
    sampled = report["tau_sampled"]
    assert list(sampled) == ["0", "1"] and sampled["0"] == report["tau"]
    for per_domain in sampled["1"].values():
        assert set(per_domain) == {"code", "chat"}
        assert all(1.0 <= t <= 4.0 for t in per_domain.values())
    assert set(report["summary_sampled"]["1"]["adaflash"]) == {"mean", "cv"}
    assert report["long_set"] == {"prompts": 2, "new_tokens": 40, "domains": ["code", "chat"]}
    for by_position in report["tau_by_position"].values():
        steps = by_position["steps"]
        assert list(steps) == ["0-128", "128-256", "256-512", "512+"]
        # 2 prompts of <= 12 tokens + 40 new tokens (EOS ignored): every block below 128
        assert steps["0-128"] >= 2 * 40 / 4 and sum(steps.values()) == steps["0-128"]
        assert 1.0 <= by_position["tau"]["0-128"] <= 4.0
    assert "evaluate_extra" in report["stage_seconds"]
    assert set(report["extra_seconds"]) == {"sampled", "by_position"}
