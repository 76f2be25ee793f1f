"""What a run directory records about itself (issue 43): the recipe a resume must keep
(`distill.resume`, through `python -m experiments.distill`), and the README each export
directory gets (`python -m experiments.export`)."""

import contextlib
import io
import json
import os
import signal

import pytest
from test_distill_e2e import micro  # noqa: F401 - the module's micro target, prompts, config

from adaflash_jax.distill import resume
from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.overrides import override
from adaflash_jax.distill.stage_config import Stage2Spec
from adaflash_jax.train.checkpointing import PreemptionGuard
from experiments import distill as cli

# an untrained-but-one-step run: stage 1 only, no head steps, no stage-2 rounds
FLAGS = ["--no-progress", "--head-steps", "0", "--rounds", "0"]
FLAGS += ["--set", "stage2.methods=('adaflash',)"]


def _distill(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, err.getvalue()


def _read(path):
    with open(path) as f:
        return f.read()


@pytest.fixture(scope="module")
def workflow(micro):  # noqa: F811
    """A run preempted at its first stage-1 step (SIGTERM as the guard starts), then the
    command retyped with another --stage1-steps (refused), the same with
    --allow-config-change (resumes), then a safe change alone (an eval.* field)."""
    config, root = micro
    run_dir = str(root / "resumed")
    base = ["--config", config, "--run-dir", run_dir, *FLAGS]
    enter = PreemptionGuard.__enter__

    def sigterm_on_enter(self):
        guard = enter(self)
        os.kill(os.getpid(), signal.SIGTERM)  # the guard's handler turns it into its flag
        return guard

    out = {"run_dir": run_dir}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PreemptionGuard, "__enter__", sigterm_on_enter)
        out["preempted"] = _distill([*base, "--stage1-steps", "1"])
    out["config_after_preempt"] = json.loads(_read(os.path.join(run_dir, "config.json")))
    out["refused"] = _distill([*base, "--stage1-steps", "2"])
    out["config_after_refusal"] = json.loads(_read(os.path.join(run_dir, "config.json")))
    out["changes_after_refusal"] = os.path.exists(os.path.join(run_dir, resume.CHANGES_FILE))
    out["allowed"] = _distill([*base, "--stage1-steps", "2", "--allow-config-change"])
    out["report_allowed"] = json.loads(_read(os.path.join(run_dir, "report.json")))
    out["safe"] = _distill([*base, "--stage1-steps", "2", "--set", "eval.slots=8"])
    return out


def test_a_preempted_run_refuses_a_retyped_command_with_another_recipe(workflow):
    assert workflow["preempted"][0] == 143, workflow["preempted"][1][-2000:]
    assert workflow["config_after_preempt"]["stage1"]["steps"] == 1
    status, err = workflow["refused"]
    assert status == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert "stage1.steps 1 -> 2" in lines[0] and "--allow-config-change" in lines[0]
    assert "eval" not in lines[0]  # only the differing field is named
    # nothing was changed: the recorded recipe stays, no change was recorded
    assert workflow["config_after_refusal"] == workflow["config_after_preempt"]
    assert not workflow["changes_after_refusal"]


def test_allow_config_change_resumes_and_records_the_change(workflow):
    status, err = workflow["allowed"]
    assert status == 0, err[-2000:]
    # the resumed stage 1 trained to the new total
    assert workflow["report_allowed"]["final_metrics"]["stage1"]["step"] == 2
    run_dir = workflow["run_dir"]
    records = [json.loads(x) for x in _read(os.path.join(run_dir, resume.CHANGES_FILE)).split("\n")
               if x]  # fmt: skip
    assert records[0]["accepted"] == "allowed"
    assert records[0]["changes"] == {"stage1.steps": {"old": 1, "new": 2}}
    # a safe change (an eval.* field) resumes without the flag, and is recorded too
    status, err = workflow["safe"]
    assert status == 0, err[-2000:]
    assert len(records) == 2 and records[1]["accepted"] == "safe"
    assert records[1]["changes"] == {"eval.slots": {"old": 16, "new": 8}}
    stored = json.loads(_read(os.path.join(run_dir, "config.json")))
    assert stored["stage1"]["steps"] == 2 and stored["eval"]["slots"] == 8


def _unsafe(cfg, **sets):
    return resume.unsafe_changes(resume.resolved(cfg), resume.resolved(override(cfg, sets)))


def test_which_changes_are_safe():
    cfg = RunConfig()
    assert _unsafe(cfg, **{"eval.temperatures": "(0, 1.0)", "log_every": "5"}) == {}
    assert _unsafe(cfg, **{"checkpoint.every": "7", "distributed.init_timeout_s": "9"}) == {}
    assert _unsafe(cfg, run_dir="'runs/x'") == {}  # --set run_dir= then --run-dir: one place
    assert list(_unsafe(cfg, **{"seed": "1", "eval.slots": "4"})) == ["seed"]
    # more rounds: safe only when no stage follows them (head re-fit, stage1_long)
    assert list(_unsafe(cfg, **{"stage2.rounds": "3"})) == ["stage2.rounds"]
    plain = override(cfg, {"stage2.head_refit": "False"})
    assert _unsafe(plain, **{"stage2.rounds": "3"}) == {}
    assert list(_unsafe(plain, **{"stage2.rounds": "1"})) == ["stage2.rounds"]  # fewer
    long = RunConfig(stage2=Stage2Spec(head_refit=False, methods=("adaflash", "stage1_long")))
    assert list(_unsafe(long, **{"stage2.rounds": "3"})) == ["stage2.rounds"]
    # a field only one side has (a config.json from another version) is a difference
    old = {**resume.resolved(cfg), "retired": 1}
    assert resume.unsafe_changes(old, resume.resolved(cfg)) == {"retired": (1, resume.MISSING)}


def _export(capfd, argv) -> tuple[str, list[str]]:
    from experiments import export as export_cli

    assert export_cli.main(argv) == 0
    err = capfd.readouterr().err
    return err, [line for line in err.splitlines() if line.strip()]


def test_each_export_explains_itself(workflow, capfd, caplog):
    """`--for vllm` from the run's checkpoint: a README.md with the stack, the version read,
    its launch command at the export's K, the length head it leaves out and the run's τ; the
    drop is the first `warning:` line; orbax's absl records never reach a handler (pytest's
    own catches them from stderr, so `caplog` is where they would show)."""
    from adaflash_jax.drafter.serving import SERVING, render

    run_dir = workflow["run_dir"]
    report = json.loads(_read(os.path.join(run_dir, "report.json")))
    out = os.path.join(run_dir, "for-vllm")
    with caplog.at_level("INFO"):
        err, lines = _export(capfd, [run_dir, "--for", "vllm", "--out", out])
    assert not [r.getMessage() for r in caplog.records if "orbax" in r.pathname]
    assert lines and all(line.startswith("warning: ") for line in lines), err
    assert lines[0].startswith("warning: --for vllm leaves out the length head"), err
    assert "absl" not in err and "orbax" not in err.lower(), err
    readme = _read(os.path.join(out, "README.md"))
    assert readme.startswith("# DFlash drafter for vLLM (GPU)")
    assert "the PyPI wheel vllm==0.34.0" in readme and "layout: plain DFlash" in readme
    assert '"num_speculative_tokens": 3}' in readme  # K − 1 at the export's K = 4
    assert render(SERVING["vllm"].launch, 4) in readme
    left_out = readme.split("## Left out")[1].split("##")[0]
    assert "the length head" in left_out
    tau = report["tau"]["stage1"]  # the checkpoint exported is stage 1's
    mean = sum(tau.values()) / len(tau)
    assert f"τ {mean:.3f}" in readme and all(f"{d} {t:.3f}" in readme for d, t in tau.items())
    assert "checkpoint `stage1` step 2" in readme

    # tpu-inference names the wheel CI runs; the AdaFlash layout drops nothing
    out = os.path.join(run_dir, "for-tpu")
    _export(capfd, [os.path.join(run_dir, "export", "adaflash"), "--for", "tpu-inference",
                    "--out", out])  # fmt: skip
    assert "tpu-inference==0.32.0" in _read(os.path.join(out, "README.md"))
    out = os.path.join(run_dir, "for-adaflash")
    err, _ = _export(capfd, [os.path.join(run_dir, "export", "adaflash"), "--out", out])
    assert "leaves out" not in err, err
    readme = _read(os.path.join(out, "README.md"))
    assert "nothing: our engine reads it all" in readme
    assert "`adaflash` drafter" in readme  # an export directory of the run: its method's τ
    # the run's own export says so too, with the τ its report holds
    readme = _read(os.path.join(run_dir, "export", "adaflash", "README.md"))
    tau = report["tau"]["adaflash"]
    assert f"τ {sum(tau.values()) / len(tau):.3f}" in readme and "`dflash/`" in readme


def test_an_export_outside_a_run_says_tau_was_not_measured(tmp_path, capfd):
    from flax import nnx

    from adaflash_jax.drafter.checkpoint import save_drafter
    from adaflash_jax.drafter.config import DrafterConfig
    from adaflash_jax.drafter.model import Drafter
    from adaflash_jax.model.presets import target_preset

    cfg = DrafterConfig.for_target(
        target_preset("test", vocab_size=96), mask_token_id=95, num_layers=1, block_size=4
    )
    save_drafter(Drafter(cfg, rngs=nnx.Rngs(0)), tmp_path / "d")
    out = str(tmp_path / "sg")
    _, lines = _export(capfd, [str(tmp_path / "d"), "--for", "sglang-jax", "--out", out])
    assert lines[0].startswith("warning: --for sglang-jax leaves out the length head")
    readme = _read(os.path.join(out, "README.md"))
    assert "Not measured" in readme and "commit cddbf6f1" in readme
    assert "--speculative-num-draft-tokens 4" in readme


def test_docs_quote_the_library_launch_commands():
    """docs/serving.md and the export READMEs show the same commands (at K = 16)."""
    from adaflash_jax.drafter.serving import SERVING, render

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = _read(os.path.join(root, "docs", "serving.md"))
    for s in SERVING.values():
        assert render(s.launch, 16) in docs, s.stack
        if s.head_launch is not None:
            assert render(s.head_launch[1], 16) in docs, s.stack
