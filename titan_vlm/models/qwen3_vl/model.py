"""Qwen3-VL (dense): the vision tower's embeddings at the prompt's image / video token slots of a
Qwen3 decoder with interleaved multimodal RoPE, and DeepStack: features of chosen tower blocks
added to the decoder's hidden states at the same slots after its first layers. No parallelism
in here.

    pixel_values + grid_thw --encode--> embeds [slots, (1 + k) * dim]: per image slot the main
                                        embedding, then k DeepStack features (vision.py)
    tokens [B, T] + embeds + layout --decode--> logits [B, T, vocab] (text section)

Everything between the two (CP's replication over the cp group and its gradient sum, the
broadcast or sharded encoding, the layout's placement into the image prefix and among a kept
sample's text) moves an image slot's row, so the DeepStack features follow the embeddings
exactly wherever they go, and their gradients are summed over cp with them, once, before the
mergers and the tower. `decode` places the rows as the layout says and splits them: the main
embeddings enter as Qwen2.5-VL's do; feature j [same slots] is added after decoder layer j
(`Qwen3Decoder.forward`). The rest is Qwen2.5-VL's (qwen2_5_vl/model.py): the per-slot M-RoPE
positions from the layout's slot data, images causal in the decoder, `forward` the
single-process reference that tests compare with transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from titan_vlm.files import read_json
from titan_vlm.layout import SeqLayout
from titan_vlm.models.common.qwen_vl.model import MRopeDecoder, QwenVLModel
from titan_vlm.models.loading import load_whole_model
from titan_vlm.models.qwen3_vl.args import Qwen3VLArgs
from titan_vlm.models.qwen3_vl.hf_adapter import hf_names, hf_same
from titan_vlm.models.qwen3_vl.hf_config import args_from_hf_config
from titan_vlm.models.qwen3_vl.mrope import interleaved_mrope_cos_sin
from titan_vlm.models.qwen3_vl.vision import VisionTower

# What DeepStack adds after a decoder layer: the features of the local image prefix [B, N, dim]
# and of the image slots among the text section [M, dim] (None: there are none)
Features = tuple[torch.Tensor, torch.Tensor | None]


class Qwen3Decoder(MRopeDecoder):
    """MRopeDecoder (common/decoder.py's blocks with per-slot M-RoPE) with Qwen3-VL's interleaved
    frequency layout and DeepStack's additions between layers."""

    def rotary(self, layout: SeqLayout) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        return interleaved_mrope_cos_sin(
            self.positions(layout), a.head_dim, a.rope_theta, self.mrope_section, a.rope
        )

    def forward(
        self,
        tokens: torch.Tensor,
        image_embeds: torch.Tensor | None,
        layout: SeqLayout,
        inline_embeds: torch.Tensor | None = None,
        deepstack: list[Features] | None = None,
    ) -> torch.Tensor:
        """Decoder.forward, and after layer j the j-th `deepstack` features added at the image
        slots (the image prefix, then the inline ones; `add_at_image_slots`)."""
        h, n_img = self.local_sequence(tokens, image_embeds, layout, inline_embeds)
        h = self.run_layers(h, layout, self.deepstack_after(deepstack or [], n_img, layout))
        return self.output(self.norm(h[:, n_img:]))

    def deepstack_after(
        self, features: list[Features], n_img: int, layout: SeqLayout
    ) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """run_layers' `after`: the j-th `features` added at the image slots after layer j."""

        def after(i: int, h: torch.Tensor) -> torch.Tensor:
            if i < len(features):
                return self.add_at_image_slots(h, n_img, features[i], layout)
            return h

        return after

    @staticmethod
    def add_at_image_slots(
        h: torch.Tensor, n_img: int, features: Features, layout: SeqLayout
    ) -> torch.Tensor:
        """h [B, n_img + T, dim] with `features` added at its image slots (the image prefix, then
        the text section's inline image slots); every other slot unchanged. Only the image
        slots' rows are touched: no sequence-long buffer per feature."""
        prefix, inline = features
        if n_img:
            h = torch.cat([h[:, :n_img] + prefix.to(h.dtype), h[:, n_img:]], dim=1)
        if inline is not None:
            rows, cols = layout.inline_slots(h.device)
            h = h.index_put((rows, cols + n_img), inline.to(h.dtype), accumulate=True)
        return h


class Qwen3VL(QwenVLModel):
    """`vision` (tower, merger, DeepStack mergers) and `decoder` (Qwen3Decoder). The verbs are
    the Qwen-VL ones (common/qwen_vl/model.py: encode_images patchifies a batch's QwenVisuals,
    forward is the single-process reference), with image embeddings (1 + k) * dim wide
    (`embed_dim`) and `decode` splitting them (module docstring)."""

    args: Qwen3VLArgs
    vision: VisionTower
    decoder: Qwen3Decoder

    def __init__(self, args: Qwen3VLArgs):
        super().__init__(args, VisionTower(args.tower, args.attention_kernel), Qwen3Decoder(args))

    @property
    def embed_dim(self) -> int:
        """The width of an image slot's row: its embedding and its DeepStack features."""
        return self.args.embed_width

    def decode(self, tokens: torch.Tensor, embeds: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """tokens [B, T] (the layout's text section), embeds [image slots, (1 + k) * dim] in
        image-id order -> logits [B, T, vocab] of the text section."""
        prefix, inline, deepstack = self.split_embeds(embeds, layout)
        return self.decoder(tokens, prefix, layout, inline, deepstack)

    def split_embeds(
        self, embeds: torch.Tensor, layout: SeqLayout
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[Features]]:
        """embeds [image slots, (1 + k) * dim] placed by the layout and split: the main
        embeddings of the image prefix [B, N, dim] and of the inline image slots [M, dim] (or
        None), and the k DeepStack features of both."""
        dim = self.args.decoder.dim
        prefix = layout.place_images(embeds).split(dim, dim=-1)  # [B, N, dim] each
        inline = layout.inline_embeds(embeds)
        inlines = inline.split(dim, dim=-1) if inline is not None else (None,) * len(prefix)
        return prefix[0], inlines[0], list(zip(prefix[1:], inlines[1:], strict=True))

    def stage_input(
        self, tokens: torch.Tensor, embeds: torch.Tensor, layout: SeqLayout
    ) -> tuple[torch.Tensor, Callable[[int, torch.Tensor], torch.Tensor] | None]:
        """VisionLanguageModel.stage_input with DeepStack: feature j added after layer j, which
        the first stage holds (`first_stage_layers`: the features exist there only)."""
        prefix, inline, features = self.split_embeds(embeds, layout)
        h, n_img = self.decoder.local_sequence(tokens, prefix, layout, inline)
        return h, self.decoder.deepstack_after(features, n_img, layout)

    @property
    def first_stage_layers(self) -> int:
        """The layers DeepStack adds after (0..k-1)."""
        return self.args.deepstack


def from_hf_folder(folder: Path) -> Qwen3VL:
    """The model of a transformers-saved Qwen3-VL folder: its config.json's args, its weights."""
    config = folder / "config.json"
    model = Qwen3VL(args_from_hf_config(read_json(config, str(folder)), str(config)))
    load_whole_model(model, folder, hf_names, hf_same)
    return model
