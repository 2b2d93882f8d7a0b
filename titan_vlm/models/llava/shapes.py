"""What the planner (titan_vlm/plan) reads of a LLaVA model: its shapes, its parameters with the
dim the TP plan (parallelize.py apply_tp) splits, and its FLOPs (flops.py): ModelSpec.plan_shapes.
"""

from __future__ import annotations

from functools import cache, partial

import torch

from titan_vlm.models.llava.args import VLMArgs
from titan_vlm.models.llava.flops import train_flops
from titan_vlm.plan.shapes import DecoderShape, ModelShapes, MoEShape, VisionShape, tp_params

# the leaf modules apply_tp splits column-wise, row-wise and by vocabulary rows
TP_COLWISE = ("q", "k", "v", "fc1", "wq", "wk", "wv", "w1", "w3", "output")
TP_ROWWISE = ("proj", "fc2", "wo", "w2")
TP_EMBEDDING = ("tok_embeddings",)


@cache
def plan_shapes(args: VLMArgs) -> ModelShapes:
    from titan_vlm.models.llava.model import VLM

    with torch.device("meta"):
        model = VLM(args)
    d, v = args.decoder, args.vision
    m = d.moe
    moe = MoEShape(m.num_experts, m.top_k, m.ffn_dim, tuple(sorted(d.sparse))) if m else None
    return ModelShapes(
        DecoderShape(
            d.dim,
            d.n_layers,
            d.n_heads,
            d.n_kv_heads,
            d.head_dim,
            d.ffn_dim,
            d.vocab_size,
            d.qk_norm,
            moe,
        ),
        VisionShape(
            v.dim, v.n_layers, v.n_heads, v.mlp_dim, v.num_patches, v.channels * v.image_size**2
        ),
        tp_params(model, TP_COLWISE, TP_ROWWISE, TP_EMBEDDING),
        partial(train_flops, args),
    )
