"""One process of the multi-host distillation check (launched by tests/test_multihost.py).

    python tests/multihost_worker.py --target DIR --prompts FILE --run-dir DIR \
        --process-id I --num-processes 2 --port P --local-devices 4

Runs the pipeline's own training machinery (`distill.context.prepare`, `stages.Trainer`,
grain's `batch_iterator` with this process's rows, orbax checkpoints, process-0 TensorBoard/export)
on a global (data, fsdp, tensor) mesh:

  stage 2 (AdaFlash: clipped RKL + CE + length-head MSE), one round: greedy replay
  collection with the fresh drafter (process 0 saves the round's data), then 3 train steps,
  preempted before step 3 (checkpoint saved), restarted with a freshly loaded target and
  resumed from the checkpoint (data position and round included) for step 3;
  export of the final drafter (gathered from all processes, written by process 0).

`--phase kill` stops after the resume's restore: process 1 kills itself (SIGKILL, after
writing `<run-dir>/killed_at.json`) before step 3, so process 0 meets a dead peer in step 3's
collective and must exit at once with one line (`train.mesh.exit_on_peer_loss`, exit 3).
`--phase resume` then restarts both from the step-2 checkpoint for step 3 and the export.

Stage 1 and head init use the same loop, batches and checkpointing with a subset of the
stage-2 computation; they are left out to keep the check's compile time down.

Process 0 writes `<run-dir>/result.json` (losses per step, collected τ, export path); every
process writes `<run-dir>/process<I>.json` (checksums of the rows it fed in its first batch).
With `--num-processes 1` (or `run()` called in-process) it is the single-process reference.

`--pipeline CONFIG` instead runs the whole `python -m experiments.distill --config CONFIG`
(regenerate, stage 1, head init, stage-2 methods, τ evaluation, exports, report) in this
process of the group; the opt-in `ADAFLASH_MULTIHOST_PIPELINE=1` test uses it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib

MESH = (1, 4, 2)  # fsdp spans both processes (4 devices each), tensor stays inside one
STOP_AT = 2  # steps done when the fake preemption hits
# The runtime's timeouts here (the config's `distributed` section on real runs): short, so a
# lost peer that a collective does not report still ends the survivor quickly; long enough
# for a heartbeat thread on a loaded 2-core machine.
HEARTBEAT_S, SHUTDOWN_S = 15, 120


def micro_config(target_dir: str, prompts: str, run_dir: str):
    from adaflash_jax.distill import config as C

    return C.RunConfig(
        name="multihost",
        target_path=target_dir,
        run_dir=run_dir,
        mesh=MESH,
        batch_size=8,
        seq_len=32,
        num_anchors=4,
        log_every=1,
        data=C.DataSpec(train_prompts=prompts, eval_prompts=prompts, max_prompt_len=12),
        draft=C.DraftSpec(layers=1, block_size=4, target_layer_ids=(0, 1)),
        stage1=C.Stage1Spec(steps=0),
        head_init=C.HeadInitSpec(steps=0),
        stage2=C.Stage2Spec(
            rounds=1,
            steps_per_round=3,
            prompts_per_round=8,
            lr=3e-3,
            methods=("adaflash",),
            pool="stage1",  # the micro data below stands in for the pool
        ),
        checkpoint=C.CheckpointSpec(every=100, keep=2),
    )


def micro_data(vocab: int, pad_id: int):
    """12 sequences: an 8-token prompt, then a response of varying length, then padding."""
    import numpy as np

    from adaflash_jax.distill.batches import SequenceData

    m, s = 12, 32
    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, min(vocab, 256), (m, s)).astype(np.int32)
    mask = np.zeros((m, s), bool)
    for i in range(m):
        end = s - (i % 5)
        mask[i, 8:end] = True
        tokens[i, end:] = pad_id
    return SequenceData(
        tokens=tokens, loss_mask=mask, domain=(np.arange(m) % 2).astype(np.int32),
        domains=("code", "chat"),
    )  # fmt: skip


class StopAfter:
    """A preemption guard whose stop request arrives before step `n` (same step everywhere)."""

    def __init__(self, n: int):
        self.n, self.checks = n, 0

    @property
    def should_stop(self) -> bool:
        self.checks += 1
        return self.checks > self.n


class KillBeforeNextStep:
    """A guard that SIGKILLs process 1 the first time the loop asks it (process 0 goes on)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    @property
    def should_stop(self) -> bool:
        import signal
        import time

        import jax

        if jax.process_index() == 1:
            with open(os.path.join(self.run_dir, "killed_at.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        return False


def row_checksums(tokens) -> list[int]:
    import numpy as np

    return [zlib.crc32(np.ascontiguousarray(r).tobytes()) for r in tokens]


def run(target_dir: str, prompts: str, run_dir: str, phase: str = "all") -> dict | None:
    """phase "all": preempted at step 2, resumed in-process to the end; "kill": preempted at
    step 2, then process 1 dies in the resumed stage (returns only if nothing failed, which
    is an error); "resume": from the latest checkpoint to the end."""
    import jax
    from flax import nnx

    from adaflash_jax.distill.context import prepare
    from adaflash_jax.distill.export import export_drafter
    from adaflash_jax.distill.loop import Preempted
    from adaflash_jax.distill.stages import Stage2Pool, Trainer
    from adaflash_jax.distill.state import fresh_drafter
    from adaflash_jax.model.checkpoint import load_target
    from adaflash_jax.sharding.rules import TRAIN_RULES
    from adaflash_jax.train.tensorboard import ScalarWriter, read_scalars

    ctx = prepare(micro_config(target_dir, prompts, run_dir), progress=True)  # bars: process 0
    mesh = ctx.mesh()
    data = micro_data(ctx.target_cfg.vocab_size, ctx.pad_id)
    pool = Stage2Pool.of(data, [[]] * len(data))  # replay collection reads the sequences only

    def trainer(writer, guard):
        # A fresh target each time, as a restarted process would load it: the steps donate
        # the state, frozen target included.
        target = load_target(ctx.target_dir, mesh=mesh, rules=TRAIN_RULES)  # shard by shard
        return Trainer(ctx, mesh, nnx.split(target, nnx.Param), d_graph, writer=writer,
                       guard=guard)  # fmt: skip

    d_graph, params = fresh_drafter(ctx.drafter_cfg, mesh=mesh, rules=TRAIN_RULES, seed=0)
    with ScalarWriter(ctx.path("tb")) as writer:
        if phase != "resume":
            first = trainer(writer, StopAfter(STOP_AT))
            try:
                first.stage2("adaflash", params, pool)
                raise AssertionError("the stop request did not preempt stage 2")
            except Preempted:
                pass
        guard = KillBeforeNextStep(run_dir) if phase == "kill" else None
        second = trainer(writer, guard)
        # The rows this process feeds, from the trainer's own iterator factory (which passes
        # jax.process_index()/process_count()); stage 2 builds its iterators the same way.
        batch = next(iter(second._iterator(data, ctx.cfg.seed)))
        params, taus = second.stage2("adaflash", params, pool)  # resumes at step 2
        if phase == "kill":
            raise AssertionError("a lost peer did not stop the run")
        export = export_drafter(d_graph, params, ctx.path("export"))

    # The losses as process 0 logged them to TensorBoard (other processes log nothing).
    scalars = read_scalars(ctx.path("tb")) if jax.process_index() == 0 else {}

    def losses(tag):
        return [(int(s), float(v)) for s, v in scalars.get(f"{tag}/loss", [])]

    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "losses": losses("stage2_adaflash"),
        "collect_tau": taus,
        "export": export,
        "first_rows": row_checksums(batch["tokens"]),
    }


def configure(local_devices: int, process_id: int, num_processes: int, port: int) -> None:
    """Fake CPU devices and, for several processes, the loopback coordinator. Runs before
    anything touches a jax backend."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", local_devices)
    if num_processes > 1:
        # Cross-process collectives on CPU go through gloo (the default in jax 0.10; set
        # explicitly so a different default cannot silently turn them off).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        from adaflash_jax.train.mesh import maybe_initialize_distributed

        os.environ["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
        os.environ["JAX_NUM_PROCESSES"] = str(num_processes)
        os.environ["JAX_PROCESS_ID"] = str(process_id)
        maybe_initialize_distributed(
            True, init_timeout_s=60, heartbeat_timeout_s=HEARTBEAT_S, shutdown_timeout_s=SHUTDOWN_S
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="HF target directory (train-step check)")
    p.add_argument("--prompts", help="prompt JSONL (train-step check)")
    p.add_argument("--pipeline", metavar="CONFIG", help="run the whole distill CLI instead")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--local-devices", type=int, default=8)
    p.add_argument("--phase", choices=("all", "kill", "resume"), default="all")
    args = p.parse_args(argv)
    if args.pipeline is None and not (args.target and args.prompts):
        p.error("pass --target and --prompts, or --pipeline CONFIG")
    configure(args.local_devices, args.process_id, args.num_processes, args.port)
    if args.pipeline is not None:
        from experiments import distill

        argv = ["--config", args.pipeline, "--run-dir", args.run_dir, "--no-progress"]
        rc = distill.main(argv)  # jax.distributed is up already: its own init is a no-op
        print(f"process {args.process_id}: exit {rc}", flush=True)
        return rc
    try:
        result = run(args.target, args.prompts, args.run_dir, args.phase)
    except Exception as e:
        from adaflash_jax.train.mesh import exit_on_peer_loss

        exit_on_peer_loss(e)  # as experiments.distill: one line, exit 3
        raise
    with open(os.path.join(args.run_dir, f"process{args.process_id}.json"), "w") as f:
        json.dump({"first_rows": result["first_rows"]}, f)
    if result["process_index"] == 0:
        with open(os.path.join(args.run_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"process {args.process_id}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
