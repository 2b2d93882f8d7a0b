"""What the planner (titan_vlm/plan) reads of a Qwen-VL model (ModelSpec.plan_shapes of the
"qwen2_5_vl" and "qwen3_vl" families): its shapes on images of one size, its parameters with
the dim its TP plan splits, and its FLOPs.

An image of H x W pixels (multiples of patch_size x spatial_merge_size) is one temporal patch
of grid (1, H / p, W / p): that many patches run through the tower, and one decoder slot per
merge unit of m x m of them leaves it. What differs between the families' towers (`Tower`:
norms, MLP, tables, DeepStack mergers) each family's shapes.py states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.flops import (
    decoder_pair_flops,
    decoder_slot_flops,
)
from titan_vlm.models.common.qwen_vl.mrope import Grid
from titan_vlm.models.common.qwen_vl.vision_cost import image_train_flops, vision_patch_flops
from titan_vlm.models.spec import VisionLanguageModel
from titan_vlm.parallel.tensor_parallel import TP_COLWISE, TP_EMBEDDING, TP_ROWWISE
from titan_vlm.plan.shapes import (
    MergerShape,
    Mlp,
    ModelShapes,
    Norm,
    VisionShape,
    decoder_shape,
    tp_params,
)


@dataclass(frozen=True)
class Tower:
    """What differs between the families' towers for the planner: the blocks' and the main
    merger's `norm`, the blocks' `mlp`, the bytes per patch of the tables backward keeps beside
    the rotary ones (`tables`), and the DeepStack mergers (`deepstack`)."""

    norm: Norm
    mlp: Mlp
    tables: int
    deepstack: int = 0


def image_grid(args: Qwen25VLArgs, image_hw: tuple[int, int] | None) -> Grid:
    """The patch grid of an image of `image_hw` pixels (None: the family's built-in image size);
    a size that is not whole merge units is a one-line ConfigError."""
    height, width = image_hw or (args.image_size, args.image_size)
    p, m = args.vision.patch_size, args.vision.spatial_merge_size
    if height % (p * m) or width % (p * m) or min(height, width) <= 0:
        raise ConfigError(
            f"--image-size {height}x{width}: a side must be a positive multiple of "
            f"{p * m} pixels (patch_size {p} x spatial_merge_size {m})"
        )
    return (1, height // p, width // p)


def train_flops(
    args: Qwen25VLArgs, grid: Grid, num_images: int, text_tokens: int, attention_pairs: float
) -> float:
    """Model FLOPs of forward + backward for `num_images` images of patch grid `grid` and
    `text_tokens` text tokens whose decoder attention computes `attention_pairs` query-key pairs:
    the terms of flops.batch_train_flops (the tower per image, the decoder's matmuls per slot,
    its attention per pair, the head on the text)."""
    d = args.decoder
    slots = text_tokens + num_images * args.vision.tokens(*grid)
    head = 3.0 * 2 * d.dim * d.vocab_size * text_tokens
    vision = num_images * image_train_flops(args, grid)
    return vision + decoder_slot_flops(d) * slots + decoder_pair_flops(d) * attention_pairs + head


def qwen_plan_shapes(
    args: Qwen25VLArgs,
    image_hw: tuple[int, int] | None,
    build: Callable[[Any], VisionLanguageModel],
    tower: Tower,
) -> ModelShapes:
    """ModelShapes of a Qwen-VL family's model (`build(args)`, made on the meta device) on
    images of `image_hw` pixels (module docstring), its tower as `tower` describes it."""
    grid = image_grid(args, image_hw)
    v = args.vision
    patches = grid[1] * grid[2]
    with torch.device("meta"):
        model = build(args)
    p, m_unit = v.patch_size, v.merge_unit
    merger = MergerShape(
        tower.norm, unit=m_unit, hidden=m_unit * v.hidden_size, deepstack=tower.deepstack
    )
    return ModelShapes(
        decoder_shape(args.decoder),
        VisionShape(
            v.hidden_size,
            v.depth,
            v.num_heads,
            v.intermediate_size,
            patches=patches,
            tokens=patches // m_unit,
            pixels=patches * v.patch_dim,
            merger=merger,
            norm=tower.norm,
            mlp=tower.mlp,
            # the tower's fp32 rotary cos and sin of each patch, and its own tables
            tables=2 * 4 * v.head_dim + tower.tables,
        ),
        tp_params(model, TP_COLWISE, TP_ROWWISE, TP_EMBEDDING),
        partial(train_flops, args, grid),
        (grid[1] * p, grid[2] * p),
        # what images.py QwenVisuals.work reports of such an image
        image_train_flops(args, grid) / vision_patch_flops(v),
        model.first_stage_layers,
    )
