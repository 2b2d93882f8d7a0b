"""The vision-language model: ViT -> projector -> decoder. No parallelism in here."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_vlm.layout import SeqLayout
from titan_vlm.models.decoder import Decoder
from titan_vlm.models.flavors import VLMArgs
from titan_vlm.models.vit import ViT


class Projector(nn.Module):
    """Two-layer MLP from the ViT width to the decoder width (LLaVA-1.5 style)."""

    def __init__(self, vit_dim: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(vit_dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VLM(nn.Module):
    def __init__(self, args: VLMArgs):
        super().__init__()
        self.args = args
        self.vision = ViT(args.vision)
        self.projector = Projector(args.vision.dim, args.decoder.dim)
        self.decoder = Decoder(args.decoder)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """images [n, C, H, W] -> image embeddings [n, tokens_per_image, decoder dim]."""
        return self.projector(self.vision(images))

    def forward(
        self, images: torch.Tensor, tokens: torch.Tensor, layout: SeqLayout
    ) -> torch.Tensor:
        """Single-device forward: images [n, C, H, W] (every image of the batch, n may be 0),
        tokens [B, T] the layout's text slots; returns the logits of the text slots. The trainer
        runs the same steps itself so that context parallelism can step in between encoder and
        decoder."""
        return self.decoder(tokens, layout.place_images(self.encode_images(images)), layout)
