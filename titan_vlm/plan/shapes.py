"""The one place the planner reads the model: its shapes and its parameter tensors, as a
family's ModelSpec.plan_shapes gives them (models/<family>/shapes.py: the model built on the
meta device, so a 7B model costs nothing, and which dim its TP plan splits of each tensor).

Everything the planner prices is a function of these numbers, so a change to a family (a new
field, biases) touches only its plan_shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts layers: `layers` (their indices) each route a token to `top_k` of
    `num_experts` SwiGLUs of width `ffn_dim`."""

    num_experts: int
    top_k: int
    ffn_dim: int
    layers: tuple[int, ...]


@dataclass(frozen=True)
class DecoderShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int  # the dense layers' SwiGLU
    vocab_size: int
    qk_norm: bool = False  # an RMSNorm on every query and key head (Qwen3)
    moe: MoEShape | None = None

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers


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
    # a stacked experts' tensor (dim 0: the expert): expert parallelism splits dim 0 over ep,
    # FSDP shards the rest over the ranks of dp_shard x cp that hold the same experts
    expert: bool = False


@dataclass(frozen=True)
class ModelShapes:
    """`train_flops(num_images, text_tokens, attention_pairs)`: the family's model FLOPs of
    forward + backward (image tokens counted once), for images of the model's native size."""

    decoder: DecoderShape
    vision: VisionShape
    params: tuple[Param, ...]
    train_flops: Callable[[int, int, float], float]

    @property
    def tokens_per_image(self) -> int:
        return self.vision.patches


def tp_params(
    model: nn.Module,
    colwise: tuple[str, ...],
    rowwise: tuple[str, ...],
    embedding: tuple[str, ...],
    experts: tuple[str, ...] = ("experts",),
) -> tuple[Param, ...]:
    """Every parameter of `model` (built on the meta device) with the dim tensor parallelism
    splits: leaf modules named in `colwise` (weight and bias dim 0), `rowwise` (weight dim 1,
    bias replicated) and `embedding` (rows, dim 0), as the family's apply_tp splits them;
    everything else (norms, patch and position embeddings, routers, experts) replicated over
    tp (None). A parameter's group is its top-level module ("vision", "projector", "decoder",
    ...); the parameters of the modules named in `experts` are stacked experts (Param.expert)."""

    def tp_dim(name: str) -> int | None:
        module, kind = name.split(".")[-2:]
        if module in colwise or module in embedding:
            return 0
        if module in rowwise:
            return 1 if kind == "weight" else None
        return None

    return tuple(
        Param(
            name.split(".")[0],
            name,
            tuple(p.shape),
            tp_dim(name),
            name.split(".")[-2] in experts,
        )
        for name, p in model.named_parameters()
    )
