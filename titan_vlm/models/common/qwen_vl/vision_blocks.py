"""What the Qwen-VL towers share of their packed attention: each patch's (row, column) in its
frame in the processor's order (`grid_hw`), a packed plan of dense blocks over one sequence
(`dense_plan`), and the bidirectional attention under such a plan with q, k and v held as three
projections (`VisionAttention`: transformers' fused qkv, cut in three so that tensor parallelism
splits each into whole heads; the families' HF adapters map all three to the fused tensor)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_vlm.attention import planned_attention
from titan_vlm.models.common.decoder import apply_rope, inv_frequencies
from titan_vlm.models.common.qwen_vl.args import VisionArgs
from titan_vlm.models.common.text_args import Rope
from titan_vlm.varlen import PackedPlan, pack


def grid_hw(t: int, h: int, w: int, m: int) -> torch.Tensor:
    """[t*h*w, 2] (row, column) of each patch of a grid in processor order (merge units of m x m
    patches consecutive, row-major within the unit)."""
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    hw = torch.stack([rows, cols], dim=-1)  # [h, w, 2]
    hw = hw.view(h // m, m, w // m, m, 2).transpose(1, 2).reshape(h * w, 2)
    return hw.repeat(t, 1)


def dense_plan(lengths: list[int], total: int | None = None) -> PackedPlan:
    """The packed plan of one sequence [1, total] (by default sum(lengths)) whose first
    sum(lengths) slots are cut into consecutive dense blocks of `lengths` (each attends to
    itself only); slots past them (padding) are in no block."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    blocks = [
        (slice(0, 1), slice(a, a + n), slice(a, a + n), False) for a, n in zip(starts, lengths)
    ]
    order = torch.arange(sum(lengths) if total is None else total).unsqueeze(0)
    return pack(blocks, order, order)


def embed_patches(patch_embed: nn.Conv3d, pixel_values: torch.Tensor, n: int) -> torch.Tensor:
    """pixel_values [n, C*T*P*P] -> [n, dim]: the patch embedding (a Conv3d whose kernel is its
    stride and its input one patch, kept in the Hugging Face weight's shape) computed as one
    linear map of each flat patch, with its bias if it has one. Another shape is a ValueError."""
    weight = patch_embed.weight  # [dim, C, T, P, P]
    patch_dim = weight[0].numel()
    if pixel_values.shape != (n, patch_dim):
        raise ValueError(
            f"pixel_values {tuple(pixel_values.shape)} do not hold the grids' {n} patches of "
            f"{patch_dim} values"
        )
    return F.linear(pixel_values.to(weight.dtype), weight.flatten(1), patch_embed.bias)


def pad_rows(
    x: torch.Tensor, hw: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x [N, dim] and its patches' hw [N, 2] padded with zero rows to a multiple of `multiple`
    (a tower's sequence_multiple: sequence parallelism's tp), and the padded length. The zero
    rows lie in no attention block and are dropped before the mergers, so they change nothing."""
    n = x.shape[0]
    padded = n + -n % multiple
    if padded > n:
        x = torch.cat([x, x.new_zeros(padded - n, x.shape[1])])
        hw = torch.cat([hw, hw.new_zeros(padded - n, 2)])
    return x, hw, padded


def vision_rotary(
    hw: torch.Tensor, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The towers' 2-D rotary embedding: hw [N, 2] (row, column) -> cos, sin [1, 1, N, head_dim]
    (fp32; angles in float64): the first head_dim / 4 frequencies turn by the row, the next
    head_dim / 4 by the column, repeated rotate-half style."""
    inv_freq = inv_frequencies(head_dim // 2, theta, Rope())  # [head_dim / 4]
    angles = (hw.to(torch.float64).unsqueeze(-1) * inv_freq).flatten(1)  # [N, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1).to(device)  # [N, head_dim]
    return angles.cos().float()[None, None], angles.sin().float()[None, None]


class VisionAttention(nn.Module):
    """Bidirectional attention under a packed plan; q, k, v each num_heads heads of head_dim
    (transformers' fused qkv, cut in three: the module docstring). Head counts are inferred
    from the last dim (-1), so a tensor-parallel rank's local share works unchanged."""

    def __init__(self, a: VisionArgs, attention_kernel: str):
        super().__init__()
        self.attention_kernel = attention_kernel
        self.head_dim = a.head_dim
        self.q = nn.Linear(a.hidden_size, a.hidden_size)
        self.k = nn.Linear(a.hidden_size, a.hidden_size)
        self.v = nn.Linear(a.hidden_size, a.hidden_size)
        self.proj = nn.Linear(a.hidden_size, a.hidden_size)

    def _heads(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """[1, N, dim] -> [1, H, N, D] (H: this rank's heads)."""
        out: torch.Tensor = proj(x)
        return out.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: PackedPlan
    ) -> torch.Tensor:
        """x [1, N, dim], cos / sin [1, 1, N, head_dim] -> [1, N, dim]."""
        q, k, v = (self._heads(proj, x) for proj in (self.q, self.k, self.v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = planned_attention(q, k, v, plan, self.attention_kernel)  # [1, H, N, D]
        return self.proj(out.transpose(1, 2).flatten(2))
