"""Drafter export: sharded training params → one HF DFlash/AdaFlash directory (process 0).

Remote (gs://) exports are written locally first, then copied file by file with config.json
(the completion marker) last, the optional `adaflash_extra/` part included.

Also turns a stage checkpoint directory back into an export, for `experiments/export.py`:
the run directory keeps the drafter's HF config (`drafter_config.json`), and the checkpoint's
`params` subtree is read without rebuilding the optimizer that wrote it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import numpy as np
from etils import epath
from flax import nnx

from adaflash_jax.distill import fs
from adaflash_jax.drafter.checkpoint import config_from_hf, config_to_hf, save_drafter
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter

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
    write_export(nnx.merge(graphdef, host), path)
    return path


def write_export(drafter: Drafter, path: str) -> None:
    """`save_drafter` to a local directory, or through a local temporary one to gs://."""
    if not fs.is_remote(path):
        save_drafter(drafter, path)
        return
    local = tempfile.mkdtemp(prefix="adaflash_export_")
    try:
        save_drafter(drafter, local)
        publish(local, path)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def publish(local: str, path: str) -> None:
    """Copies a finished local export (subdirectories included, e.g. the optional
    `adaflash_extra/` part) to `path`, config.json last: it marks the export complete."""
    path = path.rstrip("/")
    marker = epath.Path(f"{path}/config.json")
    if marker.exists():  # overwriting: incomplete until the new marker lands
        marker.unlink()
    files = []
    for root, _, names in os.walk(local):
        files += [os.path.relpath(os.path.join(root, n), local) for n in names]
    for rel in sorted(files, key=lambda r: (r == "config.json", r)):
        with open(os.path.join(local, rel), "rb") as f:
            fs.write_bytes(f"{path}/{rel.replace(os.sep, '/')}", f.read())


def save_drafter_config(cfg: DrafterConfig, run_dir: str) -> None:
    fs.write_text(f"{run_dir}/{DRAFTER_CONFIG}", json.dumps(config_to_hf(cfg), indent=2))


def latest_step(ckpt_dir: str) -> int:
    steps = [int(p.name) for p in epath.Path(ckpt_dir).iterdir() if p.name.isdigit()]
    if not steps:
        raise FileNotFoundError(f"no checkpoint steps in {ckpt_dir}")
    return max(steps)


def _find_params(tree):
    """The `params` subtree of a restored TrainState (dict form)."""
    if isinstance(tree, dict):
        if "params" in tree:
            return tree["params"]
        for v in tree.values():
            found = _find_params(v)
            if found is not None:
                return found
    return None


def export_checkpoint(ckpt_dir: str, out: str, *, run_dir: str | None = None, step=None) -> str:
    """A stage checkpoint directory (`<run>/ckpt/<stage>`) → HF export at `out`."""
    import orbax.checkpoint as ocp

    ckpt_dir = fs.absolute(ckpt_dir).rstrip("/")  # local or gs://
    run_dir = run_dir or ckpt_dir.rsplit("/", 2)[0]
    cfg_path = f"{run_dir}/{DRAFTER_CONFIG}"
    if not fs.exists(cfg_path):
        raise FileNotFoundError(f"{cfg_path} not found: pass run_dir= the run directory")
    cfg = config_from_hf(json.loads(fs.read_text(cfg_path)))
    step = latest_step(ckpt_dir) if step is None else int(step)
    with ocp.CheckpointManager(ckpt_dir) as mgr:
        restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    params = _find_params(restored.state)
    if params is None:
        raise ValueError(f"checkpoint {ckpt_dir}/{step} holds no `params`")
    model = nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(model, nnx.Param)
    state = _fill(abstract, params)
    write_export(nnx.merge(graphdef, state), out)
    return out


def _fill(abstract, pure):
    """Puts restored arrays (nested dicts, Variables as {"value": array}) into the state."""

    def unwrap(x):
        while isinstance(x, dict) and set(x) == {"value"}:
            x = x["value"]
        return x

    flat = nnx.to_flat_state(abstract)
    for path, var in flat:
        node = pure
        for key in path:
            node = node[str(key)] if str(key) in node else node[key]
        var.set_value(np.asarray(unwrap(node), np.float32))
    return nnx.from_flat_state(flat)
