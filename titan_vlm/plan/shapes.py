"""The one place the planner reads the model: its shapes and its parameter tensors, as a
family's ModelSpec.plan_shapes gives them for images of one size (models/llava/shapes.py,
models/common/qwen_vl/shapes.py: the model built on the meta device, so a 7B model costs
nothing, and which dim its TP plan splits of each tensor).

Everything the planner prices is a function of these numbers, so a change to a family (a new
field, biases) touches only its plan_shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch.nn as nn

from titan_vlm.models.common.text_args import DecoderArgs


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
    tie_embeddings: bool = False  # the head's weight is the embeddings' (one parameter)

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers


def decoder_shape(d: DecoderArgs) -> DecoderShape:
    """The shape of a decoder of common/decoder.py (every family's)."""
    m = d.moe
    moe = MoEShape(m.num_experts, m.top_k, m.ffn_dim, tuple(sorted(d.sparse))) if m else None
    return DecoderShape(
        d.dim,
        d.n_layers,
        d.n_heads,
        d.n_kv_heads,
        d.head_dim,
        d.ffn_dim,
        d.vocab_size,
        d.qk_norm,
        moe,
        d.tie_embeddings,
    )


Norm = Literal["layernorm", "rmsnorm"]
Mlp = Literal["gelu", "swiglu"]


@dataclass(frozen=True)
class MergerShape:
    """What maps the tower's patches into decoder slots (LLaVA's projector, the Qwen-VL patch
    mergers): a `norm` of each patch, then each `unit` consecutive patches concatenated through
    fc1 (to `hidden`), an exact GELU and fc2 (to the decoder's width). `deepstack`: more mergers
    of the same shape that LayerNorm the concatenated unit instead (Qwen3-VL's DeepStack: each
    slot's row is (1 + deepstack) x the decoder's width)."""

    norm: Norm
    unit: int
    hidden: int
    deepstack: int = 0


@dataclass(frozen=True)
class VisionShape:
    """The tower on one image: `patches` tokens through `n_layers` pre-norm blocks (`norm`, and
    an MLP of width `mlp_dim`: "gelu" fc2(act(fc1 x)) or "swiglu" w2(act(w1 x) * w3 x)), then the
    `merger` into `tokens` decoder slots. `pixels`: the values of one image as it enters (LLaVA's
    C x H x W, a Qwen-VL image's patches x patch values); `tables`: bytes per patch of the
    tower's own fp32 / int64 tables that backward keeps (2-D rotary cos / sin, position-embedding
    taps, window order)."""

    dim: int
    n_layers: int
    n_heads: int
    mlp_dim: int
    patches: int
    tokens: int
    pixels: int
    merger: MergerShape
    norm: Norm = "layernorm"
    mlp: Mlp = "gelu"
    tables: int = 0

    @property
    def embed_width(self) -> int:
        """Multiples of the decoder's width in one image slot's row (1 + DeepStack features)."""
        return 1 + self.merger.deepstack


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
    forward + backward (image tokens counted once), for images of the priced size
    (`image_hw`: height, width in pixels). `image_work`: one image's tower work in the family's
    LayoutCost.image unit, what its images report to the trainer's placement (Workload)."""

    decoder: DecoderShape
    vision: VisionShape
    params: tuple[Param, ...]
    train_flops: Callable[[int, int, float], float]
    image_hw: tuple[int, int]
    image_work: float = 1.0
    # the decoder layers a first pipeline stage must hold (VisionLanguageModel.first_stage_layers)
    first_stage_layers: int = 0

    @property
    def tokens_per_image(self) -> int:
        """Decoder slots of one image."""
        return self.vision.tokens


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
