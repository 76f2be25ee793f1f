"""The small target and drafter the GPU-stack tests load (issue 42: `test_vllm_export.py`,
`test_sglang_export.py`), and the fused parameters a stack's loader should build from an
export's tensors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from test_tpu_inference_export import spread

from adaflash_jax.drafter.checkpoint import save_drafter
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.model import Drafter
from adaflash_jax.model.checkpoint import save_target
from adaflash_jax.model.presets import target_preset
from adaflash_jax.model.target import TargetLM
from experiments import export as export_cli

K, LAYERS, V = 4, (0, 2), 256  # layer 2 is not the target's last (3)
PROMPT = [5, 9, 17, 3, 44, 81, 2, 7, 100, 33, 12, 8]
FUSED = ((("q", "k", "v"), "qkv"), (("gate", "up"), "gate_up"))
WINDOW = 6  # the sliding drafter's window (layer 0 sliding, layer 1 full)


def write_exports(root):
    """A Qwen3-shaped target (GQA 4:2, head dim 16) and our 2-layer drafter for it in `root`:
    `target/`, `adaflash/`, and the drafter exported `--for vllm` (`vllm/`, plain) and
    `--for sglang` (`sglang/`, AdaFlash); a drafter whose layer 0 is sliding-window
    (`WINDOW`) exported both ways too (`vllm_sliding/`, `sglang_sliding/`). Returns the
    target."""
    cfg = target_preset(
        "test",
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e6,
    )
    target = TargetLM(cfg, rngs=nnx.Rngs(0))
    spread(target, jax.random.key(10))
    save_target(target, root / "target")
    dcfg = DrafterConfig.for_target(
        cfg, mask_token_id=V - 1, num_layers=2, block_size=K, target_layer_ids=LAYERS
    )
    drafter = Drafter(dcfg, rngs=nnx.Rngs(1))
    spread(drafter, jax.random.key(18))
    save_drafter(drafter, root / "adaflash")
    sliding = DrafterConfig.for_target(
        cfg,
        mask_token_id=V - 1,
        num_layers=2,
        block_size=K,
        target_layer_ids=LAYERS,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=WINDOW,
    )
    save_drafter(Drafter(sliding, rngs=nnx.Rngs(2)), root / "adaflash_sliding")
    for source, suffix in (("adaflash", ""), ("adaflash_sliding", "_sliding")):
        for stack in ("vllm", "sglang"):
            out = str(root / f"{stack}{suffix}")
            assert export_cli.main([str(root / source), "--for", stack, "--out", out]) == 0
    return target


def fused(tensors, prefix=""):
    """The parameters a stack with fused projections should hold: q/k/v stacked into
    `qkv_proj`, gate/up into `gate_up_proj` (in that order), every other tensor as it is."""
    out = {}
    for name, tensor in tensors.items():
        for parts, into in FUSED:
            if any(name.endswith(f".{p}_proj.weight") for p in parts):
                if name.endswith(f".{parts[0]}_proj.weight"):
                    names = [name.replace(f".{parts[0]}_proj.", f".{p}_proj.") for p in parts]
                    key = name.replace(f".{parts[0]}_proj.", f".{into}_proj.")
                    out[prefix + key] = torch.cat([tensors[n] for n in names])
                break
        else:
            out[prefix + name] = tensor
    return out


def our_block_logits(drafter, target):
    """The prompt's target features [T, nD] (the context, positions 0..T−1), the bonus token
    (the target's greedy next token) and our drafter's logits [K − 1, V] for the masked
    positions of the block [bonus, mask × (K − 1)] after it."""
    out = target(jnp.array(PROMPT, jnp.int32)[None], feature_layers=LAYERS)
    feats = out.features_BxTxnD[0]
    bonus = int(jnp.argmax(out.logits_BxTxV[0, -1]))
    cache = drafter.append_context(drafter.init_context_cache(1, 32), feats[None])
    emb, head = target.embedding_VxD(), target.lm_head_DxV()
    logits = drafter.draft(cache, jnp.array([bonus]), emb, head).logits_BxKm1xV[0]
    return np.asarray(feats), bonus, np.asarray(logits)
