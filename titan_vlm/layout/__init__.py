"""Where each token of a batch row sits, how the row is split over a CP group, and which
query-key blocks the attention computes.

A row is one or more samples packed back to back; a sample is text and images in reading order
(an image is `tokens_per_image` consecutive slots). Each slot of the row carries:

    doc    the sample it belongs to (-1: padding, which attends to nothing and is seen by nothing)
    order  its row position (the causal order)
    image  the image it belongs to within the row (-1: text)

The decoder's one mask rule: a query q sees a key k iff

    doc(q) == doc(k) >= 0  and  (order(k) <= order(q)
                                 or image(q) == image(k) >= 0
                                    with model.image_attention = "bidirectional")

so attention never crosses a sample boundary, text sees an image only if the image comes before
it, and the tokens of one image see each other causally or all at once.

The CP split (`build_layout`), per sample, one of two:

  split   its text is padded to a multiple of 2P and cut into 2P chunks; each rank gets one
          head-tail pair of chunks (j, 2P-1-j): a light and a heavy piece of its causal
          triangle, dealt by cost so images inside the text and padding do not pile up on one
          rank; its image slots are held by EVERY rank (replicated, the seed's design), or,
          with parallelism.cp_image_tokens = "shard", cut head-tail with the text (the chunks
          are of all its slots, so an image may be split between ranks). Only this text (and
          sharded image slots) crosses the CP group.
  whole   the sample, text and images, is kept on one rank: no padding, nothing sent, no copy.

parallelism.cp_sample_placement = "split" splits every sample (pairs dealt over the whole
batch); "auto" decides per row (shard_batch joins a batch's rows into one first, so no rank pads
every row to the longest): the cost model (`LayoutCost`: linear work per slot, attention pairs,
ViT images) prices each rank's load, short samples are dealt whole to the least-loaded rank,
largest first, and the samples whose split lowers the busiest rank are split (`_place_row`).

    samples a (long, image I), b, c, d (short; c with image J), P = 2, "auto":
    rank 0: | I | a0 a3 | b  c(J inline) |      [images | texts[0] | kept[0]]
    rank 1: | I | a1 a2 | d              |      [images | texts[1] | kept[1]]

    the same with cp_image_tokens = "shard" (a's chunks 0..3 now cut from text and I alike):
    rank 0: | a0 a3(I1) | b  c(J inline) |      I1, I2: I's slots in chunks 3 and 1
    rank 1: | a1(I2) a2 | d              |

Local slots on rank r: `[images, texts[r], kept[r]]` (SeqLayout): the split samples' replicated
image slots (the same on every rank), r's share of the split samples' text (sharded image slots
among it), and the samples r keeps whole (their image slots among their text).

Blocks, not masks: the slots of any sequence of metadata (a rank's local slots, another rank's
text, everything gathered) fall into *pieces*: maximal runs of one sample and one image (or
text) at consecutive row positions. Chunk and image boundaries cut every such sequence in the
same places, so between a query piece and a key piece of the same sample visibility is all,
nothing, or the causal diagonal (the same piece); with bidirectional images, pieces of one image
see each other all, wherever they are (a sharded image's later pieces too). Attention is then a
list of dense and causal blocks (`plan`): no kernel needs an arbitrary mask, and no masked-out
pair is computed.
"""

from __future__ import annotations

from titan_vlm.layout.blocks import PlanCache, plan
from titan_vlm.layout.cost import LayoutCost
from titan_vlm.layout.placement import (
    IMAGE_TOKEN_MODES,
    MIN_SPLIT_GAIN,
    SAMPLE_PLACEMENTS,
    build_layout,
    head_tail_pairs,
)
from titan_vlm.layout.seq_layout import CPAlgorithm, LayoutHandle, SeqLayout
from titan_vlm.layout.slots import Piece, Slots, image_token_index, keys_seen, pieces, visible
from titan_vlm.varlen import Block

__all__ = [
    "IMAGE_TOKEN_MODES",
    "MIN_SPLIT_GAIN",
    "SAMPLE_PLACEMENTS",
    "Block",
    "CPAlgorithm",
    "LayoutCost",
    "LayoutHandle",
    "Piece",
    "PlanCache",
    "SeqLayout",
    "Slots",
    "build_layout",
    "head_tail_pairs",
    "image_token_index",
    "keys_seen",
    "pieces",
    "plan",
    "visible",
]
