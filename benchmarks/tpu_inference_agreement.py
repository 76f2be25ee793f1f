"""Draft-token agreement of tpu-inference's DFlash drafter with ours, per RoPE case (issue 27).

For each case (a Qwen3 target at θ 1e6, the same at θ 1e4, a Llama target with Llama-3.1
"llama3" scaling) a drafter is exported by this project and run by tpu-inference 0.32.0's own
model, loader and proposer (tests/tpu_inference_stack.py: the wheel in `.tpu_inference/`,
heavy imports stubbed, its reference attention kernel), fed the same target features as our
drafter, over prompts of several lengths and two draft steps each. Rows:
- `adaflash layout`: the export as written before issue 27 (head tensors in the file): whether
  their loader takes it;
- `--for tpu-inference`: the plain layout, as the wheel runs it;
- `+ rope patch`: the same with docs/patches/tpu_inference_dflash_rope.patch applied (θ and
  scaling from the drafter's config.json).

    pip install --no-deps --target .tpu_inference tpu-inference==0.32.0
    python benchmarks/tpu_inference_agreement.py --out benchmarks/cpu/tpu_inference_agreement.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import tpu_inference_stack as tpu  # noqa: E402
from flax import nnx  # noqa: E402

from adaflash_jax.drafter.checkpoint import load_drafter, save_drafter  # noqa: E402
from adaflash_jax.drafter.config import DrafterConfig  # noqa: E402
from adaflash_jax.drafter.model import Drafter  # noqa: E402
from adaflash_jax.drafter.stacks import TPU_INFERENCE, save_for_stack  # noqa: E402
from adaflash_jax.model.checkpoint import save_target  # noqa: E402
from adaflash_jax.model.config import RopeScaling  # noqa: E402
from adaflash_jax.model.presets import target_preset  # noqa: E402
from adaflash_jax.model.target import TargetLM  # noqa: E402

K, LAYERS, V = 4, (0, 2), 256
PROMPT_LENGTHS = (12, 40, 100)
ACCEPTED = 2
CASES = {
    "qwen3 theta 1e6": dict(rope_theta=1e6),
    "qwen3 theta 1e4": dict(rope_theta=1e4),
    "llama-3.1 scaling": dict(
        model_type="llama",
        rope_theta=5e5,
        rope_scaling=RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,  # short, so positions < 128 feel it
        ),
    ),
}


def spread(module, key):
    for i, (path, var) in enumerate(nnx.iter_graph(module)):
        if isinstance(var, nnx.Param):
            noise = jax.random.normal(jax.random.fold_in(key, i), var.get_value().shape)
            norm = "norm" in "/".join(map(str, path))
            var.set_value(1.0 + 0.3 * noise if norm else 0.15 * noise)


def build(root, case):
    cfg = target_preset(
        "test",
        vocab_size=V,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=512,
        **case,
    )
    target = TargetLM(cfg, rngs=nnx.Rngs(0))
    spread(target, jax.random.key(10))
    save_target(target, f"{root}/target")
    dcfg = DrafterConfig.for_target(
        cfg, mask_token_id=V - 1, num_layers=2, block_size=K, target_layer_ids=LAYERS
    )
    drafter = Drafter(dcfg, rngs=nnx.Rngs(1))
    spread(drafter, jax.random.key(13))
    save_drafter(drafter, f"{root}/adaflash")
    notes = save_for_stack(drafter, f"{root}/plain", "tpu-inference")
    return target, notes


def run_prompts(root, target, patch_rope):
    """(agreeing draft tokens, proposed) over the prompts, two draft steps each."""
    ours = load_drafter(f"{root}/plain")
    emb, head = target.embedding_VxD(), target.lm_head_DxV()
    forward = nnx.jit(lambda model, tokens: model(tokens, feature_layers=LAYERS))
    draft = nnx.jit(lambda d, cache, bonus: d.draft(cache, bonus, emb, head))
    agree = proposed = 0
    gaps = []  # our top-2 logit gap where the tokens differ (small: a bf16 near-tie)
    for n, length in enumerate(PROMPT_LENGTHS):
        theirs = tpu.TpuInferenceDrafter(
            f"{root}/plain", f"{root}/target", emb, head, patch_rope=patch_rope
        )
        prompt = jax.random.randint(jax.random.key(100 + n), (length,), 1, V - 1)
        out = forward(target, prompt[None])
        feats = out.features_BxTxnD[0].astype(jnp.bfloat16)
        bonus = int(jnp.argmax(out.logits_BxTxV[0, -1]))
        cache = ours.append_context(
            ours.init_context_cache(1, 128), feats[None].astype(jnp.float32)
        )
        logits_1 = np.asarray(draft(ours, cache, jnp.array([bonus])).logits_BxKm1xV[0])
        ours_1 = np.argmax(logits_1, -1).tolist()
        theirs_1 = theirs.propose(prompt, feats, length, 0, bonus)
        block = jnp.array([bonus, *ours_1], jnp.int32)
        out = forward(target, jnp.concatenate([prompt, block])[None])
        block_feats = out.features_BxTxnD[0, length:].astype(jnp.bfloat16)
        bonus_2 = int(jnp.argmax(out.logits_BxTxV[0, length + ACCEPTED]))
        cache = ours.append_context(cache, block_feats[None, : ACCEPTED + 1].astype(jnp.float32))
        logits_2 = np.asarray(draft(ours, cache, jnp.array([bonus_2])).logits_BxKm1xV[0])
        ours_2 = np.argmax(logits_2, -1).tolist()
        theirs_2 = theirs.propose(block, block_feats, length + K, K - 1 - ACCEPTED, bonus_2)
        pairs = list(zip(ours_1 + ours_2, theirs_1 + theirs_2, strict=True))
        agree += sum(a == b for a, b in pairs)
        proposed += len(pairs)
        top2 = np.sort(np.concatenate([logits_1, logits_2]), -1)[:, -2:]
        gaps += [float(g) for (a, b), g in zip(pairs, top2[:, 1] - top2[:, 0]) if a != b]
    return agree, proposed, theirs.rope[0], gaps


def default_scaling_error(positions=(5, 100, 500, 5000)):
    """What the default-factor scaling does to RoPE itself: max |rotated(dict) − rotated(None)|
    of an all-ones head (dim 128, θ 1e6) at each position, in the wheel's `apply_rope`."""
    from tpu_inference.layers.jax.rope_interface import apply_rope

    x = jnp.ones((len(positions), 1, 128))
    pos = jnp.array(positions)
    params = {"rope_theta": 1e6, "rope_type": "default"}  # what `rope_scaling` returns
    diff = apply_rope(x, pos, 128, 1e6, params) - apply_rope(x, pos, 128, 1e6, None)
    errors = np.abs(np.asarray(diff)).max(axis=(1, 2)).round(4).tolist()
    return dict(zip(map(str, positions), errors, strict=True))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here too")
    args = p.parse_args(argv)
    if not tpu.available():
        raise SystemExit(f"tpu-inference wheel not found in {tpu.WHEEL_DIR}: {tpu.INSTALL}")
    results = {}
    with tpu.stub_imports():
        rope_error = default_scaling_error()
        print("rope error of the default scaling by position", rope_error, flush=True)
        for name, case in CASES.items():
            with tempfile.TemporaryDirectory() as root:
                target, notes = build(root, case)
                emb, head = target.embedding_VxD(), target.lm_head_DxV()
                error = tpu.load_error(f"{root}/adaflash", f"{root}/target", emb, head)
                row = {"adaflash layout": {"loads": error is None, "error": error}}
                for label, patch in (("--for tpu-inference", False), ("+ rope patch", True)):
                    agree, proposed, (theta, scaling), gaps = run_prompts(root, target, patch)
                    row[label] = {
                        "agree": agree,
                        "proposed": proposed,
                        "our_top2_gap_where_different": [round(g, 4) for g in gaps],
                        "rope_theta_used": theta,
                        "rope_scaling_used": scaling,
                    }
                row["export warnings"] = notes
                results[name] = row
                print(name, json.dumps(row, default=str), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            summary = {
                "tpu_inference": TPU_INFERENCE,
                "default_scaling_rope_error_by_position": rope_error,
                "cases": results,
            }
            json.dump(summary, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
