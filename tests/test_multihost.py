"""Two processes × 4 fake CPU devices (`jax.distributed` over loopback) run the distillation
pipeline's stage-2 training on one global 8-device mesh and agree with one process × 8.

Each worker (tests/multihost_worker.py) feeds only its own rows of every global batch, is
preempted after step 2 (orbax checkpoint written by both processes into one directory, as on
a shared gs:// bucket), restarts and resumes for step 3, then exports. The reference is the
same `run()` in this pytest process, on conftest's 8 devices, overlapping the workers.

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

import numpy as np
import pytest
from flax import nnx

from adaflash_jax.io.safetensors_io import SafetensorsFile
from adaflash_jax.model.checkpoint import save_target
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.target import TargetLM
from adaflash_jax.tokenizer import write_byte_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "multihost_worker.py")
TIMEOUT_S = 300  # generous: the suite shares 2 cores; a healthy run takes ~30 s


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
    cfg = TargetConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        eos_token_id=256,
    )
    save_target(TargetLM(cfg, rngs=nnx.Rngs(0)), target)
    prompts = str(root / "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(4):
            f.write(json.dumps({"domain": "code", "prompt": f"def f{i}(x):"}) + "\n")
    return target, prompts, root


def _tail(path: str, n: int = 4000) -> str:
    with open(path, errors="replace") as f:
        text = "".join(line for line in f if not line.startswith("[Gloo]"))
    return text[-n:]


def _run_workers_and_reference(world):
    target, prompts, root = world
    run_dir = str(root / "two")
    os.makedirs(run_dir)
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    logs, procs = [], []
    try:
        for i in range(2):
            logs.append(str(root / f"worker{i}.log"))
            with open(logs[-1], "w") as log:
                cmd = [sys.executable, WORKER, "--target", target, "--prompts", prompts]
                cmd += ["--run-dir", run_dir, "--process-id", str(i), "--num-processes", "2"]
                cmd += ["--port", str(port), "--local-devices", "4"]
                procs.append(
                    subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        ref_dir = str(root / "one")
        os.makedirs(ref_dir)
        reference = _load_worker().run(target, prompts, ref_dir)  # meanwhile, in-process
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        codes = ["timeout"] * 2
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = "\n".join(
        f"--- worker {i} (exit {c}) ---\n{_tail(logs[i])}" for i, c in enumerate(codes)
    )
    if codes != [0, 0]:
        pytest.fail(f"multi-process workers failed:\n{report}")
    return reference, ref_dir, run_dir, report, logs


@pytest.fixture(scope="module")
def runs(world):
    return _run_workers_and_reference(world)


def test_two_processes_match_one_process(runs):
    reference, _, run_dir, report, _ = runs
    with open(os.path.join(run_dir, "result.json")) as f:
        got = json.load(f)
    assert (got["process_count"], got["devices"]) == (2, 8), report
    assert (reference["process_count"], reference["devices"]) == (1, 8)
    want_steps = [s for s, _ in reference["losses"]]
    assert want_steps == [1, 2, 3], reference["losses"]
    assert [s for s, _ in got["losses"]] == want_steps, (got["losses"], report)
    np.testing.assert_allclose(
        [v for _, v in got["losses"]], [v for _, v in reference["losses"]], rtol=2e-5, atol=0
    )
    assert got["collect_tau"] == pytest.approx(reference["collect_tau"])


def test_each_process_feeds_its_own_rows(runs):
    """Process p's first local batch is rows p, p+2, ... of the single-process global batch."""
    reference, _, run_dir, _, _ = runs
    rows = reference["first_rows"]
    for p in range(2):
        with open(os.path.join(run_dir, f"process{p}.json")) as f:
            assert json.load(f)["first_rows"] == rows[p::2], p


def test_checkpoints_logs_and_export(runs):
    _, ref_dir, run_dir, _, logs = runs
    ckpt = os.path.join(run_dir, "ckpt", "stage2_adaflash")
    assert sorted(n for n in os.listdir(ckpt) if n.isdigit()) == ["2", "3"]  # preempt, end
    events = [n for n in os.listdir(os.path.join(run_dir, "tb")) if "tfevents" in n]
    assert len(events) == 1, events  # only process 0 logs
    bars = ["stage2_adaflash" in _tail(log, n=10**7) for log in logs]
    assert bars == [True, False]  # progress bars: process 0 only
    assert os.path.isfile(os.path.join(run_dir, "stage2", "adaflash", "round0", "meta.json"))
    a = SafetensorsFile(os.path.join(ref_dir, "export", "model.safetensors"))
    b = SafetensorsFile(os.path.join(run_dir, "export", "model.safetensors"))
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():  # exported in bfloat16: allow a rounding flip
        x, y = (np.asarray(f.get(name), np.float32) for f in (a, b))
        np.testing.assert_allclose(y, x, rtol=1e-2, atol=1e-6, err_msg=name)
