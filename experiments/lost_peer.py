"""How long a survivor lives after its peer dies: two CPU processes start `jax.distributed`
(loopback, `--heartbeat` seconds), then one SIGKILLs itself while the other waits OUTSIDE any
collective (as a process waits in a TPU collective, which never reports a dead peer): only
the distributed runtime's heartbeat can end the survivor. Runs with the victim being
process 1 (the survivor hosts the coordination service) and process 0 (the coordinator
dies); prints the seconds from the kill to the survivor's exit and its exit code.

    JAX_PLATFORMS=cpu python -m experiments.lost_peer [--heartbeat 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time


def _process(process_id: int, port: int, victim: int, heartbeat: int) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
    os.environ["JAX_NUM_PROCESSES"], os.environ["JAX_PROCESS_ID"] = "2", str(process_id)
    import jax

    from adaflash_jax.train.mesh import maybe_initialize_distributed

    jax.config.update("jax_num_cpu_devices", 1)
    maybe_initialize_distributed(True, init_timeout_s=60, heartbeat_timeout_s=heartbeat)
    time.sleep(2)
    if process_id == victim:
        print(json.dumps({"killed_at": time.time()}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # the survivor: no collective, nothing that would notice the death itself
        time.sleep(0.05)


def _pair(victim: int, heartbeat: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "experiments.lost_peer", "--heartbeat", str(heartbeat)]
    procs = [
        subprocess.Popen(
            [*cmd, "--as-process", str(i), "--port", str(port), "--victim", str(victim)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    survivor = procs[1 - victim]
    killed_at = json.loads(procs[victim].stdout.readline())["killed_at"]
    try:
        code = survivor.wait(timeout=10 * heartbeat + 60)
    except subprocess.TimeoutExpired:
        survivor.kill()
        code = "hung"
    ended = time.time()
    for p in procs:
        p.wait()
    return {"victim": victim, "survivor_exit_s": round(ended - killed_at, 1), "exit": code}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heartbeat", type=int, default=10, help="heartbeat timeout, seconds")
    p.add_argument("--as-process", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--victim", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from adaflash_jax.cli import one_line_errors

    with one_line_errors():
        if args.as_process is not None:
            _process(args.as_process, args.port, args.victim, args.heartbeat)
        out = [_pair(victim, args.heartbeat) for victim in (1, 0)]
    for row in out:
        print(json.dumps({"heartbeat_timeout_s": args.heartbeat, **row}))
    return out


if __name__ == "__main__":
    main()
