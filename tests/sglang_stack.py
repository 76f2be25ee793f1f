"""SGLang's own DFlash drafter, built and loaded on CPU from an export of ours (issue 42).

What runs is the wheel's code: its server-argument resolution for `--speculative-algorithm
DFLASH` (`ServerArgs` → `runtime_context.create_context`: reads our drafter's config.json for
the block size and the draft attention backend), its `ModelConfig(is_draft_model=True)`, its
model registry (`DFlashDraftModel` → `models/dflash.py::DFlashDraftModel`) and default model
loader (`get_model`: safetensors iterator, `load_weights`, post-load processing); then its
drafter's context path as the DFLASH worker runs it (`project_target_hidden`: fc + hidden norm;
per layer `kv_proj_only`, `apply_k_norm`, `apply_k_rope`, as
`dflash_worker_v2._append_target_hidden_sequential`) and the block forward through its decoder
layers and final norm. Replaced here, and only here:
- third-party modules the import needs but loading never uses (`STUBBED`: compiled kernels,
  triton, the server's transport and OpenAI protocol modules) are stand-ins;
- `SGLANG_USE_CPU_ENGINE=1` (its CPU build's code paths: torch-native norms and RoPE when the
  sgl-kernel CPU ops are absent, as here);
- the platform check of DFLASH's server arguments (`speculative_hook.current_platform`: DFLASH
  is accepted on cuda / npu / xpu devices only) answers "supported";
- in the forward only, each layer's `RadixAttention` (the paged KV pool and attention backend):
  torch attention of the block's queries over the context K/V the worker path computed plus
  the block's own, non-causal as the layer's `attn_type` (ENCODER_ONLY) says;
- the LM head: the target's, which SGLang's drafter borrows (here our target's weight).

The wheel is found in `$SGLANG_DIR` or `<repo>/.sglang`, installed there with `INSTALL`
(`dill` and `msgspec`, which its import runs, go in the same folder; the rest of its pins,
torch 2.9 and sgl-kernel among them, do not install next to ours).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import stack_stubs
import torch

from adaflash_jax.drafter.stacks import SGLANG

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_DIR = os.environ.get("SGLANG_DIR", os.path.join(REPO, ".sglang"))
VERSION = SGLANG  # the wheel this file runs (adaflash_jax.drafter.stacks)
INSTALL = f"pip install --no-deps --target .sglang sglang=={VERSION} dill==0.4.1 msgspec==0.23.0"
STUBBED = (
    "pybase64",
    "triton",
    "starlette",
    "zmq",
    "torchvision",
    "tvm_ffi",
    "sentencepiece",
    "compressed_tensors",
    "gguf",
    "einops",
    "partial_json_parser",
    "sgl_kernel",
    "sglang.srt.entrypoints.openai",
)


def available() -> bool:
    return os.path.isfile(os.path.join(WHEEL_DIR, "sglang", "srt", "models", "dflash.py"))


class _ContextAttention(torch.nn.Module):
    """Stands in for one layer's `RadixAttention`: the block's queries over the stored context
    K/V and the block's own, non-causal."""

    def __init__(self, attn):
        super().__init__()
        self.num_heads, self.num_kv_heads = attn.tp_q_head_num, attn.tp_k_head_num
        self.head_dim, self.scale, self.attn_type = attn.head_dim, attn.scaling, attn.attn_type
        self.k_scale = self.v_scale = None
        self.ctx_k = self.ctx_v = None

    def forward(self, q, k, v, forward_batch=None, **_):
        t, hd = q.shape[0], self.head_dim
        keys = torch.cat([self.ctx_k, k.reshape(t, self.num_kv_heads, hd)])
        values = torch.cat([self.ctx_v, v.reshape(t, self.num_kv_heads, hd)])
        group = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        queries = q.reshape(t, self.num_heads, hd).float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys.float()) * self.scale
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values.float())
        return out.reshape(t, self.num_heads * hd).to(q.dtype)


class SglangSession:
    """SGLang's resolved server arguments and its DFlash drafter loaded by its own loader from
    our export (use inside `session()`). `loaded`: the tensor names its `load_weights` was
    handed; `draft`: `DFlashDraftModel`."""

    def __init__(self, target_dir, drafter_dir, *, dtype="bfloat16"):
        from sglang.srt import runtime_context
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader import get_model
        from sglang.srt.models.dflash import DFlashDraftModel
        from sglang.srt.server_args import ServerArgs

        self.server_args = ServerArgs(
            model_path=str(target_dir),
            speculative_algorithm="DFLASH",
            speculative_draft_model_path=str(drafter_dir),
            device="cpu",
            tp_size=1,
            skip_tokenizer_init=True,
            dtype=dtype,
        )
        self.context = runtime_context.create_context(self.server_args, role="scheduler")
        self.loaded: list[str] = []
        original = DFlashDraftModel.load_weights

        def recording(model, weights):
            def named():
                for name, tensor in weights:
                    self.loaded.append(name)
                    yield name, tensor

            return original(model, named())

        DFlashDraftModel.load_weights = recording
        try:
            with runtime_context.use_context(self.context):
                self.model_config = ModelConfig(
                    str(drafter_dir),
                    is_draft_model=True,
                    speculative_algorithm="DFLASH",
                    dtype=dtype,
                )
                self.draft = get_model(
                    model_config=self.model_config,
                    load_config=LoadConfig(),
                    device_config=DeviceConfig("cpu"),
                )
        finally:
            DFlashDraftModel.load_weights = original

    def spec(self, name):
        """A resolved speculative server argument (SGLang's `get_spec()` bag)."""
        from sglang.srt import runtime_context

        with runtime_context.use_context(self.context):
            return getattr(runtime_context.get_spec(), name)

    def draft_logits(self, features_TxnD, bonus, embedding_VxD, lm_head_DxV):
        """The drafter's logits for the K − 1 masked positions of one block after a context
        of T tokens at positions 0..T−1, the block [bonus, mask × (K − 1)] at positions
        T..T+K−1 (K: the block size SGLang resolved), embedded with the target's table."""
        from sglang.srt import runtime_context

        draft, k = self.draft, self.spec("speculative_num_draft_tokens")
        mask = draft.draft_config.mask_token_id
        feats = torch.from_numpy(np.array(features_TxnD, np.float32))
        emb = torch.from_numpy(np.array(embedding_VxD, np.float32))
        head = torch.from_numpy(np.array(lm_head_DxV, np.float32))
        t = feats.shape[0]
        dtype = draft.fc.weight.dtype
        # one rank: no process group is ever used (tp_size 1), none is built
        with (
            runtime_context.use_context(self.context),
            self.context.parallel.override(tp_group=None),
            torch.no_grad(),
        ):
            ctx_hidden = draft.project_target_hidden(feats.to(dtype))
            ctx_positions = torch.arange(t)
            for layer in draft.layers:
                attn = layer.self_attn
                if not isinstance(attn.attn, _ContextAttention):
                    attn.attn = _ContextAttention(attn.attn)
                hidden = draft.prepare_context_hidden_for_kv(layer, ctx_hidden)
                ck, cv = attn.kv_proj_only(hidden)
                ck = attn.apply_k_rope(ctx_positions, attn.apply_k_norm(ck))
                attn.attn.ctx_k = ck.reshape(t, attn.num_kv_heads, attn.head_dim)
                attn.attn.ctx_v = cv.reshape(t, attn.num_kv_heads, attn.head_dim)
            ids = torch.tensor([bonus] + [mask] * (k - 1))
            out = draft(ids, torch.arange(t, t + k), None, input_embeds=emb[ids].to(dtype))
            return (out.hidden_states[1:].float() @ head).numpy()


@contextlib.contextmanager
def session():
    """The wheel importable on CPU (see the module docstring); afterwards all of it is undone."""
    # caches read by transformers / torch whose answers the stand-ins would change
    from torch._inductor import compile_fx  # noqa: F401  (imports triton's absence)
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    import_utils.is_torchvision_greater_or_equal("0.27")
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    with stack_stubs.side_folder(WHEEL_DIR, "sglang", STUBBED, env) as patches:
        from types import SimpleNamespace as NS

        import sglang.srt.arg_groups.speculative_hook as hook

        supported = NS(
            is_out_of_tree=lambda: True,
            supports_speculative_algorithm=lambda name: name == "DFLASH",
            supports_speculative_draft_attention_backend=lambda *_: True,
        )
        stack_stubs.patch(patches, hook, "current_platform", supported)
        yield
