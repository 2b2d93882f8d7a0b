"""What a rank executes per step in FLOPs (`executed_flops`, over tp), and the parts of it the
tower and projector (`vision_flops`) and the output head (`head_flops`) run: a pipeline's first
and last stages hold those (plan/pipeline.py)."""

from __future__ import annotations

import math

from titan_vlm.plan.memory import checkpointed, vision_images_on_rank
from titan_vlm.plan.shapes import ModelShapes
from titan_vlm.plan.spec import Layout, Workload


def executed_flops(shapes: ModelShapes, layout: Layout, work: Workload) -> float:
    """FLOPs the busiest rank runs per step: train_flops of its images (cp_vision), its text
    section and its attention pairs, with the decoder's linear layers corrected from the slots
    of the images it encoded to the replicated image slots it holds (a negative correction
    where images are kept whole elsewhere or sharded: their slots are in some rank's text
    section), plus the recomputed forward of checkpointed blocks; over tp."""
    g = work.placed(layout)
    n_vis = vision_images_on_rank(layout, work.num_images)
    if layout.cp_comm_type == "a2a" and layout.cp > 1:
        # every rank: the shared rows on H/P heads, its kept samples on every head
        shared = (g.whole_pairs - sum(g.kept_pairs)) / layout.cp
        pairs = shared + max(g.kept_pairs)
    else:
        pairs = max(g.pairs)
    text = g.rows * g.section_slots
    flops = shapes.train_flops(n_vis, text, pairs)
    block_params = active_block_params(shapes)
    other_image_slots = g.rows * g.image_slots - n_vis * shapes.tokens_per_image
    flops += 6 * block_params * other_image_slots
    return flops * recomputed(shapes, layout) / layout.tp


def recomputed(shapes: ModelShapes, layout: Layout) -> float:
    """1 + the forward run again under AC: a third of the checkpointed share of the work (the
    share of the decoder's blocks checkpointed, applied to all of it: the head is small)."""
    d = shapes.decoder
    return 1 + checkpointed(d.n_layers, layout.ac_mode) / d.n_layers / 3


def vision_flops(shapes: ModelShapes, layout: Layout, work: Workload) -> float:
    """The part of `executed_flops` the tower and projector run: train_flops of the busiest
    rank's images less their decoder slots' (the cost model's `slot` weight)."""
    n_vis = vision_images_on_rank(layout, work.num_images)
    own = shapes.train_flops(n_vis, 0, 0) - work.cost.slot * n_vis * shapes.tokens_per_image
    return own * recomputed(shapes, layout) / layout.tp


def head_flops(shapes: ModelShapes, layout: Layout, work: Workload) -> float:
    """The part of `executed_flops` the output head runs: train_flops of the busiest rank's
    text section less its decoder slots'."""
    g = work.placed(layout)
    text = g.rows * g.section_slots
    own = shapes.train_flops(0, text, 0) - work.cost.slot * text
    return own * recomputed(shapes, layout) / layout.tp


def active_block_params(shapes: ModelShapes) -> float:
    """The decoder blocks' matrix weights one token meets (2 FLOPs each forward, 6 in all): a
    mixture-of-experts layer's router and top_k of its E experts (top_k / E of the stacked
    experts' weights; under expert parallelism the busiest rank's share when the router spreads
    the picks evenly)."""
    d = shapes.decoder
    active = d.moe.top_k / d.moe.num_experts if d.moe else 1.0
    return sum(
        math.prod(p.shape) * (active if p.expert else 1.0)
        for p in shapes.params
        if p.group == "decoder" and ".layers." in p.name and len(p.shape) > 1
    )
