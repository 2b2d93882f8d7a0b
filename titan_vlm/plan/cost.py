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

from dataclasses import dataclass, field

from titan_vlm.plan.comm import Collective, collectives
from titan_vlm.plan.flops import executed_flops
from titan_vlm.plan.hardware import Hardware
from titan_vlm.plan.memory import (
    AC_MODES,
    PeakMemory,
    StateBytes,
    activation_bytes,
    peak_memory,
    state_bytes,
)
from titan_vlm.plan.pipeline import RankPlan, pipeline_bubble, rank_plans, step_work
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
        "dp_replicate": layout.world // layout.pp,
        "pp": min(layout.world, 2 * layout.world // layout.pp),  # a stage and the next
    }
    return inner[group]


def link_gbps(layout: Layout, group: str, hw: Hardware, gpus_per_node: int) -> float:
    return hw.intra_gbps if span(layout, group) <= gpus_per_node else hw.inter_gbps


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
    # pipeline parallelism: every pipeline rank's price (the slowest one's comms and compute
    # above, the largest peak) and the modelled bubble; none without it
    ranks: list[RankPlan] = field(default_factory=list)
    slowest: int = 0  # the pipeline rank whose step and collectives these are
    bubble: float = 0.0
    microbatches: int = 1

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


def timed_comms(
    collected: list[Collective], layout: Layout, hw: Hardware, gpus_per_node: int
) -> list[Timed]:
    return [
        Timed(c, c.sent_bytes / (link_gbps(layout, c.group, hw, gpus_per_node) * 1e9))
        for c in collected
    ]


def step_seconds(compute_s: float, timed: list[Timed]) -> float:
    """Compute, or the overlapped collectives where they take longer, plus the exposed ones."""
    overlapped = sum(t.seconds for t in timed if t.collective.overlapped)
    exposed = sum(t.seconds for t in timed if not t.collective.overlapped)
    return max(compute_s, overlapped) + exposed


def make_plan(
    shapes: ModelShapes,
    layout: Layout,
    work: Workload,
    hw: Hardware,
    gpus_per_node: int,
    efficiency: float = EFFICIENCY,
) -> Plan:
    """Price `layout` for `work` (one dp rank's rows) on `hw`; under pipeline parallelism a
    whole step's rows (its accumulation's microsteps, which the pipeline runs as one)."""
    work = step_work(layout, work)
    peak_flops = hw.peak_flops if layout.mixed_precision == "bf16" else hw.peak_flops_fp32
    g = work.whole()
    useful = layout.dp * shapes.train_flops(work.num_images, work.text_tokens, g.whole_pairs)
    common = dict(
        layout=layout,
        hardware=hw,
        gpus_per_node=gpus_per_node,
        useful_flops=useful,
        tokens_per_step=layout.dp * work.rows * work.seq_len,
        efficiency=efficiency,
    )
    if layout.pp > 1:
        return _pipeline_plan(shapes, layout, work, peak_flops, common)
    rank_flops = executed_flops(shapes, layout, work)
    compute_s = rank_flops / (peak_flops * efficiency)
    timed = timed_comms(collectives(shapes, layout, work), layout, hw, gpus_per_node)
    return Plan(
        state=state_bytes(shapes, layout),
        activations={m: activation_bytes(shapes, layout, work, m) for m in AC_MODES},
        peak=peak_memory(shapes, layout, work, layout.ac_mode),
        rank_flops=rank_flops,
        comms=timed,
        compute_s=compute_s,
        step_s=step_seconds(compute_s, timed),
        **common,  # type: ignore[arg-type]
    )


def _pipeline_plan(
    shapes: ModelShapes, layout: Layout, work: Workload, peak_flops: float, common: dict
) -> Plan:
    """make_plan under pipeline parallelism: each pipeline rank's compute over 1 - the bubble,
    its collectives (its stages' layers and parameters, FSDP's once a microbatch) and the
    stage-to-stage sends; the slowest rank sets the step, the largest peak the memory."""
    ranks = rank_plans(shapes, layout, work)
    bub = pipeline_bubble(layout, work.rows)
    hw, gpn, eff = common["hardware"], common["gpus_per_node"], common["efficiency"]
    steps = []
    for r in ranks:
        sent = Collective("pp stage-to-stage", "pp", layout.pp, r.sent, False)
        timed = timed_comms([*collectives(r.shapes, layout, work), sent], layout, hw, gpn)
        compute_s = r.flops / (peak_flops * eff)  # its stages' work; idle for the bubble too
        steps.append((step_seconds(compute_s / (1 - bub), timed), compute_s, timed, r))
    step_s, compute_s, timed, slowest = max(steps, key=lambda x: x[0])
    return Plan(
        state=ranks[0].state,
        activations={},
        peak=max((r.peak for r in ranks), key=lambda p: p.total),
        rank_flops=slowest.flops,
        comms=timed,
        compute_s=compute_s,
        step_s=step_s,
        ranks=ranks,
        slowest=slowest.rank,
        bubble=bub,
        microbatches=work.rows // layout.pp_microbatch_size,
        **common,
    )
