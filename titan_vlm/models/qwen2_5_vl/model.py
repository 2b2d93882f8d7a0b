"""Qwen2.5-VL: the vision tower's embeddings at the prompt's image / video token slots of a Qwen2
decoder with multimodal RoPE. No parallelism in here.

The decoder is common/decoder.py's (its blocks, norm and head; the vision tower's out_hidden_size
is its width); only the rotary positions differ from a Llama-shaped model's, so `decode` runs its
blocks with M-RoPE's cos / sin (mrope.py) instead of the Decoder's 1-D tables:

    pixel_values + grid_thw --encode--> embeds [sum of t*h*w / m^2, dim]   (images, then videos)
    tokens [B, T] + embeds (slot order) + layout --decode--> logits [B, T, vocab] (text section)

`decode` takes what the trainer's decode takes: the layout's text section, the image-slot
embeddings in the layout's image-id order, and the SeqLayout, whose `slot_data[MROPE_POSITIONS]`
[3, B, L] holds each local slot's three positions (gathered from the rows' [3, B, S] by
SeqLayout.gather_slot_data). The attention mask is the layout's: causal within a sample, the
image slots like text (Qwen2.5-VL's images are causal in the decoder).

`forward` is the single-process reference that tests compare with transformers: rows of
input_ids as the processor makes them (one sample a row), their 3-D positions, pixels, and it
returns logits [B, L, vocab] for every slot, image slots included.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from titan_vlm.data.image_batch import Images
from titan_vlm.errors import ConfigError
from titan_vlm.files import read_json
from titan_vlm.layout import SeqLayout, build_layout
from titan_vlm.models.common.decoder import Decoder
from titan_vlm.models.common.hf_folder import SafetensorsFiles, weight_files
from titan_vlm.models.loading import load_hf_shards
from titan_vlm.models.qwen2_5_vl.args import Qwen25VLArgs
from titan_vlm.models.qwen2_5_vl.hf_adapter import hf_names, hf_same
from titan_vlm.models.qwen2_5_vl.hf_config import args_from_hf_config
from titan_vlm.models.qwen2_5_vl.images import MROPE_POSITIONS, QwenVisuals
from titan_vlm.models.qwen2_5_vl.mrope import mrope_cos_sin
from titan_vlm.models.qwen2_5_vl.processor import patchify_frames
from titan_vlm.models.qwen2_5_vl.vision import VisionTower
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
        if MROPE_POSITIONS not in layout.slot_data:
            raise ValueError(f"the layout carries no {MROPE_POSITIONS!r} slot data")
        positions = layout.slot_data[MROPE_POSITIONS]  # [3, B, L]
        if positions.shape[1:] != layout.positions.shape:
            raise ValueError(
                f"{MROPE_POSITIONS} {tuple(positions.shape)} do not match the local slots "
                f"{tuple(layout.positions.shape)}"
            )
        a = self.args
        return mrope_cos_sin(positions, a.head_dim, a.rope_theta, self.mrope_section, a.rope)


class Qwen25VL(VisionLanguageModel):
    """`vision` (tower + merger) and `decoder` (common Decoder: tok_embeddings, layers, norm,
    output; its 1-D RoPE tables are not used). As the trainer, CP and generate use it
    (models/spec.py VisionLanguageModel): `encode_images` of a batch's QwenVisuals, `decode` of a
    rank's text section with the M-RoPE positions its layout carries (slot_data); the base
    class's forward_local runs them."""

    def __init__(self, args: Qwen25VLArgs):
        super().__init__()
        self.args = args
        self.vision = VisionTower(args.vision, args.attention_kernel)
        self.decoder = MRopeDecoder(args)

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
            raise TypeError(f"Qwen2.5-VL encodes QwenVisuals, not {type(images).__name__}")
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
        embeds = weight.new_zeros(len(flat), self.args.decoder.dim)  # [B * L, dim]
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


def load_state_from_hf_folder(model: Qwen25VL, folder: Path) -> None:
    """Copy every parameter from a transformers-saved Qwen2.5-VL folder (hf_adapter names; a
    missing or stray tensor, or one of another shape, is a ConfigError). One process, no
    parallelism: each parameter is its whole box (models/loading.py load_hf_shards)."""
    where = str(folder)
    with SafetensorsFiles(weight_files(folder, where), where) as files:
        names = hf_names(model.args, files.keys(), where)
        for copy, original in hf_same(model.args, files.keys()):
            if not torch.equal(files.read(copy), files.read(original)):
                raise ConfigError(
                    f"{where}: '{copy}' differs from '{original}' but the embeddings are tied"
                )
        # the trainer's loader, whole tensors (q, k, v from the fused qkv's thirds: hf_adapter)
        load_hf_shards(dict(model.named_parameters()), files, names, where)


def from_hf_folder(folder: Path) -> Qwen25VL:
    """The model of a transformers-saved folder: its config.json's args, its weights."""
    config = folder / "config.json"
    model = Qwen25VL(args_from_hf_config(read_json(config, str(folder)), str(config)))
    load_state_from_hf_folder(model, folder)
    return model
