"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

It takes the row's image embeddings (already projected to its width) and its text tokens and
runs them as one sequence `[image tokens, text tokens]`; where each local token sits in the row
comes from the `SeqLayout`, so the same code runs unsharded and context-parallel.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_vlm.attention import SeqLayout, attention
from titan_vlm.models.flavors import DecoderArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D]; cos/sin [B or 1, 1, L, D] gathered at each token's row position."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: SeqLayout
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, layout)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: SeqLayout
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, layout)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(DecoderBlock(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        cos, sin = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        out_std = 0.02 / (2 * self.args.n_layers) ** 0.5  # residual projections scaled by depth
        for name, p in self.named_parameters():
            if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
                nn.init.normal_(p, std=0.02)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=out_std)
        nn.init.normal_(self.output.weight, std=self.args.dim**-0.5)

    def forward(
        self, tokens: torch.Tensor, image_embeds: torch.Tensor | None, layout: SeqLayout
    ) -> torch.Tensor:
        """tokens [B, T] (local text), image_embeds [B, N, dim] or None -> logits [B, T, vocab] of
        the text.

        The local sequence is `[image tokens, text tokens]`; `layout.positions` gives each its
        row position (RoPE and the causal order)."""
        h = self.tok_embeddings(tokens)
        n_img = 0
        if image_embeds is not None:
            n_img = image_embeds.shape[1]
            h = torch.cat([image_embeds.to(h.dtype), h], dim=1)
        if n_img != layout.num_image_tokens:
            raise ValueError(f"layout says {layout.num_image_tokens} image tokens, got {n_img}")
        cos = self.rope_cos[layout.positions].unsqueeze(1)
        sin = self.rope_sin[layout.positions].unsqueeze(1)
        for layer in self.layers:
            h = layer(h, cos, sin, layout)
        return self.output(self.norm(h[:, n_img:]))
