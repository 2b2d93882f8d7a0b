"""What the planner (titan_vlm/plan) reads of a LLaVA model: its shapes, its parameters with the
dim the TP plan (parallelize.py apply_tp) splits, and its FLOPs (flops.py): ModelSpec.plan_shapes.
"""

from __future__ import annotations

from functools import cache, partial

import torch

from titan_vlm.errors import ConfigError
from titan_vlm.models.llava.args import VLMArgs
from titan_vlm.models.llava.flops import train_flops
from titan_vlm.parallel.tensor_parallel import TP_COLWISE, TP_EMBEDDING, TP_ROWWISE
from titan_vlm.plan.shapes import (
    MergerShape,
    ModelShapes,
    VisionShape,
    decoder_shape,
    tp_params,
)


@cache
def plan_shapes(args: VLMArgs, image_hw: tuple[int, int] | None = None) -> ModelShapes:
    """The shapes of `args` on images of its own size (`image_hw`: none other: the ViT takes
    image_size x image_size)."""
    from titan_vlm.models.llava.model import VLM

    size = args.vision.image_size
    if image_hw not in (None, (size, size)):
        raise ConfigError(
            f"--image-size: a llava model is priced on its own {size}x{size} images (its ViT's "
            "image_size)"
        )
    with torch.device("meta"):
        model = VLM(args)
    d, v = args.decoder, args.vision
    return ModelShapes(
        decoder_shape(d),
        VisionShape(
            v.dim,
            v.n_layers,
            v.n_heads,
            v.mlp_dim,
            patches=v.num_patches,
            tokens=v.num_patches,
            pixels=v.channels * size**2,
            # the ViT's final LayerNorm, then Linear(dv, dim), GELU, Linear(dim, dim) per patch
            merger=MergerShape("layernorm", unit=1, hidden=d.dim),
        ),
        tp_params(model, TP_COLWISE, TP_ROWWISE, TP_EMBEDDING),
        partial(train_flops, args),
        (size, size),
    )
