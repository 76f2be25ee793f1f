"""Drafter export: sharded training params → HF DFlash/AdaFlash directories (process 0).

`save_drafter` writes local and gs:// exports alike, config.json (the completion marker)
last. The distillation run writes `export/<method>/` in the AdaFlash layout (our engine,
SGLang) and `export/<method>/dflash/` in the plain DFlash layout (vLLM, tpu-inference,
sglang-jax; docs/serving.md): a subdirectory, so loaders that glob the top-level
`*.safetensors` of the AdaFlash directory never see it.

Also turns a stage checkpoint directory back into an export, for `experiments/export.py`:
the run directory keeps the drafter's HF config (`drafter_config.json`), and the checkpoint's
`params` subtree is read without rebuilding the optimizer that wrote it. Such an export
(and a converted one) gets a README.md (`drafter/serving.py`: the stack, the version
checked, the launch command, what the layout leaves out, the τ of the run's report.json),
and a layout that drops the length head says so in its first warning. Orbax's notes on
reading a checkpoint read-only (absl WARNING lines) are silenced.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from adaflash_jax.distill.state import abstract_drafter
from adaflash_jax.drafter.checkpoint import PROMPT_FORMAT_KEY, load_drafter
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.hf_config import config_from_hf, config_to_hf
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.drafter.serving import dropped_warning, export_readme
from adaflash_jax.drafter.stacks import last_layer_warning, save_for_stack, stack_warnings
from adaflash_jax.io import fs
from adaflash_jax.io.safetensors_io import SafetensorsFile
from adaflash_jax.model.checkpoint import CheckpointError

DRAFTER_CONFIG = "drafter_config.json"
PLAIN_SUBDIR = "dflash"  # the plain DFlash copy inside a run's AdaFlash export
README = "README.md"
REPORT = "report.json"


class _OrbaxNotes(logging.Filter):
    """Drops orbax's records below ERROR (read-only checkpoint notes: "setting create=False",
    "Given directory is read only")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "orbax" not in record.pathname


@contextlib.contextmanager
def _quiet_orbax():
    logger, quiet = logging.getLogger("absl"), _OrbaxNotes()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def measured_drafter(stage: str) -> str:
    """The run's final drafter (a report.json `tau` key: "stage1" or a stage-2 method) that a
    stage checkpoint (`ckpt/<stage>`) belongs to."""
    if stage in ("stage1", "head_init"):
        return "stage1"
    for prefix in ("head_init_", "head_refit_", "stage2_"):
        if stage.startswith(prefix):
            return stage[len(prefix) :]
    return stage


def measured_tau(run_dir: str | None, drafter: str) -> str:
    """A sentence: the τ the run's report.json holds for its final `drafter`, or why none."""
    path = f"{run_dir}/{REPORT}" if run_dir else None
    if path is None or not fs.exists(path):
        return f"Not measured: {run_dir or 'this export'} has no {REPORT} (no finished run)."
    report = json.loads(fs.read_text(path))
    per_domain = report.get("tau", {}).get(drafter)
    if not per_domain:
        return f"Not measured: {path} has no τ for the `{drafter}` drafter."
    mean = float(np.mean(list(per_domain.values())))
    domains = ", ".join(f"{d} {t:.3f}" for d, t in per_domain.items())
    return (
        f"τ {mean:.3f} (accepted tokens per target forward, greedy, our engine, on the run's "
        f"held-out prompts; per domain: {domains}) for the run's final `{drafter}` drafter, "
        f"from {path}; a stack's own τ is not measured here."
    )


def write_for_stack(
    drafter: Drafter, out: str, stack: str, *, source: str, tau: str, dtype=None
) -> list[str]:
    """`save_for_stack` plus the README.md; returns the warnings, the layout's drop first."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    notes = save_for_stack(drafter, out, stack, **kwargs)
    readme = export_readme(drafter.config, stack, source=source, tau=tau, notes=notes)
    fs.write_text(fs.join(fs.absolute(out), README), readme)
    drop = dropped_warning(drafter.config, stack)
    return [drop, *notes] if drop else notes


def host_params(params):
    """Every process gets full host copies (a collective on multi-host runs)."""
    if jax.process_count() == 1:
        return jax.device_get(params)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(params, tiled=True)


def prompt_format(data) -> dict:
    """How the run rendered its prompts (a `DataSpec`): recorded in the export's config.json
    under `PROMPT_FORMAT_KEY`, so whoever serves the drafter renders prompts the same way."""
    return {"chat_template": data.chat_template, "enable_thinking": data.enable_thinking}


def export_drafter(
    graphdef: nnx.GraphDef, params, path: str, *, prompt_format: dict | None = None
) -> str | None:
    """Writes the AdaFlash export and its plain DFlash copy (`<path>/dflash`) on process 0;
    every process must call it. Returns the path."""
    host = host_params(params)
    if jax.process_index() != 0:
        return None
    drafter = nnx.merge(graphdef, host)
    meta = {PROMPT_FORMAT_KEY: prompt_format} if prompt_format else None
    save_for_stack(drafter, path, "adaflash", meta=meta)
    save_for_stack(drafter, fs.join(fs.absolute(path), PLAIN_SUBDIR), "vllm", meta=meta)
    if note := last_layer_warning(drafter.config):
        warnings.warn(note, UserWarning, stacklevel=2)
    return path


def describe_run_export(path: str, cfg: DrafterConfig, *, run_dir: str, method: str) -> None:
    """README.md of a run's own export of `method` (`export_drafter`'s AdaFlash directory),
    once report.json holds its τ: our engine's launch, and where the plain copy is."""
    notes = stack_warnings(cfg, "adaflash")
    if w := last_layer_warning(cfg):
        notes.append(w)
    source = (
        f"by the distillation run {run_dir}: its final `{method}` drafter "
        f"(`{PLAIN_SUBDIR}/` holds the plain DFlash copy; `python -m experiments.export "
        f"{path} --for STACK` writes each stack's layout with its own README)"
    )
    tau = measured_tau(run_dir, method)
    text = export_readme(cfg, "adaflash", source=source, tau=tau, notes=notes)
    fs.write_text(fs.join(path, README), text)


def save_drafter_config(cfg: DrafterConfig, run_dir: str) -> None:
    fs.write_text(f"{run_dir}/{DRAFTER_CONFIG}", json.dumps(config_to_hf(cfg), indent=2))


def checkpoint_step(ckpt_dir: str, step: int | None = None) -> int:
    """`step` (checked to exist) or the latest step orbax finished in `ckpt_dir`."""
    ckpt_dir = fs.absolute(ckpt_dir)
    with _quiet_orbax():
        options = ocp.CheckpointManagerOptions(read_only=True)
        with ocp.CheckpointManager(ckpt_dir, options=options) as mgr:
            found = mgr.latest_step() if step is None else int(step)
            if found is None or found not in mgr.all_steps():
                what = "checkpoint steps" if step is None else f"checkpoint step {step}"
                raise FileNotFoundError(f"no {what} in {ckpt_dir}")
    return found


def export_checkpoint(
    ckpt_dir: str, out: str, *, run_dir: str | None = None, step=None, stack="adaflash"
) -> list[str]:
    """A stage checkpoint directory (`<run>/ckpt/<stage>`) → HF export at `out` in the layout
    `stack` loads (`drafter.stacks`): only the `params` of the state item are read (orbax
    partial restore, as host arrays). Returns the stack's warnings."""
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
    with _quiet_orbax():
        step = checkpoint_step(ckpt_dir, step)
        options = ocp.CheckpointManagerOptions(read_only=True)
        with ocp.CheckpointManager(ckpt_dir, options=options) as mgr:
            try:
                params = mgr.restore(step, args=ocp.args.Composite(state=args)).state["params"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(
                    f"checkpoint {ckpt_dir}/{step} does not fit {cfg_path}: {e}"
                ) from None
    stage = ckpt_dir.rsplit("/", 1)[1]
    source = f"by `python -m experiments.export` from checkpoint `{stage}` step {step} of "
    source += run_dir
    tau = measured_tau(run_dir, measured_drafter(stage))
    return write_for_stack(nnx.merge(graphdef, params), out, stack, source=source, tau=tau)


def is_export_dir(path: str) -> bool:
    """A drafter export (ours or published): config.json and model.safetensors, local."""
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors"))


def convert_export(src: str, out: str, *, stack: str) -> list[str]:
    """An export directory (ours or a published DFlash drafter) → the layout `stack` loads,
    weights bit for bit in their stored dtype. Returns the stack's warnings."""
    stored = SafetensorsFile(os.path.join(src, "model.safetensors")).dtype("fc.weight")
    parts = os.path.abspath(src).split(os.sep)
    if parts[-1] == PLAIN_SUBDIR and len(parts) > 3:
        parts = parts[:-1]  # <run>/export/<method>/dflash
    run_dir, drafter = None, parts[-1]
    if len(parts) > 2 and parts[-2] == "export":
        run_dir = os.sep.join(parts[:-2])
    tau = measured_tau(run_dir, drafter)
    return write_for_stack(
        load_drafter(src),
        out,
        stack,
        source=f"by `python -m experiments.export` from the export {src}",
        tau=tau,
        dtype=stored,
    )
