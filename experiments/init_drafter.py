"""Writes an untrained DFlash/AdaFlash drafter for a target.

python -m experiments.init_drafter --target DIR --out DIR [--layers N] [--block-size K]
python -m experiments.init_drafter --target DIR --out DIR --sliding-window 2048 \
    --full-attention-layers 4                  # layers 0-3 sliding, layer 4 full
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from adaflash_jax.cli import one_line_errors
from adaflash_jax.drafter.checkpoint import save_drafter
from adaflash_jax.drafter.init import drafter_for_target
from adaflash_jax.drafter.stacks import last_layer_warning


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", required=True, help="HF target directory")
    p.add_argument("--out", required=True, help="where to write the drafter export")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-features", type=int, default=5, help="target layers to read")
    p.add_argument("--target-layer-ids", default=None, help="comma list, default docs/design.md §2")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--no-length-head", action="store_true")
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="make layers sliding-window attention with this window (docs/design.md §3)",
    )
    p.add_argument(
        "--full-attention-layers",
        default="",
        help="with --sliding-window: comma list of layers kept full attention (default none)",
    )
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        ids = tuple(int(x) for x in a.target_layer_ids.split(",")) if a.target_layer_ids else None
    except ValueError:
        p.error(f"--target-layer-ids must be a comma list of integers, got {a.target_layer_ids!r}")
    try:
        full = {int(x) for x in a.full_attention_layers.split(",") if x}
    except ValueError:
        p.error(f"--full-attention-layers must be a comma list, got {a.full_attention_layers!r}")
    if full and a.sliding_window is None:
        p.error("--full-attention-layers needs --sliding-window")
    if full - set(range(a.layers)):
        p.error(f"--full-attention-layers {sorted(full)} are not all among the {a.layers} layers")
    layer_types = None
    if a.sliding_window is not None:
        kinds = ("full_attention" if i in full else "sliding_attention" for i in range(a.layers))
        layer_types = tuple(kinds)
    with one_line_errors():
        drafter = drafter_for_target(
            a.target,
            num_layers=a.layers,
            block_size=a.block_size,
            num_features=a.num_features,
            target_layer_ids=ids,
            mask_token_id=a.mask_token_id,
            length_head=not a.no_length_head,
            layer_types=layer_types,
            sliding_window=a.sliding_window,
            seed=a.seed,
        )
        save_drafter(drafter, a.out, dtype=getattr(jnp, a.dtype))
    cfg = drafter.config
    if note := last_layer_warning(cfg):
        print(f"warning: {note}", file=sys.stderr)
    print(
        f"wrote drafter to {a.out}: {cfg.num_hidden_layers} layers, block {cfg.block_size}, "
        f"target layers {list(cfg.target_layer_ids)}, mask token {cfg.mask_token_id}"
    )


if __name__ == "__main__":
    main()
