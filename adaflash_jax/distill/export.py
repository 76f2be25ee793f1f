"""Drafter export: sharded training params → one HF DFlash/AdaFlash directory (process 0).

`save_drafter` writes local and gs:// exports alike, config.json (the completion marker)
last.

Also turns a stage checkpoint directory back into an export, for `experiments/export.py`:
the run directory keeps the drafter's HF config (`drafter_config.json`), and the checkpoint's
`params` subtree is read without rebuilding the optimizer that wrote it.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from adaflash_jax.distill.state import abstract_drafter
from adaflash_jax.drafter.checkpoint import config_from_hf, config_to_hf, save_drafter
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.io import fs

DRAFTER_CONFIG = "drafter_config.json"


def host_params(params):
    """Every process gets full host copies (a collective on multi-host runs)."""
    if jax.process_count() == 1:
        return jax.device_get(params)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(params, tiled=True)


def export_drafter(graphdef: nnx.GraphDef, params, path: str) -> str | None:
    """Writes the export on process 0; every process must call it. Returns the path."""
    host = host_params(params)
    if jax.process_index() != 0:
        return None
    save_drafter(nnx.merge(graphdef, host), path)
    return path


def save_drafter_config(cfg: DrafterConfig, run_dir: str) -> None:
    fs.write_text(f"{run_dir}/{DRAFTER_CONFIG}", json.dumps(config_to_hf(cfg), indent=2))


def checkpoint_step(ckpt_dir: str, step: int | None = None) -> int:
    """`step` (checked to exist) or the latest step orbax finished in `ckpt_dir`."""
    ckpt_dir = fs.absolute(ckpt_dir)
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(ckpt_dir, options=options) as mgr:
        found = mgr.latest_step() if step is None else int(step)
        if found is None or found not in mgr.all_steps():
            what = "checkpoint steps" if step is None else f"checkpoint step {step}"
            raise FileNotFoundError(f"no {what} in {ckpt_dir}")
    return found


def export_checkpoint(ckpt_dir: str, out: str, *, run_dir: str | None = None, step=None) -> str:
    """A stage checkpoint directory (`<run>/ckpt/<stage>`) → HF export at `out`: only the
    `params` of the state item are read (orbax partial restore, as host arrays)."""
    ckpt_dir = fs.absolute(ckpt_dir)  # local or gs://
    run_dir = run_dir or ckpt_dir.rsplit("/", 2)[0]
    cfg_path = f"{run_dir}/{DRAFTER_CONFIG}"
    if not fs.exists(cfg_path):
        raise FileNotFoundError(f"{cfg_path} not found: pass run_dir= the run directory")
    cfg = config_from_hf(json.loads(fs.read_text(cfg_path)))
    graphdef, abstract = abstract_drafter(cfg)
    item = {"params": jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), abstract)}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    step = checkpoint_step(ckpt_dir, step)
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(ckpt_dir, options=options) as mgr:
        try:
            params = mgr.restore(step, args=ocp.args.Composite(state=args)).state["params"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"checkpoint {ckpt_dir}/{step} does not fit {cfg_path}: {e}") from None
    save_drafter(nnx.merge(graphdef, params), out)
    return out
