"""SIGTERM on ONE process of a two-process run: JAX's preemption service (through orbax's
`reached_preemption`) stops both at one agreed step, orbax saves there (grain's position
file per process included), and a restart continues each process's batches exactly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np

from adaflash_jax.data.loader import batch_iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "preemption_worker.py")
SIGTERM_AT, TOTAL = 3, 40


def _pair(run_dir, *extra):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # os.environ carries conftest's XLA_FLAGS (faster XLA:CPU compiles) to the workers
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, run_dir, str(i), str(port), *extra],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    results = []
    for i in range(2):
        with open(os.path.join(run_dir, f"process{i}.json")) as f:
            results.append(json.load(f))
    return results


def test_sigterm_on_one_process_stops_both_at_one_step_and_resumes_exactly(tmp_path):
    run_dir = str(tmp_path)
    first = _pair(run_dir, "--sigterm-at", str(SIGTERM_AT))
    stop = first[0]["stopped_at"]
    assert stop is not None and stop == first[1]["stopped_at"], first  # one agreed step
    assert SIGTERM_AT <= stop < TOTAL
    step_dir = os.path.join(run_dir, "ckpt", str(stop))
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(
        os.listdir(os.path.join(step_dir, "data"))
    )
    second = _pair(run_dir)
    for p in range(2):
        assert second[p]["stopped_at"] is None
        steps = {**first[p]["steps"], **second[p]["steps"]}
        assert sorted(map(int, second[p]["steps"])) == list(range(stop + 1, TOTAL + 1))
        it = batch_iterator([{"x": np.int64(i)} for i in range(10)], global_batch=4, seed=3,
                            process_index=p, process_count=2)  # fmt: skip
        want = [next(it)["x"].tolist() for _ in range(TOTAL)]
        assert [steps[str(k)] for k in range(1, TOTAL + 1)] == want
