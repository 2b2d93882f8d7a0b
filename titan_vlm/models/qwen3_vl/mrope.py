"""Qwen3-VL's multimodal RoPE: the positions are Qwen2.5-VL's (common/qwen_vl/mrope.py: three
per token, an image's merged grid from where the text is), the frequencies are interleaved over the
three axes instead of cut into three runs. Frequency j < head_dim / 2 turns by

    the height position   if j % 3 == 1 and j < 3 * mrope_section[1]
    the width position    if j % 3 == 2 and j < 3 * mrope_section[2]
    the temporal one      otherwise

and frequency j + head_dim / 2 repeats it (the rotate-half layout of common/decoder.py's
`apply_rope`): transformers' Qwen3VLTextRotaryEmbedding. With all three positions equal it is
plain RoPE.
"""

from __future__ import annotations

import torch

from titan_vlm.models.common.decoder import inv_frequencies
from titan_vlm.models.common.text_args import Rope


def interleaved_axes(head_dim: int, mrope_section: tuple[int, ...]) -> torch.Tensor:
    """[head_dim / 2] the axis (0 temporal, 1 height, 2 width) each frequency turns by."""
    half = head_dim // 2
    if len(mrope_section) != 3 or sum(mrope_section) != half:
        raise ValueError(f"mrope_section {mrope_section} must be 3 parts summing to {half}")
    j = torch.arange(half)
    axis = torch.zeros(half, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axis


def interleaved_mrope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: tuple[int, ...],
    rope: Rope | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, B, L] -> cos, sin [B, 1, L, head_dim] (fp32, angles computed in float64),
    for `apply_rope`. `rope`: the frequencies' scaling (text_args.Rope; default none)."""
    device = positions.device
    inv_freq = inv_frequencies(head_dim, theta, rope or Rope()).to(device)  # [head_dim / 2]
    axis = interleaved_axes(head_dim, mrope_section).to(device)
    angles = positions.to(torch.float64)[axis].permute(1, 2, 0) * inv_freq  # [B, L, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [B, 1, L, head_dim]
    return angles.cos().float(), angles.sin().float()
