"""Vision transformer: patch embedding, learned positions, pre-norm blocks, bidirectional
attention. With the right ViTArgs it is a SigLIP or a CLIP vision tower as LLaVA uses it (the
features of `hidden_states[vision_feature_layer]`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_vlm.attention import attention
from titan_vlm.models.activations import ACT_FNS
from titan_vlm.models.flavors import ViTArgs


class ViTAttention(nn.Module):
    """Separate q/k/v projections (as SigLIP's and CLIP's q_proj/k_proj/v_proj): a fused [3*dim]
    output split column-wise would give a tensor-parallel rank a mix of q and k columns, while
    separate ones split cleanly into whole heads per rank. Head counts are inferred (-1): the
    local count."""

    def __init__(self, a: ViTArgs, attention_kernel: str):
        super().__init__()
        self.attention_kernel = attention_kernel  # model.attention_kernel
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
        out = attention(q, k, v, None, self.attention_kernel)
        return self.proj(out.transpose(1, 2).flatten(2))


class ViTBlock(nn.Module):
    def __init__(self, a: ViTArgs, attention_kernel: str):
        super().__init__()
        self.act = ACT_FNS[a.act]
        self.norm1 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.attn = ViTAttention(a, attention_kernel)
        self.norm2 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.fc1 = nn.Linear(a.dim, a.mlp_dim)
        self.fc2 = nn.Linear(a.mlp_dim, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """images [n, C, H, W] -> features [n, tokens_per_image, dim].

    embeddings = patches (+ class token in front) + pos_embed [num_positions, dim] -> pre_norm ->
    the `n_layers` blocks -> norm (post_norm) -> position 0 dropped (drop_first). Parameters
    (class_embedding [dim], pos_embed [positions, dim]) have the Hugging Face tensors' shapes;
    `pre_norm` and `norm` exist only when the args ask for them."""

    def __init__(self, a: ViTArgs, attention_kernel: str):
        super().__init__()
        self.args = a
        self.patch_embed = nn.Conv2d(
            a.channels, a.dim, kernel_size=a.patch_size, stride=a.patch_size, bias=a.patch_bias
        )
        if a.class_token:
            self.class_embedding = nn.Parameter(torch.empty(a.dim))
        self.pos_embed = nn.Parameter(torch.zeros(a.num_positions, a.dim))
        if a.pre_norm:
            self.pre_norm = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.layers = nn.ModuleList(ViTBlock(a, attention_kernel) for _ in range(a.n_layers))
        if a.post_norm:
            self.norm = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self._init_embeddings()

    def _init_embeddings(self) -> None:
        nn.init.normal_(self.pos_embed, std=0.02)
        if self.args.class_token:
            nn.init.normal_(self.class_embedding, std=0.02)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter in place, drawing from the random generator in the order
        construction does: after the same seed, a model built on the meta device and
        materialised (to_empty) gets the weights a model built on the CPU has."""
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear, nn.LayerNorm)):
                m.reset_parameters()
        self._init_embeddings()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        if self.args.class_token:
            x = torch.cat([self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.pos_embed
        if self.args.pre_norm:
            x = self.pre_norm(x)
        for layer in self.layers:
            x = layer(x)
        if self.args.post_norm:
            x = self.norm(x)
        return x[:, 1:] if self.args.drop_first else x
