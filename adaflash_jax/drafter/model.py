"""DFlash block-diffusion drafter in Flax NNX (docs/design.md §3).

Dimensions: B batch, C context slots, N blocks per sequence, K block size, S training
sequence length, D model, nD concatenated target features, V vocab, H/Kv heads, Dh head dim.

The drafter owns no embedding and no LM head: the target's frozen tables are passed in as
arrays (`embedding_VxD`, `lm_head_DxV`) on every call. Target features are fused once per
committed token (`fc` → `hidden_norm`) and injected as extra keys/values into every layer;
the fused context skips each layer's input norm and MLP. Queries come from the block only.
A sliding-window layer (`DrafterConfig.layer_types`) sees only the context keys within its
window (`masks.context_visible`); in serving its context cache is a ring buffer of those
W − 1 entries (`model/ring_cache.RingKVLayer`), so its memory is constant past the window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from adaflash_jax.drafter import masks
from adaflash_jax.drafter.config import DrafterConfig
from adaflash_jax.drafter.length_head import LengthHead
from adaflash_jax.drafter.train_attention import DEFAULT_CHUNK, BlockSparse
from adaflash_jax.model.cache import Cache
from adaflash_jax.model.kv_cache import KVEntries, KVLayer
from adaflash_jax.model.layers import AttentionProjections, Dense, RMSNorm, SwiGLU
from adaflash_jax.model.ring_cache import RingKVLayer
from adaflash_jax.sharding.rows import RowLayout, constrain_rows


@struct.dataclass
class DraftOutput:
    hidden_BxKxD: jax.Array  # final-normed block states (length-head input)
    logits_BxKm1xV: jax.Array  # predictions for block positions 1..K-1


class DrafterAttention(AttentionProjections):
    """Queries from the block only; keys/values are [context ; block], each projected with
    this layer's own k/v (the context's were projected once, when it was committed)."""

    def __init__(self, cfg: DrafterConfig, *, rngs, dtype, param_dtype):
        super().__init__(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            eps=cfg.rms_norm_eps,
            qk_norm=True,
            rope=(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def __call__(self, x_BxTxD, positions_BxT, ctx_k, ctx_v, attention):
        """`attention(q, ctx_k, ctx_v, blk_k, blk_v)`: `masks.DenseMask` or
        `train_attention.BlockSparse`."""
        q = self.queries(x_BxTxD, positions_BxT)
        blk_k, blk_v = self.keys_values(x_BxTxD, positions_BxT)
        return self.output(attention(q, ctx_k, ctx_v, blk_k, blk_v))


class DrafterLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs, dtype, param_dtype):
        norm_kw = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm_kw)
        self.self_attn = DrafterAttention(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm_kw)
        self.mlp = SwiGLU(
            cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )

    def __call__(self, x, positions, ctx_k, ctx_v, attention):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nnx.Module):
    def __init__(
        self, config: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        self.config = config
        self.dtype = dtype
        d = config.hidden_size
        self.fc = Dense(
            config.num_features * d,
            d,
            logical_axes=("features", "embed"),
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.hidden_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.layers = nnx.List(
            [
                DrafterLayer(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                for _ in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.length_head = (
            LengthHead(d, config.length_head, block_size=config.block_size, rngs=rngs)
            if config.length_head
            else None
        )

    # ---- context ---------------------------------------------------------------------------
    def fuse(self, features_BxTxnD):
        """Target features of committed tokens → one context vector per token."""
        return self.hidden_norm(self.fc(features_BxTxnD))

    def init_context_cache(
        self, batch: int, capacity: int, dtype=None, *, ring_windows: bool = True
    ) -> Cache:
        """Per drafter layer the context keys/values of the committed tokens: every one
        (`KVLayer` of `capacity`) in a full layer; in a sliding layer whose W − 1 visible
        entries are fewer than `capacity`, only those (`RingKVLayer`; `ring_windows=False`:
        a full `KVLayer` read through the same window, the reference it must equal)."""
        cfg, dtype = self.config, dtype or self.dtype
        kv = dict(kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=dtype)
        layers = []
        for i in range(cfg.num_hidden_layers):
            window = cfg.layer_window(i)
            if ring_windows and window is not None and window - 1 < capacity:
                layers.append(RingKVLayer.create(batch=batch, window=window, **kv))
            else:
                layers.append(KVLayer.create(batch=batch, capacity=capacity, **kv))
        return Cache.create(layers, batch=batch, capacity=capacity, dtype=dtype)

    def context_entries(self, cache: Cache, features_BxTxnD) -> tuple[KVEntries, ...]:
        """Every layer's context entries (keys/values [B, T, Kv, Dh] in the cache dtype) of
        T committed tokens' features at `cache.positions(T)`, for `Cache.commit` (the engine
        computes them inside a verify branch, over that branch's width only)."""
        positions_BxT = cache.positions(features_BxTxnD.shape[1])
        ctx_BxTxD = self.fuse(features_BxTxnD)
        entries = []
        for layer, layer_cache in zip(self.layers, cache.layers):
            k, v = layer.self_attn.keys_values(ctx_BxTxD, positions_BxT)
            entries.append(KVEntries(k.astype(layer_cache.dtype), v.astype(layer_cache.dtype)))
        return tuple(entries)

    def append_context(self, cache: Cache, features_BxTxnD, num_new_B=None) -> Cache:
        """Commits T tokens' features into every layer's context (all T, or each row's first
        `num_new_B[b]`)."""
        b, t, _ = features_BxTxnD.shape
        n_B = jnp.full((b,), t, jnp.int32) if num_new_B is None else num_new_B
        return cache.commit(self.context_entries(cache, features_BxTxnD), n_B)

    # ---- serving: one block per row --------------------------------------------------------
    def draft(self, cache: Cache, bonus_B, embedding_VxD, lm_head_DxV) -> DraftOutput:
        """Drafts K−1 tokens after each row's last committed token, in one forward pass.

        The bonus token sits at position `cache.lengths[b]`: the context holds features of
        every committed token before it. A sliding layer reads only the W − 1 entries its
        window can see: its ring buffer's, or those gathered from a longer full cache.
        """
        cfg = self.config
        b, k = bonus_B.shape[0], cfg.block_size
        block_BxK = jnp.concatenate(
            [bonus_B[:, None], jnp.full((b, k - 1), cfg.mask_token_id, bonus_B.dtype)], axis=1
        )
        positions_BxK = cache.positions(k)
        masks_by_view = {}  # the layers' shared masks, by (kind, window, size)
        x = jnp.take(embedding_VxD, block_BxK, axis=0).astype(self.dtype)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v, mask = _context_view(
                cache.layers[i], cache.lengths, k, cfg.layer_window(i), masks_by_view
            )
            x = layer(x, positions_BxK, ctx_k, ctx_v, mask)
        hidden_BxKxD = self.norm(x)
        logits = jnp.dot(hidden_BxKxD[:, 1:], lm_head_DxV.astype(self.dtype))
        return DraftOutput(hidden_BxKxD=hidden_BxKxD, logits_BxKm1xV=logits)

    # ---- training: N blocks per sequence in one forward ------------------------------------
    def train_hidden(
        self,
        features_BxSxnD,
        tokens_BxS,
        anchors_BxN,
        valid_BxN,
        embedding_VxD,
        *,
        attention: str = "sparse",
        attention_chunk: int = DEFAULT_CHUNK,
        rows: RowLayout | None = None,
    ):
        """Final-normed block states [B, N, K, D] for blocks anchored at `anchors_BxN`.

        Block n starts with the token at its anchor and sees target features strictly before
        the anchor; blocks never see each other (docs/design.md §3). `attention`: "sparse" computes
        block→context in chunks of `attention_chunk` context keys plus block→own block
        (`train_attention`); "dense" scores all N·K × (S + N·K) pairs under
        `masks.train_mask` (same result, memory grows with N·K·S). `rows` keeps the
        activations' rows split over those mesh axes (the embedding table and the fc weights
        are fsdp-sharded: without it XLA may keep them in place and replicate the batch).
        """
        cfg = self.config
        b, s, _ = features_BxSxnD.shape
        n, k = anchors_BxN.shape[1], cfg.block_size
        if attention_chunk < 1:
            raise ValueError(f"attention chunk must be positive, got {attention_chunk}")
        if attention not in ("sparse", "dense"):
            raise ValueError(f"train attention must be 'sparse' or 'dense', got {attention!r}")
        patterns = {}  # window → the layer's attention
        for w in {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}:
            if attention == "sparse":  # a padding block sees no context, only itself
                context_len_BxN = jnp.where(valid_BxN, anchors_BxN, 0)
                patterns[w] = BlockSparse(context_len_BxN, chunk=attention_chunk, window=w)
            else:
                mask = masks.train_mask(anchors_BxN, valid_BxN, s, k, window=w)
                patterns[w] = masks.DenseMask(mask)
        ctx_BxSxD = constrain_rows(rows, self.fuse(features_BxSxnD), b)
        ctx_pos_BxS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        first_BxN = jnp.take_along_axis(tokens_BxS, anchors_BxN, axis=1)
        block_BxNxK = jnp.concatenate(
            [first_BxN[..., None], jnp.full((b, n, k - 1), cfg.mask_token_id, tokens_BxS.dtype)],
            axis=-1,
        )
        positions_BxNK = (anchors_BxN[..., None] + jnp.arange(k, dtype=jnp.int32)).reshape(b, n * k)
        x = jnp.take(embedding_VxD, block_BxNxK.reshape(b, n * k), axis=0).astype(self.dtype)
        x = constrain_rows(rows, x, b)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = layer.self_attn.keys_values(ctx_BxSxD, ctx_pos_BxS)
            pattern = patterns[cfg.layer_window(i)]
            x = constrain_rows(rows, layer(x, positions_BxNK, ctx_k, ctx_v, pattern), b)
        return self.norm(x).reshape(b, n, k, -1)

    def logits(self, hidden, lm_head_DxV):
        return jnp.dot(hidden.astype(self.dtype), lm_head_DxV.astype(self.dtype))


def _context_view(ctx, lengths_B, block_size: int, window: int | None, masks_by_view: dict):
    """A layer's context keys, values [B, C, Kv, Dh] and block mask: a ring's window, the
    W − 1 entries gathered from a full cache longer than the window, or the whole cache.
    Masks are computed once per (kind, window, size) and shared through `masks_by_view`."""
    if isinstance(ctx, RingKVLayer):
        ctx_k, ctx_v, positions_BxW = ctx.read(lengths_B)
        view = ("ring", window, ctx.slots)
    elif window is not None and window - 1 < ctx.capacity:
        positions_BxW = masks.window_slots(lengths_B, window)
        ctx_k = _gather_slots(ctx.k_BxSxKvxDh, positions_BxW)
        ctx_v = _gather_slots(ctx.v_BxSxKvxDh, positions_BxW)
        view = ("gathered", window, ctx.capacity)
    else:
        ctx_k, ctx_v, positions_BxW = ctx.k_BxSxKvxDh, ctx.v_BxSxKvxDh, None
        view = ("full", window, ctx.capacity)
    if view not in masks_by_view:
        if positions_BxW is None:
            mask = masks.decode_mask(lengths_B, ctx.capacity, block_size, window)
        else:
            mask = masks.windowed_mask(positions_BxW, lengths_B, block_size, window)
        masks_by_view[view] = masks.DenseMask(mask)
    return ctx_k, ctx_v, masks_by_view[view]


def _gather_slots(cache_BxSxKvxDh, slots_BxW):
    """The cache entries at `slots` (clipped into the cache; out-of-range ones are masked)."""
    index_BxW = jnp.clip(slots_BxW, 0, cache_BxSxKvxDh.shape[1] - 1)
    return jnp.take_along_axis(cache_BxSxKvxDh, index_BxW[:, :, None, None], axis=1)
