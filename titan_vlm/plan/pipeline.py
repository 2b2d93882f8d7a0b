"""Pipeline parallelism's price (parallel/pipeline.py): what each pipeline rank holds, the
microbatches whose activations it keeps at once under the schedule, its compute, the bubble and
the stage-to-stage bytes.

    pp rank r holds stages r, r + pp, ... (pipeline_parallel_stages_per_rank of them), each its
    decoder layers (StagePlan.layers), stage 0 also the tower, projector and token embeddings,
    the last stage the norm, head and loss. Per rank:

      model state   16 bytes per local element of its stages' parameters (FSDP over dp x cp as
                    without stages; rank 0's is the trainer's "model state per rank" line)
      activations   the most bytes alive at once: each microbatch of a stage keeps the stage's
                    saved-for-backward bytes (memory.activation_bytes of one microbatch's rows)
                    from its forward to its backward (a zero-bubble schedule: to its weights'
                    backward), in the order torch's schedule runs them (`rank_actions`), and the
                    buffer it sends on (a stage before the last: the schedule holds its output
                    until the backward); plus what torch's PipelineStage allocates once for the
                    run: a receive buffer a microbatch (a stage after the first: the first
                    block's input views it) and a gradient receive buffer a microbatch (a stage
                    before the last)
      compute       its stages' share of a microbatch's FLOPs (the tower on stage 0, the head on
                    the last, the decoder's layers each alike) x the microbatches, over
                    1 - bubble (parallel.pipeline.bubble: equal stages; the slowest rank's time)
      sent          each microbatch's hidden states [wire_slots, dim] to the next stage and their
                    gradient back (parallel.pipeline.wire_slots), on the critical path
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from titan_vlm.config import PPSchedule
from titan_vlm.parallel.pipeline import (
    ZERO_BUBBLE,
    StagePlan,
    bubble,
    head_flops_per_token,
    split_stages,
    stage_holds,
    wire_slots,
)
from titan_vlm.plan.flops import executed_flops, head_flops, vision_flops
from titan_vlm.plan.memory import (
    PeakMemory,
    StageShare,
    StateBytes,
    activation_bytes,
    state_bytes,
    transient_bytes,
    unit_sizes,
)
from titan_vlm.plan.shapes import ModelShapes, Param
from titan_vlm.plan.spec import Layout, Workload

Action = tuple[str, int]  # ("F" forward | "R" release, local stage index)


def rank_actions(schedule: PPSchedule, pp: int, per_rank: int, m: int, rank: int) -> list[Action]:
    """The forwards of pipeline rank `rank` and the points where a microbatch's saved tensors of
    a local stage are released, in the order torch.distributed.pipelining's schedule runs them:
    GPipe every forward, then every backward; 1F1B min(m, pp - rank) forwards, then one backward
    and one forward; the interleaved schedules (Interleaved1F1B, InterleavedZeroBubble) their
    warm-up forwards ((v - 1) rounds and 2 (1 for zero bubble) per rank after this one, each
    round's microbatches on one local stage in turn), then a forward and a backward, the
    backwards in reverse stage order; a zero-bubble schedule releases at its weights' backward,
    `rank` backwards later."""
    if schedule == "GPipe":
        return [("F", 0)] * m + [("R", 0)] * m
    if schedule == "1F1B":
        warm = min(m, pp - rank)
        return [("F", 0)] * warm + [("R", 0), ("F", 0)] * (m - warm) + [("R", 0)] * warm
    v = per_rank
    per_round = m // max(1, m // pp)
    zero_bubble = schedule in ZERO_BUBBLE
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    total = m * v

    def forward_stage(op: int) -> int:
        return (op // per_round) % v

    def backward_stage(op: int) -> int:
        return v - 1 - ((op - warm) // per_round) % v

    out: list[Action] = []
    backwards: list[int] = []  # the local stage of each backward, in order
    released = 0
    for op in range(total + warm):
        if op < total:
            out.append(("F", forward_stage(op)))
        if op >= warm:
            backwards.append(backward_stage(op))
            if not zero_bubble:
                out.append(("R", backwards[-1]))
            elif op - warm >= rank:  # the weights' backward of an earlier backward
                out.append(("R", backwards[released]))
                released += 1
    out += [("R", s) for s in backwards[released:]] if zero_bubble else []
    return out


def peak_alive(actions: list[Action], stage_bytes: list[int]) -> tuple[int, list[int]]:
    """(the most bytes alive at once, and the microbatches alive of each local stage then) when
    each forward on local stage s keeps `stage_bytes[s]` until its release."""
    alive = [0] * len(stage_bytes)
    best, at = 0, list(alive)
    for kind, s in actions:
        alive[s] += 1 if kind == "F" else -1
        now = sum(n * b for n, b in zip(alive, stage_bytes))
        if now > best:
            best, at = now, list(alive)
    return best, at


def stages_of(p: Param, layers: list[range], tied: bool) -> tuple[int, ...]:
    """The stages that hold parameter `p` (its one-process name; StagePlan.prune): one, but a
    tied embedding's weight, which the first stage holds for the lookups and the last for the
    head."""
    last = len(layers) - 1
    if p.name.startswith("decoder.tok_embeddings."):
        return (0, last) if tied else (0,)
    if p.group != "decoder":
        return (0,)
    if p.name.startswith("decoder.layers."):
        i = int(p.name.split(".")[2])
        return (next(s for s, r in enumerate(layers) if i in r),)
    return (last,)  # the final norm and the head


@dataclass(frozen=True)
class RankPlan:
    """Pipeline rank `rank`'s price: its stages and their layers; `shapes`, the model as this
    rank holds it (its stages' parameters, its decoder layers' count: what its collectives
    move); its model state and peak memory; what autograd saves for one microbatch on each of
    its stages (`stage_saved`, by local stage: the received buffer's storage among it), the
    microbatches alive at its peak (`alive`) and the pipeline's buffers allocated for the run
    (`buffers`); its compute in FLOPs per step (`flops`) and the bytes it sends to other stages
    per step (`sent`)."""

    rank: int
    stages: list[int]
    layers: list[range]
    shapes: ModelShapes
    state: StateBytes
    peak: PeakMemory
    stage_saved: list[int]
    alive: list[int]
    buffers: int
    flops: float
    sent: int

    def describe(self, num_stages: int) -> str:
        return "; ".join(
            f"stage {s} ({stage_holds(s, r, num_stages)})" for s, r in zip(self.stages, self.layers)
        )


def rows_of(work: Workload, rows: int) -> Workload:
    """`rows` rows of the uniform workload `work` (its rows in turn, again from the first where
    there are more; each copy's images their own)."""
    index = torch.arange(rows) % work.rows
    copy = (torch.arange(rows) // work.rows)[:, None]
    image = work.image[index]
    per_copy = int(work.image.max()) + 1 if (work.image >= 0).any() else 0
    image = torch.where(image >= 0, image + copy * per_copy, image)
    return dataclasses.replace(work, doc=work.doc[index], image=image, _geometries={})


def stage_flops(
    shapes: ModelShapes, layout: Layout, mb: Workload, share: StageShare, n_layers: int
) -> float:
    """FLOPs of one microbatch on a stage, on the busiest cp rank: cost.executed_flops of the
    microbatch split by what the stage runs (the tower and projector on the first, the head on
    the last, each decoder layer alike)."""
    total = executed_flops(shapes, layout, mb)
    head, vision = head_flops(shapes, layout, mb), vision_flops(shapes, layout, mb)
    decoder = total - head - vision
    out = decoder * len(share.layers) / n_layers
    return out + (vision if share.first else 0.0) + (head if share.last else 0.0)


def layer_split(shapes: ModelShapes, layout: Layout, mb: Workload) -> list[range]:
    """Each stage's decoder layers, as the trainer splits them (parallel.pipeline.split_stages)
    for the microbatch `mb`."""
    d = shapes.decoder
    return split_stages(
        layout.pp_stage_layers,
        layout.pp * layout.pp_stages_per_rank,
        mb.cost,
        head_flops_per_token(d.dim, d.vocab_size),
        d.n_layers,
        mb.rows,
        mb.seq_len,
        mb.num_images,
        shapes.first_stage_layers,
    )


def step_work(layout: Layout, work: Workload) -> Workload:
    """The rows a step of `layout` prices: `work` (a microstep's), or under pipeline
    parallelism all of a step's (its accumulation's microsteps, which the pipeline runs as
    one schedule step)."""
    return rows_of(work, work.rows * layout.accumulation) if layout.pp > 1 else work


def rank_plans(shapes: ModelShapes, layout: Layout, work: Workload) -> list[RankPlan]:
    """Every pipeline rank's RankPlan under `layout` (its pp, schedule, microbatch size and
    stages a rank) for `work` (one dp rank's rows of a step)."""
    n_layers = shapes.decoder.n_layers
    m = work.rows // layout.pp_microbatch_size
    mb = rows_of(work, layout.pp_microbatch_size)
    g = mb.placed(layout)
    multiple = layout.tp if layout.sequence_parallel else 1
    wire = wire_slots(mb.rows, mb.seq_len, layout.cp, multiple) * shapes.decoder.dim
    wire *= layout.act_bytes
    fp32 = layout.act_bytes == 4
    viewed = g.rows * g.local_slots * 4 * shapes.decoder.dim if fp32 else 0
    split = tuple(layer_split(shapes, layout, mb))
    out = []
    for rank in range(layout.pp):
        plan = StagePlan(rank, layout.pp, layout.pp_stages_per_rank, n_layers, split)
        layers, last = plan.layers, plan.num_stages - 1
        params = tuple(
            p
            for p in shapes.params
            if any(plan.holds(s) for s in stages_of(p, layers, shapes.decoder.tie_embeddings))
        )
        own = [layers[s] for s in plan.stages]
        decoder = dataclasses.replace(shapes.decoder, n_layers=sum(map(len, own)))
        rank_shapes = dataclasses.replace(shapes, params=params, decoder=decoder)
        stage_saved, held, transient, flops, sent, buffers = [], [], 0, 0.0, 0, 0
        for s in plan.stages:
            share = StageShare(layers[s], s == 0, s == last)
            saved = sum(activation_bytes(shapes, layout, mb, layout.ac_mode, share).values())
            if s > 0:  # its received buffer; in fp32 the first block's saved input views it
                saved += wire - viewed
            stage_saved.append(saved)
            # a microbatch alive: what autograd saves, less the received buffer (allocated for
            # the run, below), plus the sent buffer
            held.append(saved - wire * (s > 0) + wire * (s < last))
            # a wire buffer a microbatch and neighbour: what torch allocates for the run (a
            # receive buffer from the stage before, a gradient's from the one after), and what
            # crosses (h forward to the stage after, its gradient back to the one before)
            wires = m * wire * ((s > 0) + (s < last))
            buffers += wires
            sent += wires
            transient = max(transient, transient_bytes(shapes, layout, mb, layout.ac_mode, share))
            flops += m * stage_flops(shapes, layout, mb, share, n_layers)
        actions = rank_actions(layout.pp_schedule, layout.pp, plan.per_rank, m, rank)
        activations, alive = peak_alive(actions, held)
        state = state_bytes(rank_shapes, layout)
        peak = PeakMemory(
            state.total, pipeline_gathered(rank_shapes, layout), activations + buffers, transient
        )
        out.append(
            RankPlan(
                rank,
                plan.stages,
                own,
                rank_shapes,
                state,
                peak,
                stage_saved,
                alive,
                buffers,
                flops,
                sent,
            )
        )
    return out


def pipeline_gathered(shapes: ModelShapes, layout: Layout) -> int:
    """FSDP's gathered parameters in use at once on a pipeline rank holding `shapes.params`:
    none without FSDP (fp32 without dp, cp or tp ranks: parallel/parallelize.py apply_fsdp);
    else every unit is an FSDP root freed after each forward, so two units (the largest: a
    block, or the roots counted as one) with their unsharded fp32 gradients."""
    sharded = layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp > 1
    if not sharded and layout.act_bytes == 4:
        return 0
    roots, blocks = unit_sizes(shapes, layout)
    return 2 * max([roots, *blocks]) * (layout.act_bytes + 4)


def pipeline_bubble(layout: Layout, rows: int) -> float:
    """The modelled idle share of a step (parallel.pipeline.bubble) for `rows` rows a dp rank."""
    m = rows // layout.pp_microbatch_size
    v = layout.pp_stages_per_rank
    return bubble(layout.pp_schedule, layout.pp * v, v, m)
