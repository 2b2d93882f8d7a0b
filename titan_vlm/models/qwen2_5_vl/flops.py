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

The unit of the family's image work is the PATCH (images.py QwenVisuals.work: t * h * w per
image or video), so `LayoutCost.image` is one patch's cost, and linear only: an image's
attention depends on its grid's shape, not on its patch count alone, so the CP cost model does
not price it (`image_train_flops` does, exactly).
"""

from __future__ import annotations

import torch

from titan_vlm.data.batch import Batch
from titan_vlm.data.image_batch import Images
from titan_vlm.layout import LayoutCost, SeqLayout
from titan_vlm.models.common.text_args import DecoderArgs
from titan_vlm.models.qwen2_5_vl.args import Qwen25VLArgs, VisionArgs
from titan_vlm.models.qwen2_5_vl.images import QwenVisuals
from titan_vlm.models.qwen2_5_vl.mrope import Grid  # (t, h, w) in patches


def decoder_slot_flops(d: DecoderArgs) -> float:
    """Forward + backward FLOPs of one decoder slot's matmuls: in each of n_layers layers
    wq and wo (dim x n_heads*head_dim each), wk and wv (dim x n_kv_heads*head_dim each) and the
    gated MLP's w1, w3, w2 (dim x ffn_dim each), 2 FLOPs per weight, times 3."""
    q_dim, kv_dim = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
    layer_params = 2 * d.dim * q_dim + 2 * d.dim * kv_dim + 3 * d.dim * d.ffn_dim
    return 3.0 * 2 * d.n_layers * layer_params


def decoder_pair_flops(d: DecoderArgs) -> float:
    """Forward + backward FLOPs of one decoder attention query-key pair: QK^T and AV in each
    layer, 2 * n_heads * head_dim FLOPs each, times 3."""
    return 3.0 * d.n_layers * 4 * d.n_heads * d.head_dim


def vision_patch_flops(v: VisionArgs) -> float:
    """Forward + backward FLOPs of the vision tower's matmuls per patch (attention excluded):
    the patch embedding (patch_dim x hidden), in each of `depth` blocks the fused qkv
    (hidden x 3*hidden), proj (hidden x hidden) and the gated MLP (w1, w3: hidden x
    intermediate; w2: intermediate x hidden), and the merger's share: its fc1
    (m^2*hidden x m^2*hidden) and fc2 (m^2*hidden x out_hidden_size) run once per merge unit of
    m^2 patches. 2 FLOPs per weight, times 3."""
    h, mu = v.hidden_size, v.merge_unit
    embed = v.patch_dim * h
    block = 3 * h * h + h * h + 3 * h * v.intermediate_size
    wide = mu * h  # the merger's input: a unit's m^2 patches concatenated
    merger = (wide * wide + wide * v.out_hidden_size) / mu
    return 3.0 * 2 * (embed + v.depth * block + merger)


def _full_blocks(v: VisionArgs) -> int:
    """Blocks that attend over each whole frame (the rest attend over windows)."""
    return len(set(v.fullatt_block_indexes) & set(range(v.depth)))


def _sum_of_squares_of_cuts(units: int, side: int) -> int:
    """sum of n^2 over the pieces of a row of `units` merge units cut into pieces of `side`
    from its start (the last piece shorter)."""
    full, rest = divmod(units, side)
    return full * side * side + rest * rest


def window_pairs(v: VisionArgs, grid: Grid) -> int:
    """Query-key pairs of ONE window block on a grid (t, h, w) of patches: each frame's merge
    units (h/m x w/m) cut into windows of window_units x window_units units from the frame's
    top-left corner (the last row and column of windows smaller), a window of n patches
    n^2 pairs. A window's unit counts are a product of its row and column cuts, so the sum over
    windows factors: m^4 * sum(rows^2) * sum(columns^2) per frame."""
    t, h, w = grid
    m, side = v.spatial_merge_size, v.window_units
    rows = _sum_of_squares_of_cuts(h // m, side)
    cols = _sum_of_squares_of_cuts(w // m, side)
    return t * m**4 * rows * cols


def frame_pairs(grid: Grid) -> int:
    """Query-key pairs of ONE full-attention block on a grid (t, h, w): each of the t frames
    attends over itself, (h*w)^2 pairs."""
    t, h, w = grid
    return t * (h * w) ** 2


def image_attention_flops(v: VisionArgs, grid: Grid) -> float:
    """Forward + backward FLOPs of the tower's attention on one image / video of grid
    (t, h, w): window blocks' `window_pairs`, full-attention blocks' `frame_pairs`, 4 *
    hidden_size FLOPs a pair (QK^T and AV over all heads), times 3."""
    full = _full_blocks(v)
    pairs = (v.depth - full) * window_pairs(v, grid) + full * frame_pairs(grid)
    return 3.0 * 4 * v.hidden_size * pairs


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


def image_train_flops(args: Qwen25VLArgs, grid: Grid) -> float:
    """Forward + backward FLOPs of the vision tower (patch embedding, blocks, merger) on one image
    or video of patch grid (t, h, w): `vision_patch_flops` per patch times t*h*w, plus its
    attention counted exactly (`image_attention_flops`). The decoder's work on its slots is not
    included (`batch_train_flops` adds it)."""
    t, h, w = grid
    v = args.vision
    return vision_patch_flops(v) * t * h * w + image_attention_flops(v, grid)


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
