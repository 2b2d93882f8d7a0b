"""Qwen2.5-VL's vision tower: native-resolution images and videos as one packed sequence.

    pixel_values [N, C*T*P*P]   N = sum of t*h*w over the grids; each row one 3-D patch, the
                                patches of a merge unit (m x m neighbours) consecutive, units
                                row-major within a frame, frames in order (the processor's order)
    grid_thw [n, 3]             (t, h, w) in patches of every image / video, in order
    -> embeds [N / m^2, out_hidden_size], one per merge unit, in the same order

Inside, the sequence runs in *window order* (`window_geometry`): each frame's merge units are cut
into windows of window_units x window_units units, and the units are reordered window by window
(transformers' get_vision_window_index), each unit's m^2 patches staying together. Every block then
attends over dense blocks of that sequence, all images in one packed plan (one
`planned_attention` call per block): a block listed in fullatt_block_indexes over each FRAME (all
of an image; each frame of a video separately, as transformers does), every other block over each
WINDOW. Each patch's 2-D rotary embedding turns the first head_dim / 4 frequencies (and their
rotate-half copies) by its row and the next head_dim / 4 by its column in the frame. The merger
(RMSNorm, then an MLP over each unit's m^2 patches concatenated) makes one embedding per unit,
and the window permutation is undone at the end.

Parameters have the Hugging Face tensors' shapes (the patch embedding is the Conv3d weight
[dim, C, T, P, P]), except the attention's fused qkv [3 * dim, dim], held as three projections q,
k, v ([dim, dim] each, its dim-0 thirds in that order: hf_adapter.py maps all three to it), so
that tensor parallelism splits each column-wise into whole heads (parallelize.py).

Padding (`sequence_multiple`, set by sequence parallelism to tp): the packed sequence is padded
with zero rows to a multiple of it; they lie in no attention block (they attend to nothing and
nothing attends to them), every other op of a block is per row, and they are dropped before the
merger, so they change no output and get no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_vlm.models.common.activations import ACT_FNS
from titan_vlm.models.common.decoder import RMSNorm
from titan_vlm.models.common.qwen_vl.args import VisionArgs
from titan_vlm.models.common.qwen_vl.model import QwenTower
from titan_vlm.models.common.qwen_vl.vision_blocks import (
    VisionAttention,
    dense_plan,
    embed_patches,
    grid_hw,
    pad_rows,
    vision_rotary,
)
from titan_vlm.varlen import PackedPlan


@dataclass(frozen=True)
class WindowGeometry:
    """Where every patch of a batch of grids goes (all index tensors on the CPU).

    unit_order [U]: the merge unit (processor order) at each window-order place, transformers'
    window_index; patch_order [N]: the same for patches (unit_order[i] * m^2 + j);
    unit_inverse [U]: its inverse permutation. windows / frames: patch counts of the windows and
    of the frames, in window order (frames stay contiguous: windows never cross one).
    hw [N, 2]: (row, column) of each patch within its frame, in window order."""

    unit_order: torch.Tensor
    patch_order: torch.Tensor
    unit_inverse: torch.Tensor
    windows: list[int]
    frames: list[int]
    hw: torch.Tensor


def _grid_windows(t: int, hu: int, wu: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One grid of t x hu x wu merge units: (its units in window order [t*hu*wu], the unit count
    of each non-empty window). Windows are side x side units from the frame's top-left corner,
    ordered frame, window row, window column; units row-major within a window."""
    units = torch.arange(t * hu * wu).view(t, hu, wu)
    pad_h, pad_w = -hu % side, -wu % side
    units = F.pad(units, (0, pad_w, 0, pad_h), value=-1)  # [t, Hp, Wp]
    nh, nw = units.shape[1] // side, units.shape[2] // side
    windows = units.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
    counts = (windows >= 0).sum(dim=1)
    order = windows.flatten()
    return order[order >= 0], counts[counts > 0]


def window_geometry(grid_thw: torch.Tensor, a: VisionArgs) -> WindowGeometry:
    """The window order of the patches of grids grid_thw [n, 3] (see WindowGeometry)."""
    m, mu = a.spatial_merge_size, a.merge_unit
    orders, windows, frames, hws = [], [], [], []
    offset = 0
    for t, h, w in grid_thw.tolist():
        units = a.tokens(t, h, w)
        order, counts = _grid_windows(t, h // m, w // m, a.window_units)
        orders.append(order + offset)
        windows += (counts * mu).tolist()
        frames += [h * w] * t
        hws.append(grid_hw(t, h, w, m))
        offset += units
    unit_order = torch.cat(orders) if orders else torch.zeros(0, dtype=torch.long)
    patch_order = (unit_order.view(-1, 1) * mu + torch.arange(mu)).flatten()
    hw = torch.cat(hws) if hws else torch.zeros(0, 2, dtype=torch.long)
    return WindowGeometry(
        unit_order=unit_order,
        patch_order=patch_order,
        unit_inverse=torch.argsort(unit_order),
        windows=windows,
        frames=frames,
        hw=hw[patch_order],
    )


class VisionMLP(nn.Module):
    """Gated MLP with biases: w2(act(w1 x) * w3 x) (gate_proj, up_proj, down_proj)."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        self.act = ACT_FNS[a.hidden_act]
        self.w1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.w3 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.w2 = nn.Linear(a.intermediate_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1 x), then + mlp(norm2 x)."""

    def __init__(self, a: VisionArgs, attention_kernel: str):
        super().__init__()
        self.norm1 = RMSNorm(a.hidden_size, a.norm_eps)
        self.attn = VisionAttention(a, attention_kernel)
        self.norm2 = RMSNorm(a.hidden_size, a.norm_eps)
        self.mlp = VisionMLP(a)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: PackedPlan
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """[U * m^2, dim] patches -> [U, out_hidden_size]: RMSNorm (ln_q) each patch, concatenate each
    unit's m^2 patches, then fc2(gelu(fc1 ...)) (exact GELU)."""

    def __init__(self, a: VisionArgs):
        super().__init__()
        wide = a.hidden_size * a.merge_unit
        self.norm = RMSNorm(a.hidden_size, a.norm_eps)
        self.fc1 = nn.Linear(wide, wide)
        self.fc2 = nn.Linear(wide, a.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        units = self.norm(x).view(-1, self.fc1.in_features)  # [U, m^2 * dim]
        return self.fc2(F.gelu(self.fc1(units)))


class VisionTower(QwenTower):
    """pixel_values [N, patch_dim] + grid_thw [n, 3] -> embeds [N / m^2, out_hidden_size] (see
    the module docstring)."""

    def __init__(self, a: VisionArgs, attention_kernel: str):
        super().__init__()
        self.args = a
        # A Conv3d whose kernel is its stride and its input one patch: a linear map of the flat
        # patch, computed as one (forward); the module keeps the Hugging Face weight's shape.
        kernel = (a.temporal_patch_size, a.patch_size, a.patch_size)
        self.patch_embed = nn.Conv3d(
            a.in_channels, a.hidden_size, kernel_size=kernel, stride=kernel, bias=False
        )
        self.layers = nn.ModuleList(VisionBlock(a, attention_kernel) for _ in range(a.depth))
        self.merger = PatchMerger(a)
        # the packed sequence is padded with zero rows to a multiple of this (the module
        # docstring): sequence parallelism cuts it over tp (parallelize.py sets it to tp)
        self.sequence_multiple = 1

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter in place with the modules' own initialisation."""
        for m in self.modules():
            if isinstance(m, (nn.Conv3d, nn.Linear, RMSNorm)):
                m.reset_parameters()

    def rotary(self, hw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """hw [N, 2] (row, column) -> cos, sin [1, 1, N, head_dim] (vision_blocks.vision_rotary)."""
        return vision_rotary(hw, self.args.head_dim, self.args.rope_theta, device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        a = self.args
        g = window_geometry(grid_thw.cpu(), a)
        n = len(g.patch_order)
        x = embed_patches(self.patch_embed, pixel_values, n)  # [N, dim]
        x = x[g.patch_order.to(x.device)]  # [N, dim], window order
        # zero rows in no attention block (the module docstring)
        x, hw, padded = pad_rows(x, g.hw, self.sequence_multiple)
        cos, sin = self.rotary(hw, x.device)
        windows, frames = dense_plan(g.windows, padded), dense_plan(g.frames, padded)
        x = x.unsqueeze(0)  # [1, padded, dim]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, frames if i in a.fullatt_block_indexes else windows)
        units = self.merger(x[0, :n])  # [U, out], window order
        return units[g.unit_inverse.to(units.device)]
