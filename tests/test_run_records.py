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
