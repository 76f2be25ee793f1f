"""The checks a run config passes once the devices and the target are known, before anything
is compiled: each names the offending field, so a run fails at once rather than mid-way."""

from __future__ import annotations

from adaflash_jax.distill.config import RunConfig
from adaflash_jax.distill.shapes import run_mesh, slot_capacity
from adaflash_jax.model.config import ConfigError, TargetConfig


def check_runtime(
    cfg: RunConfig, *, num_devices: int, target: TargetConfig, mask_token_id: int | None
) -> tuple[int, int, int]:
    """Fails, naming the field, on anything that would only break mid-run; returns the mesh."""
    mesh = run_mesh(cfg, num_devices)
    shards = mesh[0] * mesh[1]
    if cfg.batch_size % shards:
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by data*fsdp = {shards} (mesh {mesh})"
        )
    if cfg.stage2.collect_slots % mesh[0] and cfg.stage2.rounds:
        raise ConfigError(
            f"stage2.collect_slots {cfg.stage2.collect_slots} is not divisible by the "
            f"data axis {mesh[0]}"
        )
    e = cfg.eval
    if e.slots % mesh[0] and (e.backend == "engine" or any(e.temperatures) or e.long_new_tokens):
        raise ConfigError(f"eval.slots {e.slots} is not divisible by the data axis {mesh[0]}")
    if e.long_new_tokens:
        need = slot_capacity(cfg.data.max_prompt_len, e.long_new_tokens, cfg.draft.block_size)
        if need > target.max_position_embeddings:
            raise ConfigError(
                f"eval.long_new_tokens {e.long_new_tokens} needs a cache of {need} positions "
                f"(prompt {cfg.data.max_prompt_len} + response + a block), beyond the target's "
                f"max_position_embeddings {target.max_position_embeddings}"
            )
    if mask_token_id is None:
        raise ConfigError(
            "draft.mask_token_id is not set and the target's tokenizer declares no mask "
            "token: set draft.mask_token_id to a spare row of the embedding table"
        )
    if not 0 <= mask_token_id < target.vocab_size:
        raise ConfigError(
            f"draft.mask_token_id {mask_token_id} is outside the target vocab "
            f"(size {target.vocab_size})"
        )
    for i in cfg.draft.target_layer_ids or ():
        if not 0 <= i < target.num_hidden_layers:
            raise ConfigError(
                f"draft.target_layer_ids has {i}, but the target has "
                f"{target.num_hidden_layers} layers"
            )
    if cfg.seq_len > target.max_position_embeddings:
        raise ConfigError(
            f"seq_len {cfg.seq_len} exceeds the target's max_position_embeddings "
            f"{target.max_position_embeddings}"
        )
    return mesh
