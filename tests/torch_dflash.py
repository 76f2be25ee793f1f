"""A second implementation of the exported drafter, in PyTorch, written from docs/design.md §3, §4.3
and §6 only (never from our JAX code), for the equivalence tests.

Dimensions: B batch, C context tokens (committed, with target features), K block size,
D model, nD concatenated target features, H/Kv query/kv heads, Dh head dim, V vocab.

One forward drafts one block per row: the block is [last committed token, K−1 mask tokens]
at positions C..C+K−1, embedded with the TARGET's embedding table; the context is the target
features of the C committed tokens before it (positions 0..C−1), fused once (`fc` →
`hidden_norm`). In every layer queries come from the block only, and keys/values are
[k_proj(ctx); k_proj(block)] / [v_proj(ctx); v_proj(block)], `k_norm` on all keys, RoPE at
each key's own position; the context skips `input_layernorm` and the MLP. The block attends
bidirectionally to itself and to every context token. The final-normed block states go to
the TARGET's LM head (positions 1..K−1) and to the two-model thresh head (all K positions).

A `sliding_attention` layer (`config.layer_types`, with `use_sliding_window`) limits every
query to the keys less than `sliding_window` positions behind it: the flash-attention window
of `sliding_window − 1` positions each way, non-causal, that z-lab's reference `dflash/model.py`
passes for those layers (written here from that rule, as an explicit mask).

RoPE here is the plain rotate-half form (no scaling), as the Qwen3-style test exports use.
It is a `transformers.PreTrainedModel` with the export's tensor names, so `from_pretrained`
reads an export and `save_pretrained` re-saves it the way PyTorch users do.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from torch.nn import functional as F


class DFlashConfig(transformers.Qwen3Config):
    """Qwen3's config; the DFlash keys (`block_size`, `dflash_config`, `num_target_layers`)
    ride along as extra attributes, as they do with the public DFlash loader."""


def _rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return _rms(x, self.weight, self.eps)


def _rope_theta(c) -> float:
    # transformers >= 5 keeps it in rope_parameters; 4.x as a top-level attribute
    params = c.to_dict().get("rope_parameters") or {}
    return float(params.get("rope_theta", c.to_dict().get("rope_theta", 10_000.0)))


def _rotate(x_BxHxTxDh, pos_T, theta):
    dh = x_BxHxTxDh.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    ang = (pos_T.double()[:, None] * inv[None, :]).float()
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x_BxHxTxDh.chunk(2, dim=-1)
    return x_BxHxTxDh * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c, layer):
        super().__init__()
        self.h, self.kv, self.dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.theta = _rope_theta(c)
        sliding = c.layer_types[layer] == "sliding_attention"
        self.window = c.sliding_window if sliding else None  # None unless use_sliding_window
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.dh, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv * self.dh, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv * self.dh, bias=False)
        self.o_proj = nn.Linear(self.h * self.dh, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = (
            RMSNorm(self.dh, c.rms_norm_eps),
            RMSNorm(self.dh, c.rms_norm_eps),
        )

    def forward(self, x_BxKxD, ctx_BxCxD):
        b, k, _ = x_BxKxD.shape
        c = ctx_BxCxD.shape[1]
        pos = torch.arange(c + k)
        both = torch.cat([ctx_BxCxD, x_BxKxD], 1)
        q = self.q_norm(self.q_proj(x_BxKxD).view(b, k, self.h, self.dh)).transpose(1, 2)
        keys = self.k_norm(self.k_proj(both).view(b, c + k, self.kv, self.dh)).transpose(1, 2)
        vals = self.v_proj(both).view(b, c + k, self.kv, self.dh).transpose(1, 2)
        q, keys = _rotate(q, pos[c:], self.theta), _rotate(keys, pos, self.theta)
        g = self.h // self.kv
        keys, vals = keys.repeat_interleave(g, 1), vals.repeat_interleave(g, 1)
        scores = (q @ keys.transpose(-1, -2)).float() * self.dh**-0.5
        if self.window is not None:  # key j visible to the query at p iff |p − j| < window
            far_KxCK = (pos[c:, None] - pos[None, :]).abs() >= self.window
            scores = scores.masked_fill(far_KxCK, float("-inf"))
        probs = torch.softmax(scores, -1)
        out = (probs.to(vals.dtype) @ vals).transpose(1, 2).reshape(b, k, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c, layer):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, ctx):
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class ThreshHead(nn.Module):
    """r = sigmoid(out(h)), h = SiLU(down([mean_k Y; Y_{K−1}])), h += SiLU(res(h))."""

    def __init__(self, d, r):
        super().__init__()
        self.down, self.res = nn.Linear(2 * d, r), nn.Sequential(nn.Linear(r, r))
        self.out = nn.Linear(r, 1)

    def forward(self, y_BxKxD):
        h = F.silu(self.down(torch.cat([y_BxKxD.mean(1), y_BxKxD[:, -1]], -1)))
        h = h + F.silu(self.res(h))
        return torch.sigmoid(self.out(h))[:, 0]


class DFlashDraftModel(transformers.PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = ""

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        d, dflash = config.hidden_size, config.dflash_config
        self.mask_token_id = dflash["mask_token_id"]
        n_features = len(dflash["target_layer_ids"])
        self.fc = nn.Linear(n_features * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if dflash.get("use_thresh_head_two_model"):
            self.thresh_head_two_model = ThreshHead(d, dflash["thresh_head_bottleneck_dim"])
        self.post_init()

    def forward(self, features_BxCxnD, bonus_B, embed_tokens: nn.Module):
        """Final-normed block states [B, K, D] of the block after C committed tokens."""
        k = self.config.block_size
        block_BxK = torch.full((bonus_B.shape[0], k), self.mask_token_id, dtype=torch.long)
        block_BxK[:, 0] = bonus_B
        x = embed_tokens(block_BxK)
        ctx = self.hidden_norm(self.fc(features_BxCxnD))
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)

    def draft_logits(self, hidden_BxKxD, lm_head: nn.Module):
        return lm_head(hidden_BxKxD[:, 1:])

    def ratio(self, hidden_BxKxD):
        return self.thresh_head_two_model(hidden_BxKxD)


def target_features(hidden_states, layer_ids):
    """DFlash features: layer i is HF `hidden_states[i + 1]` (the last entry is post-norm)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], -1)


@torch.no_grad()
def greedy_speculative(target, drafter, prompt, max_new_tokens):
    """Greedy speculative decoding of one prompt, whole block verified every step
    (docs/design.md §5).

    Returns (generated tokens, accepted drafts per verify step). The target reruns the whole
    sequence each step (no cache), so the context features come from a different path than
    an incremental engine's."""
    layer_ids = drafter.config.dflash_config["target_layer_ids"]
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    out = target(torch.tensor([prompt]), output_hidden_states=True)
    seq = list(prompt) + [int(out.logits[0, -1].argmax())]
    feats = target_features(out.hidden_states, layer_ids)  # of every token but the last
    accepted = []
    while len(seq) - len(prompt) < max_new_tokens:
        hidden = drafter(feats, torch.tensor([seq[-1]]), embed)
        drafts = drafter.draft_logits(hidden, lm_head)[0].argmax(-1).tolist()
        out = target(torch.tensor([seq + drafts]), output_hidden_states=True)
        best = out.logits[0, len(seq) - 1 :].argmax(-1).tolist()  # [K] target choices
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        accepted.append(n)
        seq += drafts[:n] + [best[n]]
        feats = target_features(out.hidden_states, layer_ids)[:, : len(seq) - 1]
    return seq[len(prompt) : len(prompt) + max_new_tokens], accepted
