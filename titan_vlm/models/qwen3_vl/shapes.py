"""What the planner (titan_vlm/plan) reads of a Qwen3-VL model (dense or MoE):
ModelSpec.plan_shapes (common/qwen_vl/shapes.py), with this family's tower: LayerNorms, a GELU
MLP, the learned positions resampled per image (four int64 taps and four fp32 weights a patch
kept for backward), and the DeepStack mergers whose features widen each image slot's row."""

from __future__ import annotations

from functools import cache

from titan_vlm.models.common.qwen_vl.shapes import Tower, qwen_plan_shapes
from titan_vlm.models.qwen3_vl.args import Qwen3VLArgs
from titan_vlm.models.qwen3_vl.model import Qwen3VL
from titan_vlm.plan.shapes import ModelShapes


@cache
def plan_shapes(args: Qwen3VLArgs, image_hw: tuple[int, int] | None = None) -> ModelShapes:
    """The shapes of `args` on images of `image_hw` pixels (None: the built-in data's)."""
    tower = Tower("layernorm", "gelu", tables=4 * 8 + 4 * 4, deepstack=args.deepstack)
    return qwen_plan_shapes(args, image_hw, Qwen3VL, tower)
