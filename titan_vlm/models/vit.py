"""Vision transformer: patch embedding, learned positions, pre-norm blocks, bidirectional
attention."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_vlm.attention import attention
from titan_vlm.models.flavors import ViTArgs


class ViTAttention(nn.Module):
    """Separate q/k/v projections (as SigLIP's q_proj/k_proj/v_proj): a fused [3*dim] output
    split column-wise would give a tensor-parallel rank a mix of q and k columns, while separate
    ones split cleanly into whole heads per rank. Head counts are inferred (-1): the local count."""

    def __init__(self, a: ViTArgs):
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.q = nn.Linear(a.dim, a.dim)
        self.k = nn.Linear(a.dim, a.dim)
        self.v = nn.Linear(a.dim, a.dim)
        self.proj = nn.Linear(a.dim, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # unflatten/flatten infer the head count from the last dim alone: a rank may encode no
        # images (cp_vision=shard), and view(b, n, -1, ...) cannot infer -1 for zero elements
        q, k, v = (
            w(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
            for w in (self.q, self.k, self.v)
        )
        out = attention(q, k, v, layout=None)
        return self.proj(out.transpose(1, 2).flatten(2))


class ViTBlock(nn.Module):
    def __init__(self, a: ViTArgs):
        super().__init__()
        self.approximate = "tanh" if a.act == "gelu_tanh" else "none"  # SigLIP uses the tanh form
        self.norm1 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.attn = ViTAttention(a)
        self.norm2 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.fc1 = nn.Linear(a.dim, a.mlp_dim)
        self.fc2 = nn.Linear(a.mlp_dim, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.approximate))


class ViT(nn.Module):
    """images [n, C, H, W] -> patch features [n, num_patches, dim]."""

    def __init__(self, a: ViTArgs):
        super().__init__()
        self.args = a
        self.patch_embed = nn.Conv2d(
            a.channels, a.dim, kernel_size=a.patch_size, stride=a.patch_size
        )
        self.pos_embed = nn.Parameter(torch.zeros(1, a.num_patches, a.dim))
        self.layers = nn.ModuleList(ViTBlock(a) for _ in range(a.n_layers))
        self.norm = nn.LayerNorm(a.dim, eps=a.norm_eps)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)
