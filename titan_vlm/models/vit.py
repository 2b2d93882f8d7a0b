"""Vision transformer: patch embedding, learned positions, pre-norm blocks, bidirectional attention."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_vlm.attention import attention
from titan_vlm.models.flavors import ViTArgs


class ViTAttention(nn.Module):
    def __init__(self, a: ViTArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.qkv = nn.Linear(a.dim, 3 * a.dim)
        self.proj = nn.Linear(a.dim, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        out = attention(q, k, v, layout=None)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class ViTBlock(nn.Module):
    def __init__(self, a: ViTArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.attn = ViTAttention(a)
        self.norm2 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.fc1 = nn.Linear(a.dim, a.mlp_dim)
        self.fc2 = nn.Linear(a.mlp_dim, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """images [n, C, H, W] -> patch features [n, num_patches, dim]."""

    def __init__(self, a: ViTArgs):
        super().__init__()
        self.args = a
        self.patch_embed = nn.Conv2d(a.channels, a.dim, kernel_size=a.patch_size, stride=a.patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, a.num_patches, a.dim))
        self.layers = nn.ModuleList(ViTBlock(a) for _ in range(a.n_layers))
        self.norm = nn.LayerNorm(a.dim, eps=a.norm_eps)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)
