"""The Qwen2.5-VL vision tower's cost per image, from its args and the image's patch grid alone
(no module is built): what flops.py counts and what QwenVisuals.work (images.py) reports, so the
CP cost model and cp_vision = "shard" price an image's window and full attention as they are.
Forward + backward FLOPs, 3x the forward's, 2 FLOPs per matmul weight per row it multiplies."""

from __future__ import annotations

from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs, VisionArgs
from titan_vlm.models.common.qwen_vl.mrope import Grid  # (t, h, w) in patches


def vision_patch_flops(v: VisionArgs) -> float:
    """Forward + backward FLOPs of the vision tower's matmuls per patch (attention excluded):
    the patch embedding (patch_dim x hidden), in each of `depth` blocks its `block_weights`
    (Qwen2.5-VL: the fused qkv, proj and the gated MLP; Qwen3-VL: a two-matrix MLP), and each
    merger's share (`mergers`: Qwen3-VL's DeepStack ones too): its fc1 (m^2*hidden x
    m^2*hidden) and fc2 (m^2*hidden x out_hidden_size) run once per merge unit of m^2 patches.
    2 FLOPs per weight, times 3."""
    h, mu = v.hidden_size, v.merge_unit
    embed = v.patch_dim * h
    wide = mu * h  # the merger's input: a unit's m^2 patches concatenated
    merger = v.mergers * (wide * wide + wide * v.out_hidden_size) / mu
    return 3.0 * 2 * (embed + v.depth * v.block_weights + merger)


def _full_blocks(v: VisionArgs) -> int:
    """Blocks that attend over each whole frame (the rest attend over windows)."""
    return len(set(v.fullatt_block_indexes) & set(range(v.depth)))


def _sum_of_squares_of_cuts(units: int, side: int) -> int:
    """sum of n^2 over the pieces of a row of `units` merge units cut into pieces of `side`
    from its start (the last piece shorter)."""
    full, rest = divmod(units, side)
    return full * side * side + rest * rest


def window_pairs(v: VisionArgs, grid: Grid) -> int:
    """Query-key pairs of ONE window block on a grid (t, h, w) of patches: each frame's merge
    units (h/m x w/m) cut into windows of window_units x window_units units from the frame's
    top-left corner (the last row and column of windows smaller), a window of n patches
    n^2 pairs. A window's unit counts are a product of its row and column cuts, so the sum over
    windows factors: m^4 * sum(rows^2) * sum(columns^2) per frame."""
    t, h, w = grid
    m, side = v.spatial_merge_size, v.window_units
    rows = _sum_of_squares_of_cuts(h // m, side)
    cols = _sum_of_squares_of_cuts(w // m, side)
    return t * m**4 * rows * cols


def frame_pairs(grid: Grid) -> int:
    """Query-key pairs of ONE full-attention block on a grid (t, h, w): each of the t frames
    attends over itself, (h*w)^2 pairs."""
    t, h, w = grid
    return t * (h * w) ** 2


def image_attention_flops(v: VisionArgs, grid: Grid) -> float:
    """Forward + backward FLOPs of the tower's attention on one image / video of grid
    (t, h, w): window blocks' `window_pairs`, full-attention blocks' `frame_pairs`, 4 *
    hidden_size FLOPs a pair (QK^T and AV over all heads), times 3."""
    full = _full_blocks(v)
    pairs = (v.depth - full) * window_pairs(v, grid) + full * frame_pairs(grid)
    return 3.0 * 4 * v.hidden_size * pairs


def image_train_flops(args: Qwen25VLArgs, grid: Grid) -> float:
    """Forward + backward FLOPs of the vision tower (patch embedding, blocks, merger) on one image
    or video of patch grid (t, h, w): `vision_patch_flops` per patch times t*h*w, plus its
    attention counted exactly (`image_attention_flops`). The decoder's work on its slots is not
    included (`batch_train_flops` adds it)."""
    t, h, w = grid
    v = args.vision
    return vision_patch_flops(v) * t * h * w + image_attention_flops(v, grid)
