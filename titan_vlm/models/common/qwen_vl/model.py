"""The Qwen-VL families' model verbs (`QwenVLModel`) and decoder (`MRopeDecoder`): a family's
tower's embeddings at the prompt's image / video token slots of common/decoder.py's decoder with
multimodal RoPE. No parallelism in here.

The decoder's blocks, norm and head are common/decoder.py's (the tower's out_hidden_size is its
width); only the rotary positions differ from a Llama-shaped model's, so `decode` runs its blocks
with M-RoPE's cos / sin (mrope.py; a family may lay the frequencies out its own way by overriding
MRopeDecoder.rotary) instead of the Decoder's 1-D tables:

    pixel_values + grid_thw --encode--> embeds [sum of t*h*w / m^2, width]   (images, videos)
    tokens [B, T] + embeds (slot order) + layout --decode--> logits [B, T, vocab] (text section)

`decode` takes what the trainer's decode takes: the layout's text section, the image-slot
embeddings in the layout's image-id order, and the SeqLayout, whose `slot_data[MROPE_POSITIONS]`
[3, B, L] holds each local slot's three positions (gathered from the rows' [3, B, S] by
SeqLayout.gather_slot_data). The attention mask is the layout's: causal within a sample, the
image slots like text (Qwen-VL images are causal in the decoder).

`forward` is the single-process reference that tests compare with transformers: rows of
input_ids as the processor makes them (one sample a row), their 3-D positions, pixels, and it
returns logits [B, L, vocab] for every slot, image slots included.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn as nn

from titan_vlm.data.image_batch import Images
from titan_vlm.layout import SeqLayout, build_layout
from titan_vlm.models.common.decoder import Decoder, decoder_weight_init
from titan_vlm.models.common.moe import RouterStats
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.images import MROPE_POSITIONS, QwenVisuals
from titan_vlm.models.common.qwen_vl.mrope import mrope_cos_sin
from titan_vlm.models.common.qwen_vl.processor import patchify_frames
from titan_vlm.models.loading import Init
from titan_vlm.models.spec import VisionLanguageModel


class MRopeDecoder(Decoder):
    """common/decoder.py's Decoder with multimodal RoPE: each local slot's three positions come
    from the layout's slot data (MROPE_POSITIONS, [3, B, L]); no 1-D tables are built."""

    def __init__(self, args: Qwen25VLArgs):
        self.mrope_section = args.mrope_section
        super().__init__(args.decoder, args.attention_kernel)

    def _init_rope(self) -> None:
        """No 1-D tables (M-RoPE computes cos / sin per batch)."""

    def rotary(self, layout: SeqLayout) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        positions = self.positions(layout)
        return mrope_cos_sin(positions, a.head_dim, a.rope_theta, self.mrope_section, a.rope)

    @staticmethod
    def positions(layout: SeqLayout) -> torch.Tensor:
        """The local slots' M-RoPE positions [3, B, L] (the layout's slot data)."""
        if MROPE_POSITIONS not in layout.slot_data:
            raise ValueError(f"the layout carries no {MROPE_POSITIONS!r} slot data")
        positions = layout.slot_data[MROPE_POSITIONS]  # [3, B, L]
        if positions.shape[1:] != layout.positions.shape:
            raise ValueError(
                f"{MROPE_POSITIONS} {tuple(positions.shape)} do not match the local slots "
                f"{tuple(layout.positions.shape)}"
            )
        return positions


class QwenTower(nn.Module, ABC):
    """A Qwen-VL family's vision tower: (pixel_values [N, patch_dim], grid_thw [n, 3]) -> one row
    per merge unit [N / m^2, width], in the processor's order (models/qwen2_5_vl/vision.py,
    models/qwen3_vl/vision.py)."""

    @abstractmethod
    def init_weights(self) -> None:
        """Re-initialise every parameter in place."""


class QwenVLModel(VisionLanguageModel):
    """`vision` (a family's tower: (pixel_values, grid_thw) -> one row per merge unit) and
    `decoder` (an MRopeDecoder: tok_embeddings, layers, norm, output). As the trainer, CP and
    generate use it (models/spec.py VisionLanguageModel): `encode_images` of a batch's
    QwenVisuals, `decode` of a rank's text section with the M-RoPE positions its layout carries
    (slot_data); the base class's forward_local runs them. `forward` is the single-process
    reference (module docstring)."""

    vision: QwenTower

    def __init__(self, args: Qwen25VLArgs, vision: QwenTower, decoder: MRopeDecoder):
        super().__init__()
        self.args = args
        self.vision = vision
        self.decoder = decoder

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter (and the decoder's buffers) in place."""
        self.vision.init_weights()
        self.decoder.init_weights()

    def encode_images(self, images: Images) -> torch.Tensor:
        """A batch's QwenVisuals (images.py) -> embeds [sum of their slots, dim] in batch order:
        each image's (video's) frames patchified as transformers' processor lays them out, all
        of them through the tower at once. None (a CP rank's empty share) -> [0, dim], the
        tower's blocks still run (FSDP's collectives stay in step)."""
        if not isinstance(images, QwenVisuals):
            raise TypeError(f"a Qwen-VL model encodes QwenVisuals, not {type(images).__name__}")
        v = self.args.vision
        rows, grids = [], []
        for image in images.tensors:
            frames = image if image.ndim == 4 else image.unsqueeze(0)
            patches, grid = patchify_frames(
                frames, v.patch_size, v.spatial_merge_size, v.temporal_patch_size
            )
            rows.append(patches)
            grids.append(grid)
        # (not the weight's new_zeros: under FSDP it is a sharded DTensor outside the forward)
        pixels = torch.cat(rows) if rows else torch.zeros(0, v.patch_dim, device=images.device)
        grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        return self.vision(pixels.to(images.device), grid_thw)

    def image_tokens(self, height: int, width: int) -> int:
        return self.args.image_tokens(height, width)

    def router_stats(self) -> RouterStats | None:
        return self.decoder.take_router_stats()

    def vision_modules(self) -> list[nn.Module]:
        return [self.vision]

    @property
    def tokens_per_image(self) -> int:
        """Slots of an image of `image_size` (images take their own: QwenRule)."""
        return self.args.tokens_per_image

    @property
    def embed_dim(self) -> int:
        return self.args.decoder.dim

    @property
    def image_size(self) -> int:
        """The side of the built-in data's square images, one attention window (images keep
        their own sizes: QwenRule)."""
        return self.args.image_size

    @property
    def bidirectional_images(self) -> bool:
        """Qwen2.5-VL's image tokens are causal in the decoder, like text."""
        return False

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [sum of t*h*w, C*T*P*P], grid_thw [n, 3] -> embeds [sum of t*h*w / m^2,
        dim], each image's (video's) in order, the images in grid order."""
        return self.vision(pixel_values, grid_thw)

    def decode(self, tokens: torch.Tensor, embeds: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """tokens [B, T] (the layout's text section), embeds [image slots, dim] in image-id order
        -> logits [B, T, vocab] of the text section (the decoder's forward, so FSDP's hooks on it
        run; M-RoPE through MRopeDecoder.rotary)."""
        return self.decoder(
            tokens, layout.place_images(embeds), layout, layout.inline_embeds(embeds)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        positions: torch.Tensor,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Single-process forward of rows input_ids [B, L] (one sample each, no padding) whose
        image (video) tokens are the processor's runs of vision.tokens(grid) per grid of
        image_grid_thw (video_grid_thw), grids in batch order; positions [3, B, L] (mrope's
        batch_rope_index) -> logits [B, L, vocab] of every text slot (zeros at image slots: no
        loss is ever on them)."""
        embeds, image = self._vision_slots(
            input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
        )
        rows, length = input_ids.shape
        doc = torch.arange(rows).view(rows, 1).expand(rows, length)
        text, layout = build_layout(doc, image.cpu())  # text [B, T]: the text section's slots
        layout.slot_data = layout.gather_slot_data({MROPE_POSITIONS: positions})
        tokens = input_ids.gather(1, text.clamp(min=0).to(input_ids.device))
        local = self.decode(tokens, embeds, layout)  # [B, T, vocab]: the text slots
        order = text.to(local.device)  # row position of each text slot
        real = order >= 0
        row = torch.arange(rows, device=local.device).view(rows, 1).expand_as(order)
        logits = local.new_zeros(rows, length, local.shape[-1])
        logits[row[real], order[real]] = local[real]
        return logits

    def _vision_slots(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        pixel_values_videos: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds [vision slots, dim] in row-major slot order, image [B, L]): the embeddings of
        the images' (videos') token slots, and each vision slot's image id (the images and videos
        numbered in row-major order of their runs; -1 for text). The i-th image takes the i-th
        vision.tokens(grid) image-token slots in row-major order (transformers' masked_scatter)."""
        flat = input_ids.flatten()
        weight = self.decoder.tok_embeddings.weight
        embeds = weight.new_zeros(len(flat), self.embed_dim)  # [B * L, width of a slot's row]
        owner = torch.full_like(flat, -1)  # the image / video each vision slot belongs to
        objects = 0
        for token, pixels, grid_thw in (
            (self.args.image_token_id, pixel_values, image_grid_thw),
            (self.args.video_token_id, pixel_values_videos, video_grid_thw),
        ):
            where = flat == token
            slots = int(where.sum())
            if pixels is None or grid_thw is None:
                if slots:
                    raise ValueError(f"{slots} token(s) {token} but no pixels for them")
                continue
            out = self.encode(pixels, grid_thw)  # [tokens, dim]
            if slots != len(out):
                raise ValueError(f"{slots} token(s) {token} for {len(out)} embeddings")
            embeds = embeds.masked_scatter(where.unsqueeze(-1), out.to(embeds.dtype))
            sizes = torch.tensor([self.args.vision.tokens(*g) for g in grid_thw.tolist()])
            ids = torch.repeat_interleave(torch.arange(len(sizes)), sizes) + objects
            owner[where] = ids.to(owner.device)
            objects += len(sizes)
        vision = owner >= 0
        starts = torch.ones(int(vision.sum()), dtype=torch.bool, device=owner.device)
        starts[1:] = owner[vision][1:] != owner[vision][:-1]  # an image's first slot
        if int(starts.sum()) != objects:
            raise ValueError("the slots of an image or video are not one run of tokens")
        image = torch.full_like(input_ids, -1)
        image.view(-1)[vision] = torch.cumsum(starts.long(), 0) - 1
        return embeds[vision], image


def init_rule(args: Qwen25VLArgs, name: str, param: torch.Tensor) -> Init:
    """How each parameter starts from scratch (ModelSpec.init_rule): norm weights ones, biases
    zeros; the decoder as the llava family's (normal 0.02, its residual outputs wo and w2 at
    0.02/sqrt(2 * layers), an untied head at dim^-0.5); the tower's weights (linear layers, the
    patch and position embeddings) uniform in +-1/sqrt(fan_in), PyTorch's default bound."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return Init("zeros")
    if "norm" in name:
        return Init("ones")
    if name.startswith("decoder."):
        return decoder_weight_init(args.decoder, name)
    return Init("uniform", 1 / math.sqrt(math.prod(param.shape[1:])))
