"""tpu-inference's own JAX DFlash drafter, run on CPU on an export of ours (issue 27).

What runs is the wheel's code: `models/jax/dflash.py` (model and weight loader, through
`model_loader._get_nnx_model`, the server's flax loading path) and the proposer
`spec_decode/jax/dflash.py` (`_prepare_inputs`: accepted-token filtering, context projection,
noise block; `_propose`: the forward and greedy draft tokens). Replaced here, and only here:
- the heavy imports (vllm, torchax, qwix) are empty stand-in modules (`stub_imports`);
- the Pallas attention kernel: the wheel's own pure-JAX `ref_ragged_paged_attention` runs in
  its place, without the single-device `shard_map` around it (the reference loops in Python
  over the requests, so the model runs under jit with the attention metadata as constants);
- the server objects (vLLM config, runner) are plain namespaces with the fields read.

The wheel is found in `$TPU_INFERENCE_DIR` or `<repo>/.tpu_inference`, installed there with
`pip install --no-deps --target .tpu_inference tpu-inference==0.32.0` (its own pins, jax 0.11.2
and more, do not install next to ours; its code runs on our jax 0.10.2).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_DIR = os.environ.get("TPU_INFERENCE_DIR", os.path.join(REPO, ".tpu_inference"))
INSTALL = "pip install --no-deps --target .tpu_inference tpu-inference==0.32.0"
STUBBED = ("vllm", "torchax", "qwix")
PAGE, PAGES = 16, 8  # one request's draft KV cache: 8 pages of 16 tokens


def available() -> bool:
    return os.path.isdir(os.path.join(WHEEL_DIR, "tpu_inference"))


class _Anything(type):
    """A stand-in class: any attribute is another stand-in class, calling one returns one."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        return _Anything("instance", (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def stub_imports():
    """The wheel importable with its heavy imports stubbed; afterwards every module it
    brought in is dropped and the environment variables it set at import are restored."""
    finder, env = _StubFinder(), dict(os.environ)
    sys.meta_path.insert(0, finder)
    sys.path.insert(0, WHEEL_DIR)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(WHEEL_DIR)
        for name in list(sys.modules):
            if name.split(".")[0] in (*STUBBED, "tpu_inference"):
                del sys.modules[name]
        os.environ.clear()
        os.environ.update(env)


def _unsharded_reference_attention(
    mesh,
    q,
    k,
    v,
    kv_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    distribution,
    attention_sink,
    *,
    sm_scale,
    attention_chunk_size=None,
    q_scale=None,
    k_scale=None,
    v_scale=None,
    update_kv_cache=True,
    use_causal_mask=True,
    attn_logits_soft_cap=None,
    decode_query_size=1,
):
    """`sharded_ragged_paged_attention` on one device, the reference kernel for the Pallas one
    (same arguments; returns (output, cache))."""
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel

    assert attention_sink is None and update_kv_cache
    return kernel.ref_ragged_paged_attention(
        q,
        k,
        v,
        kv_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        distribution,
        sm_scale=sm_scale,
        sliding_window=attention_chunk_size,
        soft_cap=attn_logits_soft_cap,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        use_causal_mask=use_causal_mask,
    )


def _model_config(hf_config, path, *, head_dim, hidden, vocab):
    return NS(
        hf_config=hf_config,
        model=str(path),
        get_head_size=lambda: head_dim,
        get_hidden_size=lambda: hidden,
        get_vocab_size=lambda: vocab,
        is_multimodal_model=False,
        dtype=jnp.bfloat16,
        seed=0,
        hf_overrides=None,
    )


class TpuInferenceDrafter:
    """The wheel's DFlash drafter for one request, loaded from `drafter_dir` by its loader,
    sharing the target's embedding and LM head as its proposer does (call inside
    `stub_imports`). `patch_rope`: apply the RoPE fix of docs/patches (θ and scaling from the
    drafter's config) after loading."""

    def __init__(self, drafter_dir, target_dir, embedding_VxD, lm_head_DxV, *, patch_rope=False):
        import transformers
        from tpu_inference.layers.common import attention_interface
        from tpu_inference.layers.jax.rope_interface import get_rope_scaling, get_rope_theta
        from tpu_inference.models.common import model_loader
        from tpu_inference.models.jax.dflash import DFlashForCausalLM
        from tpu_inference.spec_decode.jax.dflash import DFlashProposer

        attention_interface.sharded_ragged_paged_attention = _unsharded_reference_attention
        drafter_hf = transformers.AutoConfig.from_pretrained(drafter_dir)
        target_hf = transformers.AutoConfig.from_pretrained(target_dir)
        dims = dict(
            head_dim=drafter_hf.head_dim,
            hidden=drafter_hf.hidden_size,
            vocab=drafter_hf.vocab_size,
        )
        self.block_size = drafter_hf.block_size
        self.num_layers = drafter_hf.num_hidden_layers
        self.num_features = len(drafter_hf.dflash_config["target_layer_ids"])
        self.vllm_config = NS(
            speculative_config=NS(
                draft_model_config=_model_config(drafter_hf, drafter_dir, **dims),
                num_speculative_tokens=self.block_size - 1,
                method="dflash",
            ),
            model_config=_model_config(target_hf, target_dir, **dims),
            parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
            load_config=NS(download_dir=None, load_format="auto"),
            quant_config=None,
            additional_config={},
        )
        self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        model = model_loader._get_nnx_model(
            DFlashForCausalLM, self.vllm_config, jax.random.key(0), self.mesh, is_draft_model=True
        )
        if patch_rope:
            fresh = transformers.AutoConfig.from_pretrained(drafter_dir)
            for attn in _attentions(model):
                attn.rope_theta = get_rope_theta(fresh, 1_000_000.0)
                attn.rope_scaling = get_rope_scaling(fresh)
        self.rope = [(a.rope_theta, a.rope_scaling) for a in _attentions(model)]  # as used
        model.model.embed_tokens.embedding.set_value(embedding_VxD.astype(jnp.bfloat16))
        model.lm_head.weight.set_value(lm_head_DxV.astype(jnp.bfloat16))
        self.graphdef, state = nnx.split(model)
        self.treedef = jax.tree_util.tree_structure(state)
        self.leaves = tuple(jax.tree_util.tree_leaves(state))
        runner = NS(mesh=self.mesh, max_num_tokens=64, max_model_len=PAGE * PAGES)
        self.proposer = DFlashProposer(self.vllm_config, runner)
        self.proposer.model_fn = self._model_fn
        self.proposer.compute_logits_fn = self._method_fn("compute_logits")
        self.proposer.combine_hidden_states_fn = self._method_fn("combine_hidden_states")
        self.proposer.state_leaves = self.leaves
        self._propose = DFlashProposer._propose.__wrapped__  # jit needs a traceable kernel
        shape = _kv_cache_shape(drafter_hf)
        self.kv_caches = [jnp.zeros(shape, jnp.bfloat16) for _ in range(self.num_layers)]
        self.block_tables = jnp.arange(PAGES, dtype=jnp.int32)

    def _merged(self, leaves):
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, leaves))

    def _method_fn(self, name):
        def call(leaves, hidden, *_):
            return getattr(self._merged(leaves), name)(hidden)

        return call

    def _model_fn(self, leaves, kv_caches, input_ids, target_hidden_states, metadata):
        """The model under jit, the attention metadata (and the accepted tokens' offsets and
        positions) as constants: the reference kernel needs them concrete."""
        md = jax.tree.map(np.asarray, metadata)
        hidden, start_loc, positions = target_hidden_states
        start_loc, positions = np.asarray(start_loc), np.asarray(positions)

        def run(leaves, kv_caches, input_ids, hidden):
            model = self._merged(leaves)
            return model(kv_caches, input_ids, (hidden, start_loc, positions), md)

        return jax.jit(run)(leaves, kv_caches, input_ids, hidden)

    def propose(self, input_ids_T, features_TxnD, seq_len, num_rejected, bonus) -> list[int]:
        """One proposer step after a target step over `input_ids_T` at positions
        `seq_len − T ..` whose last `num_rejected` tokens were rejected: the K − 1 drafts after
        `bonus`."""
        from tpu_inference.layers.common.attention_metadata import AttentionMetadata

        t = input_ids_T.shape[0]
        metadata = AttentionMetadata(
            input_positions=jnp.arange(seq_len - t, seq_len, dtype=jnp.int32),
            block_tables=self.block_tables,
            seq_lens=jnp.array([seq_len], jnp.int32),
            query_start_loc=jnp.array([0, t], jnp.int32),
            request_distribution=jnp.array([0, 0, 1], jnp.int32),
        )
        aux = tuple(jnp.split(features_TxnD.astype(jnp.bfloat16), self.num_features, axis=-1))
        with jax.set_mesh(self.mesh):
            hidden, ids, _, draft_md = self.proposer._prepare_inputs(
                self.leaves,
                self.block_tables,
                metadata,
                input_ids_T.astype(jnp.int32),
                aux,
                jnp.array([bonus], jnp.int32),
                jnp.zeros((1,), jnp.int32),
                jnp.zeros((1,), bool),
                jnp.array([num_rejected], jnp.int32),
                jnp.ones((1,), jnp.int32),
            )
            self.kv_caches, drafts = self._propose(
                self.proposer, self.leaves, self.kv_caches, ids, draft_md, hidden
            )
        return np.asarray(drafts)[0].tolist()


def _attentions(model):
    return [layer.self_attn for layer in model.model.layers]


def _kv_cache_shape(drafter_hf):
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel

    kv = drafter_hf.num_key_value_heads
    return kernel.get_kv_cache_shape(PAGES, PAGE, kv, drafter_hf.head_dim, jnp.bfloat16)


def load_error(drafter_dir, target_dir, embedding_VxD, lm_head_DxV) -> str | None:
    """The loader's error on `drafter_dir` (None when it loads)."""
    try:
        TpuInferenceDrafter(drafter_dir, target_dir, embedding_VxD, lm_head_DxV)
    except ValueError as e:
        return str(e)
    return None
