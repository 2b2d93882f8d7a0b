"""The vision-language model: ViT -> projector -> decoder. No parallelism in here."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_vlm.data.image_batch import Images
from titan_vlm.layout import SeqLayout
from titan_vlm.models.common.activations import ACT_FNS
from titan_vlm.models.common.decoder import Decoder
from titan_vlm.models.common.moe import RouterStats
from titan_vlm.models.llava.args import VLMArgs
from titan_vlm.models.llava.vit import ViT
from titan_vlm.models.spec import VisionLanguageModel


class Projector(nn.Module):
    """Two-layer MLP from the ViT width to the decoder width (LLaVA's multi_modal_projector:
    linear_1 -> projector_hidden_act -> linear_2, biases per multimodal_projector_bias)."""

    def __init__(self, vit_dim: int, dim: int, act: str = "gelu", bias: bool = True):
        super().__init__()
        self.act = ACT_FNS[act]
        self.fc1 = nn.Linear(vit_dim, dim, bias=bias)
        self.fc2 = nn.Linear(dim, dim, bias=bias)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise in place, drawing from the random generator as construction does."""
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VLM(VisionLanguageModel):
    """The "llava" family's model (models/spec.py: VisionLanguageModel)."""

    def __init__(self, args: VLMArgs):
        super().__init__()
        self.args = args
        self.vision = ViT(args.vision, args.attention_kernel)
        self.projector = Projector(
            args.vision.dim, args.decoder.dim, args.projector_act, args.projector_bias
        )
        self.decoder = Decoder(args.decoder, args.attention_kernel)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter (and the RoPE tables) in place. It draws from the random
        generator in the order construction does, so that after the same seed

            with torch.device("meta"): model = VLM(args)
            model.to_empty(device=...); model.init_weights()

        gives the weights `VLM(args)` gets on the CPU."""
        self.vision.init_weights()
        self.projector.init_weights()
        self.decoder.init_weights()

    def encode_images(self, images: Images) -> torch.Tensor:
        """images [n, C, H, W] -> image embeddings [n, image_tokens(H, W), decoder dim]; an
        ImageList -> [sum of image_tokens, decoder dim] in batch order (the projector keeps the
        ViT's token count)."""
        return self.projector(self.vision(images))

    def image_tokens(self, height: int, width: int) -> int:
        return self.args.image_tokens(height, width)

    def decode(self, tokens: torch.Tensor, embeds: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        return self.decoder(
            tokens, layout.place_images(embeds), layout, layout.inline_embeds(embeds)
        )

    def router_stats(self) -> RouterStats | None:
        return self.decoder.take_router_stats()

    def vision_modules(self) -> list[nn.Module]:
        return [self.vision, self.projector]

    @property
    def tokens_per_image(self) -> int:
        return self.args.tokens_per_image

    @property
    def embed_dim(self) -> int:
        return self.args.decoder.dim

    @property
    def image_size(self) -> int:
        return self.args.vision.image_size

    @property
    def bidirectional_images(self) -> bool:
        return self.args.image_attention == "bidirectional"

    def forward(self, images: Images, tokens: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """Single-device forward: images [n, C, H, W] or an ImageList (every image of the batch,
        n may be 0),
        tokens [B, T] the layout's text slots; returns the logits of the text slots. The trainer
        calls `encode_images` and `decode` itself so that context parallelism can step in
        between them."""
        return self.decode(tokens, self.encode_images(images), layout)
