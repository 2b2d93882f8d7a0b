"""A layout's price: memory per rank, FLOPs, communication and their time, step time and MFU.

Time model (an estimate, stated so it can be argued with): compute runs at `efficiency` x the
device's peak (bf16, or fp32 for fp32 runs); each collective's sent bytes cross the link of its
group: NVLink when the group's ranks sit in one node (the mesh is dp_replicate x dp_shard x cp x
tp with tp innermost, so a group of the last k dims spans the product of their degrees in
consecutive ranks), else the network. Ring p2p attention and FSDP overlap with compute (only what
exceeds the compute shows); the image-embedding exchange, the all-gather and all-to-all attention
and TP sit on the critical path. MFU counts the useful FLOPs (the family's
ModelShapes.train_flops, image tokens once) against world x peak x step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_vlm.plan.comm import Collective, collectives
from titan_vlm.plan.hardware import Hardware
from titan_vlm.plan.memory import (
    PeakMemory,
    StateBytes,
    activation_bytes,
    checkpointed,
    peak_memory,
    state_bytes,
    vision_images_on_rank,
)
from titan_vlm.plan.shapes import ModelShapes
from titan_vlm.plan.spec import Layout, Workload

EFFICIENCY = 0.5  # fraction of peak FLOP/s a well-fed transformer step reaches (MFU ~ 40-55%)


def span(layout: Layout, group: str) -> int:
    """Consecutive ranks a group of this mesh dim spans (tp innermost)."""
    inner = {
        "tp": layout.tp,
        "cp": layout.cp * layout.tp,
        "ep": layout.ep * layout.tp,  # mesh (dp_replicate, efsdp, ep, tp)
        "fsdp": layout.dp_shard * layout.cp * layout.tp,
        "efsdp": layout.dp_shard * layout.cp * layout.tp,
        "dp_replicate": layout.world,
    }
    return inner[group]


def link_gbps(layout: Layout, group: str, hw: Hardware, gpus_per_node: int) -> float:
    return hw.intra_gbps if span(layout, group) <= gpus_per_node else hw.inter_gbps


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
    d = shapes.decoder
    share = checkpointed(d.n_layers, layout.ac_mode) / d.n_layers
    flops += share * flops / 3  # one more forward of the checkpointed share (head included: small)
    return flops / layout.tp


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


@dataclass(frozen=True)
class Timed:
    collective: Collective
    seconds: float


@dataclass(frozen=True)
class Plan:
    layout: Layout
    hardware: Hardware
    gpus_per_node: int
    state: StateBytes
    activations: dict[str, dict[str, int]]  # AC mode -> module -> bytes
    peak: PeakMemory  # under layout.ac_mode
    useful_flops: float  # the whole job's step (ModelShapes.train_flops)
    rank_flops: float  # the busiest rank executes
    comms: list[Timed]
    compute_s: float
    step_s: float
    tokens_per_step: int
    efficiency: float

    @property
    def mfu(self) -> float:
        return self.useful_flops / (self.step_s * self.layout.world * self.peak_flops)

    @property
    def peak_flops(self) -> float:
        return (
            self.hardware.peak_flops
            if self.layout.mixed_precision == "bf16"
            else (self.hardware.peak_flops_fp32)
        )

    @property
    def fits(self) -> bool:
        """Peak estimate within 90% of the device's memory (allocator fragmentation, NCCL and
        CUDA context take the rest)."""
        return self.peak.total <= 0.9 * self.hardware.hbm_gib * 2**30

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def make_plan(
    shapes: ModelShapes,
    layout: Layout,
    work: Workload,
    hw: Hardware,
    gpus_per_node: int,
    efficiency: float = EFFICIENCY,
) -> Plan:
    """Price `layout` for `work` (one dp rank's rows) on `hw`."""
    acts = {m: activation_bytes(shapes, layout, work, m) for m in ("none", "selective", "full")}
    peak_flops = hw.peak_flops if layout.mixed_precision == "bf16" else hw.peak_flops_fp32
    rank_flops = executed_flops(shapes, layout, work)
    compute_s = rank_flops / (peak_flops * efficiency)
    timed = [
        Timed(c, c.sent_bytes / (link_gbps(layout, c.group, hw, gpus_per_node) * 1e9))
        for c in collectives(shapes, layout, work)
    ]
    overlapped = sum(t.seconds for t in timed if t.collective.overlapped)
    exposed = sum(t.seconds for t in timed if not t.collective.overlapped)
    step_s = max(compute_s, overlapped) + exposed
    g = work.whole()
    useful = layout.dp * shapes.train_flops(work.num_images, work.text_tokens, g.whole_pairs)
    return Plan(
        layout=layout,
        hardware=hw,
        gpus_per_node=gpus_per_node,
        state=state_bytes(shapes, layout),
        activations=acts,
        peak=peak_memory(shapes, layout, work, layout.ac_mode),
        useful_flops=useful,
        rank_flops=rank_flops,
        comms=timed,
        compute_s=compute_s,
        step_s=step_s,
        tokens_per_step=layout.dp * work.rows * work.seq_len,
        efficiency=efficiency,
    )
