"""The frozen target LLM: a Llama / Qwen3 / Qwen3-MoE / Qwen3.5 / gpt-oss decoder in Flax NNX
(docs/design.md §2, §2.1, §2.3).

Dimensions: B batch, T new tokens per row, S cache capacity, D model, V vocab,
H query heads, Kv kv heads, Dh head dim, L layers, n feature layers.

One layer loop serves every use: training (no cache: causal over T), and T new tokens per
row at `cache.positions(T)`, causal among themselves and seeing every committed entry. With
a cache every layer only reads its own (`model/cache.py`) and returns its per-token entries;
the cache mode says who commits them:
- "write" (prefill, plain decoding): the forward commits every row's first `num_new_B[b]`
  tokens (`Cache.commit`) and returns the new cache;
- "read" (the speculative engine's verify): the forward returns the entries (`entries`) and
  the engine commits the accepted tokens after acceptance. The engine verifies inside a
  `lax.switch` over width buckets inside a `while_loop`, and XLA copies a buffer that a
  conditional branch updates (jax-ml/jax#5986, #38145): the whole cache, every step. So the
  cache stays out of the branch's outputs and is committed once, after the switch.
It can return the outputs of chosen decoder layers, the drafter's context features.
A Qwen3-MoE layer differs only in its MLP (`model/moe.py`), chosen per layer by the config.
A hybrid (Qwen3.5) layer's mixer is a Gated DeltaNet (`model/gated_deltanet.py`) or gated
attention, per `layer_types`; both take the same call, and a DeltaNet's cache is its
`RecurrentState` (its entries: the recurrence's per-token inputs).
A gpt-oss layer's attention adds q/k/v/o biases and a sink logit per head (in every path:
`attend`, `attend_cached`, the kernel), and its sliding layers see only their window (a full
`KVLayer` cache under the window mask); its MLP is the `MoEVariant` of biased experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from adaflash_jax.model.cache import Cache
from adaflash_jax.model.config import TargetConfig
from adaflash_jax.model.delta_rule import DEFAULT_CHUNK
from adaflash_jax.model.gated_deltanet import GatedDeltaNet
from adaflash_jax.model.kv_cache import KVEntries, KVLayer
from adaflash_jax.model.layers import (
    AttentionProjections,
    Dense,
    RMSNorm,
    SwiGLU,
    attend,
    attend_cached,
    in_window,
    normal_init,
)
from adaflash_jax.model.moe import MoEBlock, MoEVariant
from adaflash_jax.model.packing import Packing, to_rows, to_tokens
from adaflash_jax.model.ragged_attention import ragged_attend_cached
from adaflash_jax.sharding.rows import RowLayout, constrain_rows

CACHE_MODES = ("write", "read")
VERIFY_ATTENTION = ("xla", "pallas", "interpret")  # `TargetLM(verify_attention=...)`


@struct.dataclass
class TargetOutput:
    hidden_BxTxD: jax.Array  # after the final norm
    logits_BxTxV: jax.Array | None
    features_BxTxnD: jax.Array | None  # chosen layers' features (`TargetLM.feature`), in
    # request order, concatenated
    cache: Cache | None  # "write" mode: the cache with the new tokens committed
    entries: tuple | None = None  # "read" mode: per layer its entries of the T tokens (K/V
    # in the cache dtype, or a recurrence's inputs), for `Cache.commit`


class Attention(AttentionProjections):
    def __init__(
        self, cfg: TargetConfig, layer: int, *, rngs, dtype, param_dtype, verify_attention="xla"
    ):
        super().__init__(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            eps=cfg.rms_norm_eps,
            qk_norm=cfg.qk_norm,
            rope=(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling),
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            output_gate=cfg.is_hybrid,
            zero_centered_norms=cfg.is_hybrid,
            bias=cfg.attention_bias,
        )
        self.verify_attention = verify_attention  # static: VERIFY_ATTENTION
        self.window = cfg.layer_window(layer)  # static: None = full attention
        self.sinks = (
            nnx.Param(
                normal_init(rngs, (cfg.num_attention_heads,), param_dtype),
                logical_axes=("q_heads",),
            )
            if cfg.attention_sinks
            else None
        )

    def __call__(
        self,
        x_BxTxD,
        positions_BxT,
        mask_BxTxS,
        cache=None,
        lengths_B=None,
        packing=None,
        commit_B=None,
    ):
        """Without `cache`: attention over x under the mask. With the layer's cache and the
        rows' committed `lengths_B`: attention over [committed entries ; the new tokens
        (causal)]. "read" (no `commit_B`): the cache is only read, and the new keys/values
        return as this layer's entries (`KVEntries`, in the cache dtype). "write": the
        cache commits each row's first `commit_B[b]` of them (`KVLayer.commit`) and the
        queries attend over the committed cache (written first, the update stays in place),
        returning it. With a `packing` ("read"), x is the packed stream [M, 1, D]: the
        projections run there, the attention per row in the row layout, where the entries
        return [B, W, ...]."""
        q, gate = self.gated_queries(x_BxTxD, positions_BxT)
        k, v = self.keys_values(x_BxTxD, positions_BxT)
        q, k, v, positions_BxT = (to_rows(packing, a) for a in (q, k, v, positions_BxT))
        sinks_H = None if self.sinks is None else self.sinks[...]
        if cache is None:
            if self.window is not None:  # training: keys at the queries' own positions
                mask_BxTxS = mask_BxTxS & in_window(positions_BxT, positions_BxT, self.window)
            return self.output(attend(q, k, v, mask_BxTxS, sinks_H), gate), None
        entries = KVEntries(k.astype(cache.k_BxSxKvxDh.dtype), v.astype(cache.v_BxSxKvxDh.dtype))
        if commit_B is not None:
            cache = cache.commit(entries, lengths_B, None, commit_B)
            key_pos_S = jnp.arange(cache.capacity, dtype=jnp.int32)
            mask_BxTxS = key_pos_S[None, None, :] <= positions_BxT[:, :, None]
            mask_BxTxS = mask_BxTxS & in_window(key_pos_S, positions_BxT, self.window)
            k_all, v_all = (c.astype(q.dtype) for c in (cache.k_BxSxKvxDh, cache.v_BxSxKvxDh))
            return self.output(attend(q, k_all, v_all, mask_BxTxS, sinks_H), gate), cache
        k, v = (e.astype(q.dtype) for e in (entries.k_BxTxKvxDh, entries.v_BxTxKvxDh))
        visible = None if packing is None else packing.visible_BxWxW  # a tree's ancestors
        args = (q, cache.k_BxSxKvxDh, cache.v_BxSxKvxDh, lengths_B, k, v, visible)
        kw = dict(sinks_H=sinks_H, window=self.window, positions_BxT=positions_BxT)
        if self.verify_attention == "xla":
            out = attend_cached(*args, **kw)
        else:  # the kernel reads each row's committed cache only
            out = ragged_attend_cached(*args, **kw, interpret=self.verify_attention == "interpret")
        return self.output(to_tokens(packing, out), gate), entries


def moe_variant(cfg: TargetConfig) -> MoEVariant:
    """The family's sparse block (`model/moe.py`): gpt-oss's biased router and experts, the
    clamped SwiGLU and the softmax over the chosen k; Qwen3-MoE's otherwise."""
    if cfg.model_type != "gpt_oss":
        return MoEVariant()
    return MoEVariant(
        router_bias=True,
        expert_bias=True,
        activation="clamped_swiglu",
        alpha=cfg.swiglu_alpha,
        limit=cfg.swiglu_limit,
        softmax_after_topk=True,
    )


class DecoderLayer(nnx.Module):
    def __init__(
        self, cfg: TargetConfig, layer: int, *, rngs, dtype, param_dtype, chunk, verify_attention
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.family = cfg.model_type  # static: the checkpoint's tensor names follow it
        norm_kw = dict(
            eps=cfg.rms_norm_eps, zero_centered=cfg.is_hybrid, dtype=dtype, param_dtype=param_dtype
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm_kw)
        linear = cfg.is_linear_layer(layer)
        self.self_attn = (
            None if linear else Attention(cfg, layer, verify_attention=verify_attention, **kw)
        )
        self.linear_attn = GatedDeltaNet(cfg, chunk=chunk, **kw) if linear else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm_kw)
        if cfg.is_moe_layer(layer):
            self.mlp = MoEBlock(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                norm_topk_prob=cfg.norm_topk_prob,
                shared_hidden=cfg.shared_expert_intermediate_size,
                variant=moe_variant(cfg),
                **kw,
            )
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, **kw)

    def __call__(
        self,
        x,
        positions,
        mask,
        cache=None,
        lengths_B=None,
        rows=None,
        packing=None,
        commit_B=None,
    ):
        """`cache`: this layer's cache; returns (x, its entries ("read"), its committed cache
        ("write": `commit_B`), or None)."""
        mixer = self.self_attn if self.linear_attn is None else self.linear_attn
        h = self.input_layernorm(x)
        mixed, new = mixer(h, positions, mask, cache, lengths_B, packing, commit_B)
        x = x + mixed
        h = self.post_attention_layernorm(x)
        x = x + (self.mlp(h, rows) if isinstance(self.mlp, MoEBlock) else self.mlp(h))
        return x, new


class TargetLM(nnx.Module):
    def __init__(
        self,
        config: TargetConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        chunk: int = DEFAULT_CHUNK,
        verify_attention: str = "xla",
    ):
        """`chunk`: the Gated DeltaNet's chunk length for training and prefill (hybrids).
        `verify_attention` (VERIFY_ATTENTION): how a verify pass attends over the cache and
        its new tokens: "xla" (`layers.attend_cached`), "pallas" (the TPU kernel
        `ragged_attention.py`, which reads each row's committed cache only), "interpret"
        (that kernel in Pallas' interpreter, any backend: for checking it)."""
        if verify_attention not in VERIFY_ATTENTION:
            raise ValueError(
                f"verify_attention {verify_attention!r}: choose from {VERIFY_ATTENTION}"
            )
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Param(
            normal_init(rngs, (config.vocab_size, config.hidden_size), param_dtype),
            logical_axes=("vocab", "embed"),
        )
        self.layers = nnx.List(
            [
                DecoderLayer(
                    config,
                    i,
                    rngs=rngs,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    chunk=chunk,
                    verify_attention=verify_attention,
                )  # fmt: skip
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(
            config.hidden_size,
            eps=config.rms_norm_eps,
            zero_centered=config.is_hybrid,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Dense(
                config.hidden_size,
                config.vocab_size,
                logical_axes=("embed", "vocab"),
                rngs=rngs,
                dtype=dtype,
                param_dtype=param_dtype,
            )
        )

    # ---- frozen pieces the drafter borrows (passed to it as arrays, never stored) ----------
    def embedding_VxD(self) -> jax.Array:
        return self.embed_tokens[...]

    def lm_head_DxV(self) -> jax.Array:
        if self.lm_head is None:
            return self.embed_tokens[...].T
        return self.lm_head.kernel[...]

    def feature(self, layer: int, x_BxTxD):
        """Decoder layer `layer`'s output `x_BxTxD` as the drafter's feature: HF
        `hidden_states[layer + 1]` (docs/design.md §2). HF's last entry is after the final norm, so
        the last layer's feature is normed too."""
        if layer == self.config.num_hidden_layers - 1:
            return self.norm(x_BxTxD)
        return x_BxTxD

    def embed(self, tokens):
        return jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.dtype)

    def logits(self, hidden_BxTxD):
        return jnp.dot(hidden_BxTxD.astype(self.dtype), self.lm_head_DxV().astype(self.dtype))

    def init_cache(self, batch: int, capacity: int, dtype=None) -> Cache:
        """K/V for attention layers (in `dtype`), a float32 RecurrentState for DeltaNets."""
        cfg, dtype = self.config, dtype or self.dtype
        layers = [
            KVLayer.create(
                batch=batch,
                capacity=capacity,
                kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim,
                dtype=dtype,
            )
            if layer.linear_attn is None
            else layer.linear_attn.init_state(batch)
            for layer in self.layers
        ]
        return Cache.create(layers, batch=batch, capacity=capacity, dtype=dtype)

    def __call__(
        self,
        tokens_BxT: jax.Array,
        *,
        cache: Cache | None = None,
        cache_mode: str = "write",
        positions_BxT: jax.Array | None = None,
        num_new_B: jax.Array | None = None,
        segment_ids_BxT: jax.Array | None = None,
        feature_layers: Sequence[int] = (),
        compute_logits: bool = True,
        rows: RowLayout | None = None,
        packing: Packing | None = None,
    ) -> TargetOutput:
        """Runs T new tokens per row.

        Without a cache the tokens attend causally to each other (training). With a cache,
        row b's tokens sit at `cache.positions(T)` and see every committed entry before them.
        "write" mode returns the cache with each row's first `num_new_B[b]` tokens (default
        T) committed: padding past them is not. "read" mode leaves the cache alone and
        returns the layers' entries (`entries`). `rows` keeps the activations' rows split over
        those mesh axes (FSDP: weights are gathered, activations never are); a MoE layer
        routes each row shard's tokens on its own chip. With a `packing` ("read" mode only),
        `tokens_BxT` is the packed stream [M, 1] (`model/packing.py`): logits and features
        come back packed [M, 1, ...], the new entries in the row layout [B, W, ...].
        """
        b, t = tokens_BxT.shape
        feature_layers = tuple(feature_layers)
        for i in feature_layers:
            if not 0 <= i < self.config.num_hidden_layers:
                raise ValueError(
                    f"feature layer {i} is outside the target's "
                    f"{self.config.num_hidden_layers} layers"
                )
        if cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {cache_mode!r}")
        if packing is not None and (cache is None or cache_mode != "read"):
            raise ValueError("packed tokens verify against a cache in read mode")
        if segment_ids_BxT is not None and self.config.is_hybrid:
            raise ValueError("packed segments would share a recurrent state: unpack for hybrids")
        lengths_B = mask_BxTxS = commit_B = None
        if cache is not None:
            lengths_B = cache.lengths
            if cache_mode == "write":
                commit_B = jnp.full((b,), t, jnp.int32) if num_new_B is None else num_new_B
                commit_B = commit_B.astype(jnp.int32)
            positions_BxT = (
                cache.positions(t) if packing is None else packing.positions(lengths_B)[:, None]
            )
        else:
            if positions_BxT is None:
                positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            mask_BxTxS = positions_BxT[:, None, :] <= positions_BxT[:, :, None]
            if segment_ids_BxT is not None:
                mask_BxTxS &= segment_ids_BxT[:, None, :] == segment_ids_BxT[:, :, None]

        x = constrain_rows(rows, self.embed(tokens_BxT), b)
        features, news = {}, []
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache.layers[i]
            x, new = layer(
                x, positions_BxT, mask_BxTxS, layer_cache, lengths_B, rows, packing, commit_B
            )
            x = constrain_rows(rows, x, b)
            news.append(new)
            if i in feature_layers:
                features[i] = self.feature(i, x)
        hidden = self.norm(x)
        new_cache = entries = None
        if commit_B is not None:  # "write": each layer committed its own entries
            new_cache = cache.committed(tuple(news), commit_B)
        elif cache is not None:
            entries = tuple(news)
        feats = (
            jnp.concatenate([features[i] for i in feature_layers], axis=-1)
            if feature_layers
            else None
        )
        return TargetOutput(
            hidden_BxTxD=hidden,
            logits_BxTxV=self.logits(hidden) if compute_logits else None,
            features_BxTxnD=feats,
            cache=new_cache,
            entries=entries,
        )
