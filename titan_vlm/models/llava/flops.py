"""The "llava" family's FLOPs and CP cost model (works on the args alone, so the 7B flavor costs
nothing)."""

from __future__ import annotations

import torch

from titan_vlm.data.batch import Batch
from titan_vlm.data.image_batch import image_sizes
from titan_vlm.layout import LayoutCost, SeqLayout
from titan_vlm.models.llava.args import VLMArgs


def layout_cost(args: VLMArgs) -> LayoutCost:
    """The CP cost model's weights for this architecture (layout.LayoutCost), in model FLOPs of
    forward + backward (3x forward): a decoder slot runs every layer's matmuls (2 FLOPs per
    parameter), a query-key pair QK^T and AV in every layer (4 * heads * head_dim), an image the
    ViT (bidirectional over its patches and class token) and the projector on its tokens."""
    d = args.decoder
    size = args.vision.image_size
    return LayoutCost(
        slot=3.0 * 2 * d.token_matmul_params,  # a sparse layer's active experts only
        pair=3.0 * d.n_layers * 4 * d.n_heads * d.head_dim,
        image=image_train_flops(args, size, size),
    )


def image_train_flops(args: VLMArgs, height: int, width: int) -> float:
    """Model FLOPs of forward + backward (3x forward) of one image that enters the ViT at
    height x width pixels: the ViT over its patches and class token (its matmuls per token, and
    attention quadratic in them), then the projector on its image_tokens. At the native size
    (image_size x image_size) this is `layout_cost`'s per-image weight."""
    v, d = args.vision, args.decoder
    n = (height // v.patch_size) * (width // v.patch_size) + int(v.class_token)  # ViT sequence
    vit_params = v.n_layers * (4 * v.dim * v.dim + 2 * v.dim * v.mlp_dim)
    vision = 2 * vit_params * n + v.n_layers * 4 * n * n * v.dim
    projector = 2 * (v.dim * d.dim + d.dim * d.dim) * args.image_tokens(height, width)
    return 3.0 * (vision + projector)


def train_flops(args: VLMArgs, num_images: int, text_tokens: int, attention_pairs: float) -> float:
    """Model FLOPs of forward + backward (3x forward) for `num_images` images and
    `text_tokens` text tokens whose decoder attention computes `attention_pairs` query-key pairs:
    `layout_cost`'s weights, plus the output head on the text. The CP-replicated image tokens
    are counted once: this is the useful work, not what the ranks execute."""
    c = layout_cost(args)
    seq = num_images * args.tokens_per_image + text_tokens
    head = 3.0 * 2 * args.decoder.dim * args.decoder.vocab_size * text_tokens
    return c.image * num_images + c.slot * seq + c.pair * attention_pairs + head


def batch_train_flops(args: VLMArgs, batch: Batch, layout: SeqLayout) -> float:
    """`train_flops` of a batch, its attention pairs counted under the mask rule (layout/):
    `layout` is any CP rank's layout of the batch (it knows every rank's text). Images of their
    own sizes (an ImageList) count their own patches (`image_train_flops`) and slots."""
    text = int(((batch.doc >= 0) & (batch.image < 0)).sum())
    if isinstance(batch.images, torch.Tensor):  # native-size images
        return train_flops(args, batch.images.shape[0], text, layout.whole_work())
    # images of their own sizes: each its own ViT and projector FLOPs, and slots
    sizes = image_sizes(batch.images)
    c = layout_cost(args)
    seq = sum(args.image_tokens(h, w) for h, w in sizes) + text
    head = 3.0 * 2 * args.decoder.dim * args.decoder.vocab_size * text
    vision = sum(image_train_flops(args, h, w) for h, w in sizes)
    return vision + c.slot * seq + c.pair * layout.whole_work() + head
