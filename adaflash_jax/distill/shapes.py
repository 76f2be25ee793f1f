"""What a run config implies before any weights load: the target's and the drafter's shapes,
the mesh on a device count, and the cache capacity its decoders' slots need.

The planner, the deviceless compiles, collection, the benchmarks and the CLIs all ask here,
so each rule is written once and a plan, a compile and a run cannot disagree about a shape.
"""

from __future__ import annotations

from adaflash_jax.distill.config import RunConfig
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.model.config import ConfigError, TargetConfig
from adaflash_jax.model.presets import target_preset
from adaflash_jax.train.mesh_shape import fill_mesh

# Slot capacities are rounded up to a multiple of this, so that nearby request lengths share
# one compiled program.
CAPACITY_STEP = 16


def slot_capacity(longest_prompt: int, new_tokens: int, block_size: int) -> int:
    """Cache entries a decoder slot needs: the longest prompt, the new tokens and one drafted
    block past them, rounded up to a multiple of `CAPACITY_STEP`."""
    need = longest_prompt + new_tokens + block_size
    return -(-need // CAPACITY_STEP) * CAPACITY_STEP


def engine_capacity(cfg: RunConfig) -> int:
    """The slot capacity of a run's engine collector and evaluator (`distill.collect`)."""
    return slot_capacity(cfg.data.max_prompt_len, cfg.data.max_new_tokens, cfg.draft.block_size)


def run_mesh(cfg: RunConfig, devices: int) -> tuple[int, int, int]:
    """The run's (data, fsdp, tensor) sizes on `devices` chips."""
    return fill_mesh(cfg.mesh, devices)


def target_shape(
    *, shape: str | None = None, path: str | None = None, embedded: str | None = None
) -> TargetConfig:
    """The target architecture a preset name, an HF directory or an embedded preset names
    (the first given wins); no weights are read and nothing is built."""
    if shape:
        return target_preset(shape)
    if path:
        if str(path).startswith("gs://"):
            raise ConfigError(f"target {path} is on GCS: its shape needs target_shape too")
        return TargetConfig.from_pretrained(path)
    if embedded:
        return _embedded(embedded)
    raise ConfigError("the config names no target: set target, target_shape or target_path")


def run_target(cfg: RunConfig) -> TargetConfig:
    """The target architecture a run config names (`target_shape`, else `target_path`, else
    the embedded preset)."""
    return target_shape(shape=cfg.target_shape, path=cfg.target_path, embedded=cfg.embedded_preset)


def _embedded(preset: str) -> TargetConfig:
    """An embedded target's architecture without building it: its vocabulary is the preset's
    BPE size (special tokens included)."""
    from adaflash_jax.train.presets import get_preset

    try:
        p = get_preset(preset)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return p.target_config(p.vocab_size, None)


def run_drafter_config(
    cfg: RunConfig, target: TargetConfig, mask_token_id: int | None = None
) -> DrafterConfig:
    """The fresh drafter a run trains (`draft.*` fields; the DFlash shape of the target)."""
    d = cfg.draft
    return DrafterConfig.for_target(
        target,
        mask_token_id=d.mask_token_id if mask_token_id is None else mask_token_id,
        num_layers=d.layers,
        block_size=d.block_size,
        num_features=d.num_features,
        target_layer_ids=d.target_layer_ids,
        length_head=True,
        accept_dim=d.accept_dim,
        heads=d.heads,
        intermediate_size=d.intermediate_size,
    )


def run_drafter(cfg: RunConfig, target: TargetConfig) -> DrafterConfig:
    """The run's fresh drafter, checked against the target; a config without a mask token
    (the embedded targets take theirs from the tokenizer) gets the last vocabulary row,
    which changes no shape."""
    mask = cfg.draft.mask_token_id
    dcfg = run_drafter_config(cfg, target, target.vocab_size - 1 if mask is None else mask)
    dcfg.validate_against(target)
    return dcfg
