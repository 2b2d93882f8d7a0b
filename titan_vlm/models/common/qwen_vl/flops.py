"""The "qwen2_5_vl" family's FLOPs and CP cost model (from the args alone: no module is built).

Every number is model FLOPs of forward + backward, 3x the forward's, the forward counting 2 FLOPs
per weight of a matmul per row it multiplies (biases, norms, activations, rotary embeddings and
softmax are left out, as in the llava family's models/llava/flops.py):

    decoder   per slot: every layer's q, k, v, o projections and gated MLP (the llava formula:
              same DecoderArgs, same numbers); per attention query-key pair: QK^T and AV of
              every layer, 4 * n_heads * head_dim; the output head on the text tokens only
    vision    per patch: the patch embedding, every block's fused qkv, proj and gated MLP, and
              the merger (an MLP per merge unit of m^2 patches: 1/m^2 of a unit's per patch);
              attention per query-key pair of a block: 4 * hidden_size, over each window of a
              window block and each frame of a full-attention block (`image_train_flops`)

The unit of the family's image work is one patch's matmuls (`LayoutCost.image`), and an image's
work (images.py QwenVisuals.work) is its whole tower cost in that unit, its window and full
attention included (vision_cost.py image_train_flops): so the CP cost model and cp_vision =
"shard" price each image as it is.
"""

from __future__ import annotations

import torch

from titan_vlm.data.batch import Batch
from titan_vlm.data.image_batch import Images
from titan_vlm.layout import LayoutCost, SeqLayout
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.images import QwenVisuals
from titan_vlm.models.common.qwen_vl.mrope import Grid  # (t, h, w) in patches
from titan_vlm.models.common.qwen_vl.vision_cost import image_train_flops, vision_patch_flops
from titan_vlm.models.common.text_args import DecoderArgs


def decoder_slot_flops(d: DecoderArgs) -> float:
    """Forward + backward FLOPs of one decoder slot's matmuls (DecoderArgs.token_matmul_params:
    a sparse layer's active experts only), 2 FLOPs per weight, times 3."""
    return 3.0 * 2 * d.token_matmul_params


def decoder_pair_flops(d: DecoderArgs) -> float:
    """Forward + backward FLOPs of one decoder attention query-key pair: QK^T and AV in each
    layer, 2 * n_heads * head_dim FLOPs each, times 3."""
    return 3.0 * d.n_layers * 4 * d.n_heads * d.head_dim


def layout_cost(args: Qwen25VLArgs) -> LayoutCost:
    """The CP cost model's weights (layout.LayoutCost), in forward + backward FLOPs: `slot` per
    decoder slot (`decoder_slot_flops`), `pair` per decoder query-key pair
    (`decoder_pair_flops`), `image` per vision PATCH, the unit QwenVisuals.work counts in: its
    matmuls and its share of the merger (`vision_patch_flops`), not its attention (module
    docstring)."""
    return LayoutCost(
        slot=decoder_slot_flops(args.decoder),
        pair=decoder_pair_flops(args.decoder),
        image=vision_patch_flops(args.vision),
    )


def batch_grids(args: Qwen25VLArgs, images: Images) -> list[Grid]:
    """The patch grid of each image of a batch, in batch order: a QwenVisuals' own `grids()`, or
    (1, H/p, W/p) for each image of a tensor batch [n, C, H, W] (an image is one temporal
    patch)."""
    if isinstance(images, torch.Tensor):
        p = args.vision.patch_size
        height, width = images.shape[2], images.shape[3]
        return [(1, height // p, width // p)] * images.shape[0]
    if not isinstance(images, QwenVisuals):
        raise TypeError(
            f"the qwen2_5_vl family's FLOPs need each image's patch grid: a batch's images are "
            f"QwenVisuals or a tensor, not {type(images).__name__}"
        )
    return list(images.grids())


def batch_train_flops(args: Qwen25VLArgs, batch: Batch, layout: SeqLayout) -> float:
    """Model FLOPs of forward + backward of a batch (ModelSpec.flops): the vision tower on each
    image / video (`image_train_flops` of its grid), the decoder's per-slot matmuls on every text
    token (doc >= 0, image < 0) and image slot (image >= 0), its attention on
    `layout.whole_work()` query-key pairs (the mask rule's count; `layout` is any CP rank's
    layout of the batch), and the output head (dim x vocab_size) on the text tokens. Padding
    slots are not counted; CP-replicated image slots are counted once: the useful work, not what
    the ranks execute."""
    d = args.decoder
    text = int(((batch.doc >= 0) & (batch.image < 0)).sum())
    image_slots = int((batch.image >= 0).sum())
    vision = sum(image_train_flops(args, g) for g in batch_grids(args, batch.images))
    head = 3.0 * 2 * d.dim * d.vocab_size * text
    decoder = decoder_slot_flops(d) * (text + image_slots)
    return vision + decoder + decoder_pair_flops(d) * layout.whole_work() + head
