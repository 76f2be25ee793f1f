"""Device mesh and multi-process start-up for training.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with fully sharded weights and
optimizer state), `tensor` (weights split inside each layer). Axes are explicitly
`AxisType.Auto`: jax >= 0.10 defaults to Explicit axes, which would demand sharding-aware
code everywhere; Auto lets XLA propagate the shardings fixed at the jit boundary.
"""

from __future__ import annotations

import logging
import os
import sys

import jax
from jax.sharding import Mesh

from adaflash_jax.train.mesh_shape import AXES, fill_mesh

log = logging.getLogger(__name__)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all). One axis may be -1 (fill)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = fill_mesh((data, fsdp, tensor), len(devices))
    return jax.make_mesh(
        shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES), devices=devices
    )


_MULTI_PROCESS_ENV = (
    "COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_ADDRESS",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


def _detected_multi_process() -> bool:
    if any(os.environ.get(v) for v in _MULTI_PROCESS_ENV):
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return True
    for v in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(os.environ.get(v, "1") or 1) > 1:
            return True
    return False


def maybe_initialize_distributed(
    force: bool | None = None,
    *,
    init_timeout_s: int = 300,
    heartbeat_timeout_s: int = 60,
    shutdown_timeout_s: int = 300,
) -> bool:
    """Calls `jax.distributed.initialize()` for multi-process runs; a no-op otherwise.

    force=True always initializes, force=False never does, None detects a multi-process
    launch from the environment (coordinator address, multi-host TPU, SLURM, Open MPI).
    The timeouts go to the distributed runtime (the distill config's `distributed` section;
    docs/design.md §4.4): a process silent for `heartbeat_timeout_s` is declared lost and
    the runtime ends every other process. Returns whether this call initialized the
    distributed runtime. Must run before any other jax call that touches devices.
    """
    wanted = _detected_multi_process() if force is None else force
    if not wanted:
        return False
    if jax.distributed.is_initialized():
        return False
    # jax reads the coordinator from the environment but not the process count or id;
    # local multi-process launches pass them as JAX_NUM_PROCESSES / JAX_PROCESS_ID.
    kwargs = {}
    if os.environ.get("JAX_NUM_PROCESSES") and os.environ.get("JAX_PROCESS_ID"):
        kwargs = dict(
            coordinator_address=os.environ.get("JAX_COORDINATOR_ADDRESS"),
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    jax.distributed.initialize(
        **kwargs,
        initialization_timeout=init_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s,
    )
    log.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
    return True


# What a cross-process computation raises when the process at the other end died: gloo
# (CPU) and gRPC/coordination-service wordings. A TPU collective does not fail, it waits;
# the runtime's heartbeat timeout then ends the process with its own message.
PEER_LOST_MARKERS = (
    "closed by peer",
    "reset by peer",
    "Socket closed",
    "Connection refused",
    "heartbeat",
    "UNAVAILABLE",
)
PEER_LOST_EXIT = 3


def is_peer_loss(error: BaseException) -> bool:
    """Whether `error`, on a multi-process run, is a cross-process computation that failed
    because a peer process is gone."""
    if jax.process_count() == 1:
        return False
    return any(m.lower() in str(error).lower() for m in PEER_LOST_MARKERS)


def exit_on_peer_loss(error: BaseException) -> None:
    """Ends this process at once, with one line, when `error` is a lost peer (`is_peer_loss`);
    returns otherwise. `os._exit` skips the runtime's exit barrier, which would wait for the
    dead peer until the heartbeat timeout and then abort with a C++ stack trace."""
    if not is_peer_loss(error):
        return
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    print(
        f"stopped: process {jax.process_index()} of {jax.process_count()} lost a peer process "
        f"(a cross-process computation failed: {first.strip()[:300]}); the other processes' "
        "logs name the one that died; restart all of them with the same run directory to "
        "resume from the last checkpoint",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(PEER_LOST_EXIT)
