"""What the planner (titan_vlm/plan) reads of a Qwen2.5-VL model: ModelSpec.plan_shapes
(common/qwen_vl/shapes.py), with this family's tower: RMSNorms, a SwiGLU MLP, windows (window
and full-attention blocks save the same), and the window order's int64 indices kept for
backward (one a patch into it, one a merge unit out of it)."""

from __future__ import annotations

from functools import cache

from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.shapes import Tower, qwen_plan_shapes
from titan_vlm.models.qwen2_5_vl.model import Qwen25VL
from titan_vlm.plan.shapes import ModelShapes


@cache
def plan_shapes(args: Qwen25VLArgs, image_hw: tuple[int, int] | None = None) -> ModelShapes:
    """The shapes of `args` on images of `image_hw` pixels (None: the built-in data's)."""
    tower = Tower("rmsnorm", "swiglu", tables=8 + 8 // args.vision.merge_unit)
    return qwen_plan_shapes(args, image_hw, Qwen25VL, tower)
