"""Two processes × 4 fake CPU devices (`jax.distributed` over loopback) run the distillation
pipeline's stage-2 training on one global 8-device mesh and agree with one process × 8.

Each worker (tests/multihost_worker.py) feeds only its own rows of every global batch, is
preempted after step 2 (orbax checkpoint written by both processes into one directory, as on
a shared gs:// bucket) and restarts the stage; there process 1 dies (kill -9) before step 3,
and process 0 must end at once with one line instead of hanging in the step's collective.
Both are launched again, resume from the step-2 checkpoint for step 3, then export. The
reference is the same `run()` in this pytest process, on conftest's 8 devices, uninterrupted
but for its in-process preemption, overlapping the first launch.

Tolerance: per-step losses rtol 2e-5. The two runs see the same global batch with its rows
in another order (process p holds samples p, p+2, ...) and all-reduce across processes through
gloo, so only float summation order differs (observed ≤ 3e-7 relative); a wrong row, a missing
gradient all-reduce or a bad restore moves the loss by ≥ 1e-3.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

from adaflash_jax.io.safetensors_io import SafetensorsFile
from adaflash_jax.model.checkpoint import save_target
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from adaflash_jax.tokenizer import write_byte_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "multihost_worker.py")
TIMEOUT_S = 300  # generous: the suite shares 2 cores; a healthy run takes ~30 s
PEER_LOST_EXIT = 3  # train.mesh.PEER_LOST_EXIT
LOST_PEER_BOUND_S = 120  # docs/design.md §4.4: a lost peer ends the others within 2 minutes


def _load_worker():
    spec = importlib.util.spec_from_file_location("multihost_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A random 2-layer D=32 target with a byte tokenizer (V=260) and a prompt file."""
    root = tmp_path_factory.mktemp("multihost")
    target = str(root / "target")
    vocab = write_byte_tokenizer(target)
    cfg = target_preset("test", vocab_size=vocab, eos_token_id=256)
    save_target(TargetLM(cfg, rngs=nnx.Rngs(0)), target)
    prompts = str(root / "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(4):
            f.write(json.dumps({"domain": "code", "prompt": f"def f{i}(x):"}) + "\n")
    return target, prompts, root


def _flat(tree, prefix="") -> dict:
    """Nested dicts/lists of numbers → {"a/b": x} (pytest.approx takes no nesting)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out = {}
    for k, v in items:
        if isinstance(v, dict | list):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _tail(path: str, n: int = 4000) -> str:
    with open(path, errors="replace") as f:
        text = "".join(line for line in f if not line.startswith("[Gloo]"))
    return text[-n:]


def _launch_pair(root, name: str, args: list[str], reference=None, expect=(0, 0)):
    """Two workers (`args` + their process ids) while `reference()` runs in this process;
    returns (reference's result, worker logs, each worker's exit time). Fails with both
    workers' output unless their exit codes are `expect`."""
    port = _free_port()
    # os.environ carries conftest's XLA_FLAGS (faster XLA:CPU compiles) to the workers
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    logs, procs, codes, ended = [], [], ["not started"] * 2, [None, None]
    result = None
    try:
        for i in range(2):
            logs.append(str(root / f"{name}_worker{i}.log"))
            cmd = [sys.executable, WORKER, *args, "--process-id", str(i), "--num-processes", "2"]
            cmd += ["--port", str(port), "--local-devices", "4"]
            with open(logs[-1], "w") as log:
                procs.append(
                    subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        if reference is not None:
            result = reference()
        deadline = time.time() + TIMEOUT_S
        while time.time() < deadline and None in ended:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.1)
        codes = [p.poll() if p.poll() is not None else "timeout" for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != list(expect):
        report = "\n".join(
            f"--- worker {i} (exit {c}) ---\n{_tail(log)}"
            for i, (c, log) in enumerate(zip(codes, logs))
        )
        pytest.fail(f"multi-process workers ended {codes}, not {list(expect)}:\n{report}")
    return result, logs, ended


def _run_workers_and_reference(world):
    """The reference (one process, uninterrupted but for an in-process preemption) overlaps
    the first two-process launch, in which process 1 dies (SIGKILL) in the resumed stage;
    a second launch of both resumes from the last checkpoint and finishes."""
    target, prompts, root = world
    run_dir, ref_dir = str(root / "two"), str(root / "one")
    os.makedirs(run_dir)
    os.makedirs(ref_dir)
    args = ["--target", target, "--prompts", prompts, "--run-dir", run_dir]
    reference, kill_logs, ended = _launch_pair(
        root, "kill", [*args, "--phase", "kill"],
        lambda: _load_worker().run(target, prompts, ref_dir), expect=(PEER_LOST_EXIT, -9),
    )  # fmt: skip
    with open(os.path.join(run_dir, "killed_at.json")) as f:
        killed_at = json.load(f)["time"]
    _, logs, _ = _launch_pair(root, "resume", [*args, "--phase", "resume"])
    lost = {"survivor_exit_s": ended[0] - killed_at, "survivor_log": kill_logs[0]}
    return reference, ref_dir, run_dir, logs, lost


@pytest.fixture(scope="module")
def runs(world):
    return _run_workers_and_reference(world)


def test_a_lost_peer_ends_the_survivor_with_one_line(runs):
    """Process 1 died (kill -9) mid-stage: process 0 exited with code 3 and one line saying
    it lost a peer, within the bound of docs/design.md §4.4 (at most the heartbeat timeout
    after the death; here a collective reports the dead peer at once)."""
    *_, lost = runs
    with open(lost["survivor_log"], errors="replace") as f:
        lines = [line for line in f.read().splitlines() if "lost a peer process" in line]
    assert len(lines) == 1 and lines[0].startswith("stopped: process 0 of 2"), lines
    print(f"survivor exited {lost['survivor_exit_s']:.1f} s after its peer died")
    assert lost["survivor_exit_s"] <= LOST_PEER_BOUND_S


def test_two_processes_match_one_process(runs):
    reference, _, run_dir, *_ = runs
    with open(os.path.join(run_dir, "result.json")) as f:
        got = json.load(f)
    assert (got["process_count"], got["devices"]) == (2, 8)
    assert (reference["process_count"], reference["devices"]) == (1, 8)
    want_steps = [s for s, _ in reference["losses"]]
    assert want_steps == [1, 2, 3], reference["losses"]
    assert [s for s, _ in got["losses"]] == want_steps, got["losses"]
    np.testing.assert_allclose(
        [v for _, v in got["losses"]], [v for _, v in reference["losses"]], rtol=2e-5, atol=0
    )
    assert _flat(got["collect_tau"]) == pytest.approx(_flat(reference["collect_tau"]))


def test_each_process_feeds_its_own_rows(runs):
    """Process p's first local batch is rows p, p+2, ... of the single-process global batch."""
    reference, _, run_dir, *_ = runs
    rows = reference["first_rows"]
    for p in range(2):
        with open(os.path.join(run_dir, f"process{p}.json")) as f:
            assert json.load(f)["first_rows"] == rows[p::2], p


def test_checkpoints_logs_and_export(runs):
    _, ref_dir, run_dir, logs, _ = runs
    ckpt = os.path.join(run_dir, "ckpt", "stage2_adaflash")
    assert sorted(n for n in os.listdir(ckpt) if n.isdigit()) == ["2", "3"]  # preempt, end
    events = [n for n in os.listdir(os.path.join(run_dir, "tb")) if "tfevents" in n]
    assert len(events) == 2, events  # only process 0 logs: one file per launch
    bars = ["stage2_adaflash" in _tail(log, n=10**7) for log in logs]
    assert bars == [True, False]  # progress bars: process 0 only
    assert os.path.isfile(os.path.join(run_dir, "stage2", "adaflash", "round0", "meta.json"))
    a = SafetensorsFile(os.path.join(ref_dir, "export", "model.safetensors"))
    b = SafetensorsFile(os.path.join(run_dir, "export", "model.safetensors"))
    assert sorted(a.keys()) == sorted(b.keys())
    # Exported in bfloat16: allow a rounding flip. Adam scales each element's step to about
    # lr (3e-3) whatever its gradient, so an element whose gradient is near zero moves by
    # reduction-order noise times up to lr: allow 1e-4 absolute (parameters are ~2e-2).
    for name in a.keys():
        x, y = (np.asarray(f.get(name), np.float32) for f in (a, b))
        np.testing.assert_allclose(y, x, rtol=1e-2, atol=1e-4, err_msg=name)


PIPELINE_CONFIG = """
from adaflash_jax.distill.config import *

def get_config():
    return RunConfig(
        name="multihost", target_path={target!r}, mesh=(1, 4, 2), batch_size=8, seq_len=32,
        num_anchors=4, log_every=1,
        data=DataSpec(train_prompts={prompts!r}, eval_prompts={prompts!r}, train_per_domain=4,
                      eval_per_domain=2, max_prompt_len=12, max_new_tokens=16, regen_batch=8),
        draft=DraftSpec(layers=1, block_size=4, target_layer_ids=(0, 1)),
        stage1=Stage1Spec(steps=2), head_init=HeadInitSpec(steps=1),
        stage2=Stage2Spec(rounds=1, steps_per_round=1, prompts_per_round=8),
        checkpoint=CheckpointSpec(every=2),
    )
"""


@pytest.mark.skipif(
    not os.environ.get("ADAFLASH_MULTIHOST_PIPELINE"),
    reason="opt-in (~2-4 min on 2 cores): set ADAFLASH_MULTIHOST_PIPELINE=1",
)
def test_whole_distill_pipeline_two_processes(world):
    """`experiments.distill` end to end (regenerate → stage 1 → head init → adaflash/sft →
    τ → exports → report) in 2 processes equals the 1-process run."""
    from experiments import distill

    target, prompts, root = world
    config = str(root / "pipeline.py")
    with open(config, "w") as f:
        f.write(PIPELINE_CONFIG.format(target=target, prompts=prompts))
    two, one = str(root / "pipe_two"), str(root / "pipe_one")
    args = ["--pipeline", config, "--run-dir", two]
    rc, logs, _ = _launch_pair(
        root, "pipeline", args, lambda: distill.main(["--config", config, "--run-dir", one])
    )
    assert rc == 0
    reports = []
    for d in (one, two):
        with open(os.path.join(d, "report.json")) as f:
            reports.append(json.load(f))
    want, got = reports
    assert _flat(got["tau"]) == pytest.approx(_flat(want["tau"]))
    assert set(got["final_metrics"]) == set(want["final_metrics"])
    for stage, metrics in want["final_metrics"].items():
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(
                got["final_metrics"][stage][key], metrics[key], rtol=2e-5, err_msg=stage
            )
    assert sorted(os.listdir(os.path.join(two, "export"))) == sorted(got["exports"])
    assert len([n for n in os.listdir(os.path.join(two, "tb")) if "tfevents" in n]) == 1
    printed = ["wall time" in _tail(log, n=10**7) for log in logs]
    assert printed == [True, False]  # the report table: process 0 only


def test_checkpointer_keeps_gs_paths(monkeypatch):
    """Orbax must receive the gs:// URL unchanged (no bucket is contacted here)."""
    from adaflash_jax.train import checkpointing

    seen = {}

    class Recorder:
        def __init__(self, directory, *args, **kwargs):
            seen["directory"] = str(directory)

    monkeypatch.setattr(checkpointing.ocp, "CheckpointManager", Recorder)
    checkpointing.Checkpointer("gs://bucket/runs/x/ckpt/stage1", save_every=1)
    assert seen["directory"] == "gs://bucket/runs/x/ckpt/stage1"
