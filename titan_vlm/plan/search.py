"""`--search`: every layout of a world size that the trainer accepts, priced, the ones that fit
first and fastest (job tokens per second) first."""

from __future__ import annotations

import copy
import itertools
from typing import get_args

from titan_vlm.config import ACMode, ConfigError, CPCommType, CPVision, JobConfig, PPSchedule
from titan_vlm.optim import accumulation_steps
from titan_vlm.plan.cost import Plan, make_plan
from titan_vlm.plan.hardware import Hardware
from titan_vlm.plan.shapes import ModelShapes
from titan_vlm.plan.spec import Layout, Workload
from titan_vlm.validate import validate_job


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def pipelines(pp: int) -> list[tuple[PPSchedule, int]]:
    """The (schedule, stages a rank) --search tries at pipeline degree `pp`: every schedule, the
    interleaved one at 2 stages a rank; none (1F1B, unused) without a pipeline."""
    if pp == 1:
        return [("1F1B", 1)]
    return [(s, 2 if s == "Interleaved1F1B" else 1) for s in get_args(PPSchedule)]


def candidate_layouts(
    cfg: JobConfig, world: int, gpus_per_node: int, experts: bool = False
) -> list[Layout]:
    """(pp, dp_replicate, dp_shard, cp, tp) with product `world` and tp within a node, each with
    every pipeline schedule (`pipelines`; pp > 1, the config's microbatch size), cp_comm_type and
    cp_vision (cp > 1) and AC mode, and (`experts`: a mixture-of-experts decoder) every
    expert-parallel degree dividing dp_shard x cp; sequence parallelism on whenever tp > 1 and
    the trainer takes it (not with experts: their TP plan has none; not for a family without
    it); the config's cp_sample_placement, cp_image_tokens and pipeline stage layers.
    Layouts the trainer would refuse (validate.validate_job: heads, a2a, experts that do not
    split, what a pipeline does not run yet, ...) are left out."""
    out = []
    for pp, tp in itertools.product(divisors(world), divisors(world)):
        if tp > gpus_per_node or world % (pp * tp):
            continue
        inner = world // (pp * tp)  # dp_replicate x dp_shard x cp
        for cp in divisors(inner):
            for rep in divisors(inner // cp):
                shard = inner // (cp * rep)
                comms: tuple[CPCommType, ...] = get_args(CPCommType) if cp > 1 else ("p2p",)
                visions: tuple[CPVision, ...] = get_args(CPVision) if cp > 1 else ("shard",)
                eps = divisors(shard * cp) if experts else [1]
                sps = (True, False) if tp > 1 and not experts else (False,)
                for comm, vision, ac, ep, (schedule, per_rank) in itertools.product(
                    comms, visions, get_args(ACMode), eps, pipelines(pp)
                ):
                    layouts = (
                        Layout(
                            rep,
                            shard,
                            cp,
                            tp,
                            comm,
                            vision,
                            ac,
                            cfg.training.mixed_precision,
                            sequence_parallel=sp,
                            cp_sample_placement=cfg.parallelism.cp_sample_placement,
                            cp_image_tokens=cfg.parallelism.cp_image_tokens,
                            ep=ep,
                            pp=pp,
                            pp_schedule=schedule,
                            pp_microbatch_size=cfg.parallelism.pipeline_parallel_microbatch_size,
                            pp_stages_per_rank=per_rank,
                            pp_stage_layers=cfg.parallelism.pipeline_parallel_stage_layers,
                            accumulation=accumulation_steps(cfg.training, rep * shard),
                        )
                        for sp in sps
                    )
                    layout = next((x for x in layouts if accepted(cfg, x)), None)
                    if layout is not None:
                        out.append(layout)
    return out


def configured(cfg: JobConfig, layout: Layout) -> JobConfig:
    """A copy of `cfg` with `layout`'s degrees and choices."""
    c = copy.deepcopy(cfg)
    p = c.parallelism
    p.data_parallel_replicate_degree = layout.dp_replicate
    p.data_parallel_shard_degree = layout.dp_shard
    p.context_parallel_degree = layout.cp
    p.tensor_parallel_degree = layout.tp
    p.cp_comm_type, p.cp_vision = layout.cp_comm_type, layout.cp_vision
    p.enable_sequence_parallel = layout.sequence_parallel
    p.image_embed_tp_shard = False
    p.expert_parallel_degree = layout.ep
    p.pipeline_parallel_degree = layout.pp
    p.pipeline_parallel_schedule = layout.pp_schedule
    p.pipeline_parallel_microbatch_size = layout.pp_microbatch_size
    p.pipeline_parallel_stages_per_rank = layout.pp_stages_per_rank
    p.pipeline_parallel_stage_layers = layout.pp_stage_layers
    c.activation_checkpoint.mode = layout.ac_mode
    return c


def accepted(cfg: JobConfig, layout: Layout) -> bool:
    try:
        validate_job(configured(cfg, layout), layout.world, weights=False)
    except ConfigError:
        return False
    return True


def check_without_layout(cfg: JobConfig) -> None:
    """What no layout changes (the model's sources, the data and recipe keys), checked on one
    device, so that a search whose every layout the trainer would refuse for such a reason says
    it in one line (a ConfigError) instead of listing no layout."""
    one = Layout(mixed_precision=cfg.training.mixed_precision, ac_mode="none")
    validate_job(configured(cfg, one), 1, weights=False)


def search(
    cfg: JobConfig,
    shapes: ModelShapes,
    work: Workload,
    hw: Hardware,
    world: int,
    gpus_per_node: int,
    efficiency: float,
) -> tuple[list[Plan], int]:
    """(the plans that fit, fastest first; how many layouts were priced)."""
    plans = [
        make_plan(shapes, layout, work, hw, gpus_per_node, efficiency)
        for layout in candidate_layouts(cfg, world, gpus_per_node, shapes.decoder.moe is not None)
    ]
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (-p.tokens_per_s, p.peak.total))
    return fitting, len(plans)
