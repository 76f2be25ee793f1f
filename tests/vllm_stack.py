"""vLLM's own DFlash drafter, built and loaded on CPU from an export of ours (issue 42).

What runs is the wheel's code: its config path (`ModelConfig` for the target,
`SpeculativeConfig(method="dflash")`, which reads our drafter's config.json through vLLM's
transformers config loading and its `dflash` handling, and `VllmConfig`), its model registry
(`DFlashDraftModel` → `qwen3_dflash.DFlashQwen3ForCausalLM`), its default model loader
(`get_model`: safetensors iterator, `load_weights`, `process_weights_after_loading`) and the
DFlash proposer's own `load_dflash_model` (the draft next to vLLM's Qwen3 target, sharing its
embedding and LM head); then its drafter's forward: `combine_hidden_states` (fc),
`precompute_and_store_context_kv` (hidden norm, every layer's K/V projection, K norm, RoPE)
and the block forward through its decoder layers, norm and `compute_logits`. Replaced here,
and only here:
- third-party modules the import needs but loading never uses (`STUBBED`) are stand-ins;
- `VLLM_TARGET_DEVICE=cpu`; the CPU platform's serving check (`check_and_update_config`,
  which requires triton-cpu on x86) is skipped; the registry inspects model classes in this
  process instead of a subprocess (which would not see the side folder);
- compiled ops the CUDA wheel has no CPU build of: the CPU GEMM dispatch after loading
  (`dispatch_cpu_unquantized_gemm`: torch's `F.linear` instead of oneDNN / AMX packing),
  `torch.accelerator.empty_cache` (no accelerator), and in the forward only `_custom_ops
  .rms_norm` / `.rotary_embedding` (the fused context K/V path: float32 torch versions) and the
  paged attention layer (`Attention`: torch attention of the block's queries over the context
  K/V the drafter stored plus the block's own, non-causal as its config asks);
- custom ops run their `forward_native` (`custom_ops=["none"]`), eager (compilation mode 0).

The wheel is found in `$VLLM_DIR` or `<repo>/.vllm`, installed there with `INSTALL` (its own
pins, torch 2.11 among them, do not install next to ours; its Python code runs on our
torch 2.13).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import numpy as np
import stack_stubs
import torch

from adaflash_jax.drafter.stacks import VLLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_DIR = os.environ.get("VLLM_DIR", os.path.join(REPO, ".vllm"))
VERSION = VLLM  # the wheel this file runs (adaflash_jax.drafter.stacks)
INSTALL = f"pip install --no-deps --target .vllm vllm=={VERSION}"
STUBBED = (
    "zmq",
    "cbor2",
    "pybase64",
    "cachetools",
    "msgspec",
    "llguidance",
    "xgrammar",
    "einops",
    "compressed_tensors",
)


def available() -> bool:
    return os.path.isfile(
        os.path.join(WHEEL_DIR, "vllm", "model_executor", "models", "qwen3_dflash.py")
    )


def _rms_norm(out, x, weight, eps):
    """`_custom_ops.rms_norm`: out ← x / rms(x) · weight; a 2-D weight [L, d] is one row per
    leading index of x (the grouped K norm over every layer)."""
    w = weight.float()
    if w.ndim == 2:
        w = w.view(w.shape[0], *([1] * (x.ndim - 2)), w.shape[1])
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
    out.copy_(y.to(out.dtype))


def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """`_custom_ops.rotary_embedding`, in place, NeoX layout (the drafter's)."""
    assert is_neox and key is None
    rows = query.view(query.shape[0], -1, head_size)
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    half = cos.shape[-1]
    x1, x2 = rows[..., :half].float(), rows[..., half : 2 * half].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    rows[..., : 2 * half] = rotated.to(rows.dtype)


class _ContextWriter:
    """`impl.do_kv_cache_update`: keeps the context K/V the drafter writes."""

    k = v = None

    def do_kv_cache_update(self, layer, k, v, kv_cache, slot_mapping):
        self.k, self.v = k.clone(), v.clone()


class _ContextAttention(torch.nn.Module):
    """Stands in for one layer's paged `Attention`: attends the block's queries over the
    context K/V the drafter stored and the block's own, non-causal."""

    def __init__(self, attn, scale):
        super().__init__()
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_size, scale
        self.layer_name, self.kv_cache, self.impl = attn.layer_name, None, _ContextWriter()

    def forward(self, q, k, v):
        t, hd = q.shape[0], self.head_dim
        keys = torch.cat([self.impl.k, k.view(t, self.num_kv_heads, hd)])
        values = torch.cat([self.impl.v, v.view(t, self.num_kv_heads, hd)])
        group = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q.view(t, self.num_heads, hd).float(), keys.float())
        probs = torch.softmax(scores * self.scale, dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, values.float())
        return out.reshape(t, self.num_heads * hd).to(q.dtype)


class VllmSession:
    """vLLM's configs, its Qwen3 target model and its DFlash drafter, both loaded by its own
    loader from our exports (use inside `session()`). `loaded`: the tensor names its draft
    `load_weights` was handed; `draft`: `DFlashQwen3ForCausalLM`."""

    def __init__(self, target_dir, drafter_dir, *, block_size, dtype="bfloat16"):
        from vllm.config import (
            CompilationConfig,
            ModelConfig,
            ParallelConfig,
            SpeculativeConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.model_executor.model_loader import get_model
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
        from vllm.v1.worker.gpu.spec_decode.dflash.utils import load_dflash_model

        self.target_config = ModelConfig(
            model=str(target_dir), skip_tokenizer_init=True, dtype=dtype, seed=0
        )
        parallel = ParallelConfig()
        self.spec_config = SpeculativeConfig(
            method="dflash",
            model=str(drafter_dir),
            num_speculative_tokens=block_size - 1,
            target_model_config=self.target_config,
            target_parallel_config=parallel,
        )
        self.hf_config = self.spec_config.draft_model_config.hf_config
        self.vllm_config = VllmConfig(
            model_config=self.target_config,
            speculative_config=self.spec_config,
            parallel_config=parallel,
            compilation_config=CompilationConfig(mode=0, custom_ops=["none"]),
        )
        self.loaded: list[str] = []
        original = DFlashQwen3ForCausalLM.load_weights

        def recording(model, weights):
            def named():
                for name, tensor in weights:
                    self.loaded.append(name)
                    yield name, tensor

            return original(model, named())

        DFlashQwen3ForCausalLM.load_weights = recording
        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                self.target = get_model(vllm_config=self.vllm_config)
                self.draft = load_dflash_model(self.target, self.vllm_config)
        finally:
            DFlashQwen3ForCausalLM.load_weights = original

    def draft_logits(self, features_TxnD, bonus):
        """The drafter's logits for the K − 1 masked positions of one block after a context
        of T tokens at positions 0..T−1 (their target features, concatenated), the block
        [bonus, mask × (K − 1)] at positions T..T+K−1, as vLLM's DFlash proposer lays it out."""
        from vllm import _custom_ops
        from vllm.config import set_current_vllm_config

        inner = self.draft.model
        k = self.spec_config.num_speculative_tokens + 1
        feats = torch.from_numpy(np.array(features_TxnD, np.float32))
        t = feats.shape[0]
        dtype = inner.fc.params_dtype
        for layer, attn in zip(inner.layers, inner._attn_layers, strict=True):
            layer.self_attn.attn = _ContextAttention(attn, layer.self_attn.scaling)
        inner._attn_layers = [layer.self_attn.attn for layer in inner.layers]
        saved = (_custom_ops.rms_norm, _custom_ops.rotary_embedding)
        _custom_ops.rms_norm, _custom_ops.rotary_embedding = _rms_norm, _rotary_embedding
        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                context = self.draft.combine_hidden_states(feats.to(dtype))
                positions = torch.arange(t)
                self.draft.precompute_and_store_context_kv(context, positions, positions)
                ids = torch.tensor([bonus] + [inner.mask_token_id] * (k - 1))
                hidden = self.draft(ids, torch.arange(t, t + k))
                logits = self.draft.compute_logits(hidden[1:])
        finally:
            _custom_ops.rms_norm, _custom_ops.rotary_embedding = saved
        return logits.float().numpy()


@contextlib.contextmanager
def session():
    """The wheel importable on CPU (see the module docstring) with a one-process
    distributed group; afterwards all of it is undone."""
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": tempfile.mkdtemp()}
    with stack_stubs.side_folder(WHEEL_DIR, "vllm", STUBBED, env) as patches:
        import vllm.model_executor.layers.utils as layer_utils
        import vllm.model_executor.models.registry as registry
        from vllm.distributed import parallel_state
        from vllm.platforms.cpu import CpuPlatform

        def linear_dispatch(layer, remove_weight):
            layer.cpu_linear = torch.nn.functional.linear

        stack_stubs.patch(patches, registry, "_run_in_subprocess", lambda fn: fn())
        stack_stubs.patch(
            patches, CpuPlatform, "check_and_update_config", classmethod(lambda cls, c: None)
        )
        stack_stubs.patch(patches, layer_utils, "dispatch_cpu_unquantized_gemm", linear_dispatch)
        stack_stubs.patch(patches, torch.accelerator, "empty_cache", lambda: None)
        from vllm.config import VllmConfig, set_current_vllm_config

        init = f"file://{tempfile.mktemp()}"
        with set_current_vllm_config(VllmConfig()):
            parallel_state.init_distributed_environment(1, 0, init, 0, "gloo")
            parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
