"""Qwen3-VL's vision tower: native-resolution images and videos as one packed sequence, with
DeepStack features from chosen blocks.

    pixel_values [N, C*T*P*P]   N = sum of t*h*w over the grids; each row one 3-D patch, the
                                patches of a merge unit (m x m neighbours) consecutive, units
                                row-major within a frame, frames in order (the processor's order)
    grid_thw [n, 3]             (t, h, w) in patches of every image / video, in order
    -> [N / m^2, (1 + k) * out_hidden_size], one row per merge unit, in the same order: the
       main merger's output, then the k DeepStack mergers' (one per deepstack_visual_indexes
       block, in that order), concatenated

Unlike Qwen2.5-VL's tower there are no windows: the sequence stays in processor order and every
block attends over each frame (one dense block per frame of every image and video, all in one
packed plan). Each patch gets the patch embedding (a Conv3d with bias, computed as one linear
map of the flat patch), plus its learned position embedding: the side x side grid of
`pos_embed` resampled bilinearly to the frame's h x w patches with aligned corners (patch (r, c)
reads source point (r (side-1)/(h-1), c (side-1)/(w-1)), its four neighbours weighted by
distance: `position_taps`); the 2-D rotary embedding is Qwen2.5-VL's (the first head_dim / 4
frequencies turn by the patch's row, the next by its column). Blocks are pre-LayerNorm (with
biases): x + attn(norm1 x), then + fc2(act(fc1(norm2 x))). A merger concatenates each unit's
m^2 patches and maps them with fc2(gelu(fc1 .)); the main merger LayerNorms each patch first,
a DeepStack merger the concatenated unit ("postshuffle").

Parameters have the Hugging Face tensors' shapes except the fused qkv, held as q, k, v (as in
common/qwen_vl/vision_blocks.py, whose attention module this tower uses). Padding for sequence
parallelism (`sequence_multiple`) is Qwen2.5-VL's: zero rows in no attention block, dropped
before the mergers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_vlm.models.common.activations import ACT_FNS
from titan_vlm.models.common.qwen_vl.model import QwenTower
from titan_vlm.models.common.qwen_vl.vision_blocks import (
    VisionAttention,
    dense_plan,
    embed_patches,
    grid_hw,
    pad_rows,
    vision_rotary,
)
from titan_vlm.models.qwen3_vl.args import Qwen3VisionArgs
from titan_vlm.varlen import PackedPlan

NORM_EPS = 1e-6  # transformers' fixed eps of every LayerNorm of the tower


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, ...]:
    """Bilinear taps with aligned corners along one axis: for target `index` of an axis of
    `size` samples, its two source indices in 0..side-1 and their weights (fp32)."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    low = src.floor()
    frac = src - low
    lo = low.long().clamp(0, side - 1)
    hi = (low.long() + 1).clamp(0, side - 1)
    return lo, hi, 1 - frac, frac


def position_taps(
    hw: torch.Tensor, grids: list[list[int]], side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [N, 4] into the flattened side x side position table, weights [N, 4]) of every
    patch of grids `grids` [(t, h, w), ...], whose (row, column) in its frame is hw [N, 2]
    (processor order): the four neighbours of its source point (module docstring) and their
    bilinear weights."""
    sizes = torch.tensor([t * h * w for t, h, w in grids], dtype=torch.long)
    height = torch.repeat_interleave(
        torch.tensor([h for _, h, _ in grids], dtype=torch.long), sizes
    )
    width = torch.repeat_interleave(torch.tensor([w for _, _, w in grids], dtype=torch.long), sizes)
    r0, r1, wr0, wr1 = _axis_taps(hw[:, 0], height, side)
    c0, c1, wc0, wc1 = _axis_taps(hw[:, 1], width, side)
    indices = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], 1)
    weights = torch.stack([wr0 * wc0, wr0 * wc1, wr1 * wc0, wr1 * wc1], 1)
    return indices, weights


class VisionMLP(nn.Module):
    """fc2(act(fc1 x)), with biases (linear_fc1, linear_fc2)."""

    def __init__(self, a: Qwen3VisionArgs):
        super().__init__()
        self.act = ACT_FNS[a.hidden_act]
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(norm1 x), then + mlp(norm2 x)."""

    def __init__(self, a: Qwen3VisionArgs, attention_kernel: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(a.hidden_size, eps=NORM_EPS)
        self.attn = VisionAttention(a, attention_kernel)
        self.norm2 = nn.LayerNorm(a.hidden_size, eps=NORM_EPS)
        self.mlp = VisionMLP(a)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: PackedPlan
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """[U * m^2, dim] patches -> [U, out_hidden_size]: LayerNorm each patch (`postshuffle`:
    each unit's m^2 patches concatenated, then LayerNorm), fc2(gelu(fc1 .)) (exact GELU)."""

    def __init__(self, a: Qwen3VisionArgs, postshuffle: bool):
        super().__init__()
        wide = a.hidden_size * a.merge_unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(wide if postshuffle else a.hidden_size, eps=NORM_EPS)
        self.fc1 = nn.Linear(wide, wide)
        self.fc2 = nn.Linear(wide, a.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.fc1.in_features
        units = self.norm(x.view(-1, wide)) if self.postshuffle else self.norm(x).view(-1, wide)
        return self.fc2(F.gelu(self.fc1(units)))


class VisionTower(QwenTower):
    """pixel_values [N, patch_dim] + grid_thw [n, 3] -> [N / m^2, (1 + k) * out_hidden_size] (see
    the module docstring)."""

    def __init__(self, a: Qwen3VisionArgs, attention_kernel: str):
        super().__init__()
        self.args = a
        kernel = (a.temporal_patch_size, a.patch_size, a.patch_size)
        self.patch_embed = nn.Conv3d(a.in_channels, a.hidden_size, kernel, stride=kernel)
        self.pos_embed = nn.Embedding(a.num_position_embeddings, a.hidden_size)
        self.layers = nn.ModuleList(VisionBlock(a, attention_kernel) for _ in range(a.depth))
        self.merger = PatchMerger(a, postshuffle=False)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(a, postshuffle=True) for _ in a.deepstack_visual_indexes
        )
        # the packed sequence is padded with zero rows to a multiple of this (sequence
        # parallelism sets it to tp: qwen2_5_vl/vision.py's rule)
        self.sequence_multiple = 1

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter in place with the modules' own initialisation."""
        for m in self.modules():
            if isinstance(m, (nn.Conv3d, nn.Linear, nn.LayerNorm, nn.Embedding)):
                m.reset_parameters()

    def rotary(self, hw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """hw [N, 2] (row, column) -> cos, sin [1, 1, N, head_dim] (vision_blocks.vision_rotary)."""
        return vision_rotary(hw, self.args.head_dim, self.args.rope_theta, device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        a = self.args
        grids = grid_thw.tolist()
        hws = [grid_hw(t, h, w, a.spatial_merge_size) for t, h, w in grids]
        hw = torch.cat(hws) if hws else torch.zeros(0, 2, dtype=torch.long)  # [N, 2]
        n = len(hw)
        x = embed_patches(self.patch_embed, pixel_values, n)  # [N, dim]
        indices, weights = position_taps(hw, grids, a.position_side)
        taps = self.pos_embed(indices.to(x.device))  # [N, 4, dim]
        # fp32 weights: the weighted sum in fp32 whatever the parameters' dtype (transformers')
        x = x + (taps * weights.to(x.device).unsqueeze(-1)).sum(1).to(x.dtype)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        x, hw, padded = pad_rows(x, hw, self.sequence_multiple)  # zero rows in no block
        cos, sin = self.rotary(hw, x.device)
        plan = dense_plan(frames, padded)
        x = x.unsqueeze(0)  # [1, padded, dim]
        features = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, plan)
            if i in a.deepstack_visual_indexes:
                j = a.deepstack_visual_indexes.index(i)
                features.append(self.deepstack_mergers[j](x[0, :n]))
        return torch.cat([self.merger(x[0, :n]), *features], dim=-1)
