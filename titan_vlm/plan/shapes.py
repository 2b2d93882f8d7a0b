"""The one place the planner reads the model: its shapes (from `titan_vlm.models.llava.args`) and
its parameter tensors (from the model built on the meta device, so a 7B model costs nothing).

Everything the planner prices is a function of these numbers, so a change to the models package
(a new field, biases) touches only this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from titan_vlm.models.llava.args import VLMArgs

# Tensor parallelism (parallel/tensor_parallel.py, apply_tp): leaf modules split column-wise
# (weight and bias dim 0), row-wise (weight dim 1, bias replicated) and the embedding (rows,
# dim 0). Everything else (norms, patch and position embeddings) is replicated over tp.
TP_COLWISE = ("q", "k", "v", "fc1", "wq", "wk", "wv", "w1", "w3", "output")
TP_ROWWISE = ("proj", "fc2", "wo", "w2")
TP_EMBEDDING = ("tok_embeddings",)


@dataclass(frozen=True)
class DecoderShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int


@dataclass(frozen=True)
class VisionShape:
    dim: int
    n_layers: int
    n_heads: int
    mlp_dim: int
    patches: int  # tokens per image, in the ViT and in the decoder's sequence
    pixels: int  # channels x height x width of one image


@dataclass(frozen=True)
class Param:
    group: str  # "vision", "projector" or "decoder"
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim tensor parallelism splits, None: replicated over tp


@dataclass(frozen=True)
class ModelShapes:
    decoder: DecoderShape
    vision: VisionShape
    params: tuple[Param, ...]
    args: VLMArgs

    @property
    def tokens_per_image(self) -> int:
        return self.vision.patches


def _tp_dim(name: str) -> int | None:
    parts = name.split(".")
    module, kind = parts[-2], parts[-1]
    if module in TP_COLWISE:
        return 0
    if module in TP_ROWWISE:
        return 1 if kind == "weight" else None
    if module in TP_EMBEDDING:
        return 0
    return None


@cache
def model_shapes(args: VLMArgs) -> ModelShapes:
    from titan_vlm.models.llava.model import VLM

    with torch.device("meta"):
        model = VLM(args)
    params = tuple(
        Param(name.split(".")[0], name, tuple(p.shape), _tp_dim(name))
        for name, p in model.named_parameters()
    )
    d, v = args.decoder, args.vision
    return ModelShapes(
        DecoderShape(
            d.dim, d.n_layers, d.n_heads, d.n_kv_heads, d.head_dim, d.ffn_dim, d.vocab_size
        ),
        VisionShape(
            v.dim, v.n_layers, v.n_heads, v.mlp_dim, v.num_patches, v.channels * v.image_size**2
        ),
        params,
        args,
    )
