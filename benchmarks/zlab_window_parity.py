"""Our sliding-window drafter against z-lab's reference `dflash/model.py`, run as published.

z-lab's model passes `sliding_window` to transformers' attention function; only the
flash-attention kernels honour it (transformers turns it into `window_size=(W−1, W−1)` when the
keys outnumber W, non-causal, queries aligned to the last keys); eager and SDPA, the CPU
choices, ignore it. This script registers, under its own name, an attention function written
from that rule as a mask, runs z-lab's unchanged model file (the path given) with it on our
export, and compares the drafts of our engine's `Drafter.draft` on a context longer than the
window. It also reports what the same export drafts under eager attention (the window lost).

    python benchmarks/zlab_window_parity.py --zlab-model PATH/dflash/model.py

Not in CI: z-lab's file is their code, not ours, and is not shipped here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from transformers import AttentionInterface

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from adaflash_jax.drafter.checkpoint import load_drafter, save_drafter  # noqa: E402
from adaflash_jax.drafter.config import DrafterConfig  # noqa: E402
from adaflash_jax.drafter.model import Drafter  # noqa: E402
from adaflash_jax.model.presets import target_preset  # noqa: E402

WINDOW, CONTEXT, K = 8, 24, 4


def flash_window_attention(module, q, k, v, attention_mask, scaling, dropout=0.0, **kw):
    """transformers' flash-attention semantics for `sliding_window` W, non-causal: query i
    (aligned to key i + S − T) sees keys j with |i + S − T − j| <= W − 1, when S > W."""
    window = kw.get("sliding_window")
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2)).float() * scaling
    t, s = q.shape[2], k.shape[2]
    if window is not None and s > window:
        qpos = torch.arange(t)[:, None] + s - t
        far = (qpos - torch.arange(s)[None, :]).abs() > window - 1
        scores = scores.masked_fill(far, float("-inf"))
    out = torch.softmax(scores, -1).to(v.dtype) @ v
    return out.transpose(1, 2).contiguous(), None


def spread(module, key):
    for i, (path, var) in enumerate(nnx.iter_graph(module)):
        if isinstance(var, nnx.Param):
            noise = jax.random.normal(jax.random.fold_in(key, i), var.get_value().shape)
            norm = "norm" in "/".join(map(str, path))
            var.set_value(1.0 + 0.3 * noise if norm else 0.15 * noise)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--zlab-model", required=True, help="z-lab/dflash's dflash/model.py")
    args = p.parse_args(argv)
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", args.zlab_model)
    zlab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zlab)
    AttentionInterface.register("flash_window_rule", flash_window_attention)

    target = target_preset("test", vocab_size=128, num_hidden_layers=6)
    cfg = DrafterConfig.for_target(
        target,
        mask_token_id=127,
        num_layers=3,
        block_size=K,
        num_features=3,
        length_head=False,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        sliding_window=WINDOW,
    )
    drafter = Drafter(cfg, rngs=nnx.Rngs(0))
    spread(drafter, jax.random.key(1))
    emb_VxD = 0.5 * jax.random.normal(jax.random.key(2), (128, target.hidden_size))
    feats_CxnD = jax.random.normal(jax.random.key(3), (CONTEXT, 3 * target.hidden_size))
    bonus = 17
    with tempfile.TemporaryDirectory() as d:
        save_drafter(drafter, d, dtype=None)
        ours = load_drafter(d)
        cache = ours.append_context(ours.init_context_cache(1, CONTEXT + K), feats_CxnD[None])
        out = ours.draft(cache, jnp.array([bonus]), emb_VxD, emb_VxD.T)
        ours_hidden = np.asarray(out.hidden_BxKxD[0])
        results = {}
        for impl in ("flash_window_rule", "eager"):
            model = zlab.DFlashDraftModel.from_pretrained(d, dtype=torch.float32)
            model.config._attn_implementation = impl
            block = torch.full((1, K), 127)
            block[0, 0] = bonus
            noise = torch.from_numpy(np.asarray(emb_VxD))[block]
            with torch.no_grad():
                hidden = model(
                    position_ids=torch.arange(CONTEXT + K)[None],
                    noise_embedding=noise,
                    target_hidden=torch.from_numpy(np.asarray(feats_CxnD))[None],
                    is_causal=False,
                )
            results[impl] = float(np.abs(hidden[0].numpy() - ours_hidden).max())
    report = {
        "window": WINDOW,
        "context": CONTEXT,
        "block": K,
        "max_abs_diff_block_states": results,
        "torch": torch.__version__,
    }
    print(json.dumps(report, indent=2))
    return 0 if results["flash_window_rule"] < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
