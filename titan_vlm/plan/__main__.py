"""Price a layout without starting any process:

    python -m titan_vlm.plan --config train_configs/vlm_cp.toml [--section.key=value ...]
        [--gpu h100|h200|a100|cpu] [--nodes N --gpus-per-node G] [--seq-len L]
        [--image-size HxW]
    python -m titan_vlm.plan [--config F] [--section.key=value ...] --search --seq-len L --gpus N
        [--gpu h100] [--top K]

The workload is `training.local_batch_size` rows of `training.seq_len` slots per data-parallel
rank, each row one sample: `data.images_per_sample` images, then text to the end of the row.
The images are the model's own size (LLaVA's image_size); a Qwen-VL model (native resolution)
takes `--image-size` (default: its built-in data's images).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from typing import get_args

from titan_vlm.config import ConfigError, CPCommType, JobConfig, load_config, world_size_of
from titan_vlm.models.accounting import STATE_BYTES_PER_PARAM
from titan_vlm.models.registry import model_spec
from titan_vlm.plan.comm import cp_attention_bytes
from titan_vlm.plan.cost import EFFICIENCY, Plan, make_plan, span
from titan_vlm.plan.hardware import HARDWARE, get_hardware
from titan_vlm.plan.memory import AC_MODES, local_shape
from titan_vlm.plan.pipeline import step_work
from titan_vlm.plan.search import check_without_layout, search
from titan_vlm.plan.shapes import ModelShapes
from titan_vlm.plan.spec import Layout, Workload
from titan_vlm.validate import validate_job

GIB = 2**30
UNITS = {"GiB": 2**30, "MiB": 2**20}


def parse(argv: list[str]) -> tuple[argparse.Namespace, JobConfig]:
    parser = argparse.ArgumentParser(
        prog="python -m titan_vlm.plan", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--gpu", default="h100", help=f"one of {', '.join(HARDWARE)}")
    parser.add_argument("--nodes", type=int, help="nodes (with --gpus-per-node)")
    parser.add_argument("--gpus-per-node", type=int, help="default: the hardware's")
    parser.add_argument("--gpus", type=int, help="total devices (default: nodes x gpus per node)")
    parser.add_argument("--seq-len", type=int, help="overrides training.seq_len")
    parser.add_argument(
        "--image-size",
        help="HxW pixels of each image (a Qwen-VL model's native resolution; default: the "
        "model's own size)",
    )
    parser.add_argument("--search", action="store_true", help="list the layouts that fit")
    parser.add_argument("--top", type=int, default=10, help="--search: rows to print")
    parser.add_argument(
        "--efficiency", type=float, default=EFFICIENCY, help="fraction of peak FLOP/s reached"
    )
    opts, rest = parser.parse_known_args(argv)
    cfg = load_config(rest)
    if opts.seq_len is not None:
        cfg.training.seq_len = opts.seq_len
    return opts, cfg


def image_hw(text: str | None) -> tuple[int, int] | None:
    """--image-size "HxW" (or "S": a square) as (height, width); None: not given."""
    if text is None:
        return None
    parts = text.lower().split("x")
    if len(parts) > 2 or not all(p.strip().isascii() and p.strip().isdigit() for p in parts):
        raise ConfigError(f"--image-size: expected HxW in pixels (e.g. 448x672), got {text!r}")
    height, width = int(parts[0]), int(parts[-1])
    return height, width


def world_of(opts: argparse.Namespace, cfg: JobConfig, gpus_per_node: int) -> int:
    if opts.gpus is not None:
        world = opts.gpus
    elif opts.nodes is not None:
        world = opts.nodes * gpus_per_node
    else:
        world = world_size_of(cfg)
    if world < 1:
        raise ConfigError(f"--gpus / --nodes: need at least one device, got {world}")
    return world


def flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 1e6:,.1f} MFLOP"


def placement_line(layout: Layout, work: Workload) -> str:
    """The CP placement the plan prices: the trainer's (layout.build_layout with the config's
    cp_sample_placement and cp_image_tokens), in the words of the trainer's "cp placement" log
    line."""
    g = work.placed(layout)
    joined = "; the rows placed as one" if g.rows < work.rows else ""
    per_rank = [g.rows * (g.image_slots + g.text_slots + w) for w in g.kept_slots]
    return (
        f"cp placement priced (parallelism.cp_sample_placement={layout.cp_sample_placement}, "
        f"cp_image_tokens={layout.cp_image_tokens}{joined}): local slots per rank {per_rank}: "
        f"{g.rows * g.image_slots} image slots on every rank, {g.rows * g.text_slots} that "
        f"travel, {[g.rows * w for w in g.kept_slots]} kept whole"
    )


def experts_lines(
    shapes: ModelShapes, lay: Layout, gib: Callable[[float], str], unit: str
) -> list[str]:
    """A mixture-of-experts decoder's line: its sparse layers, the parameters a token uses, and
    the experts' part of the model state per rank (split over ep, sharded over efsdp)."""
    m = shapes.decoder.moe
    if m is None:
        return []
    total = sum(math.prod(p.shape) for p in shapes.params)
    active = total - sum(
        math.prod(p.shape) * (m.num_experts - m.top_k) // m.num_experts
        for p in shapes.params
        if p.expert
    )
    expert_state = STATE_BYTES_PER_PARAM * sum(
        math.prod(local_shape(p, lay)) for p in shapes.params if p.expert
    )
    return [
        f"  experts: {len(m.layers)} of {shapes.decoder.n_layers} decoder layers sparse "
        f"({m.num_experts} experts of width {m.ffn_dim}, top {m.top_k}); {active:,} of "
        f"{total:,} parameters active per token; the experts' state {gib(expert_state)} {unit} "
        f"of it (each rank {m.num_experts // lay.ep} experts, ep={lay.ep}, FSDP over "
        f"{lay.expert_fsdp} rank(s))"
    ]


def pipeline_lines(plan: Plan, gib: Callable[[float], str], unit: str) -> list[str]:
    """Under pipeline parallelism: the schedule, the modelled bubble, and each pipeline rank's
    stages, model state, activations with the microbatches alive at its peak, peak memory and
    the bytes it sends to other stages (plan/pipeline.py)."""
    lay = plan.layout
    m = plan.microbatches
    lines = [
        f"pipeline: {lay.pp} ranks x {lay.pp_stages_per_rank} stage(s), {lay.pp_schedule} over "
        f"{m} microbatches of {lay.pp_microbatch_size} row(s) a step; modelled bubble "
        f"{100 * plan.bubble:.0f}% of the step",
        f"  {'rank':<5}{'state':>9}{'activations':>13}{'buffers':>9}{'peak':>9}{'sends':>9}  "
        f"microbatches alive at the peak by stage; what the rank holds ({unit})",
    ]
    num_stages = lay.pp * lay.pp_stages_per_rank
    for r in plan.ranks:
        lines.append(
            f"  {r.rank:<5}{gib(r.state.total):>9}{gib(r.peak.activations - r.buffers):>13}"
            f"{gib(r.buffers):>9}{gib(r.peak.total):>9}{gib(r.sent):>9}  {r.alive}; "
            f"{r.describe(num_stages)}"
        )
    return lines


def report(plan: Plan, shapes: ModelShapes, work: Workload, args_line: str) -> list[str]:
    lay, hw = plan.layout, plan.hardware
    unit = "GiB" if plan.state.total >= GIB else "MiB"

    def gib(n: float) -> str:
        return f"{n / UNITS[unit]:.2f}"

    lines = [
        args_line,
        f"layout: {lay.describe()} on {lay.world} x {hw.name} ({plan.gpus_per_node} per node)",
        *([placement_line(lay, work)] if lay.cp > 1 else []),
        "",
        f"per rank (rank 0: the largest FSDP shard), {unit}:",
        f"  parameters {gib(plan.state.params)} | gradients {gib(plan.state.grads)} | "
        f"optimizer {gib(plan.state.optimizer)} | model state {plan.state.total / GIB:.3f} GiB "
        "(the trainer's 'model state per rank' line)",
        *experts_lines(shapes, lay, gib, unit),
        "",
    ]
    if plan.ranks:
        lines += pipeline_lines(plan, gib, unit)
    else:
        lines += [
            f"activations saved for backward per rank (the busiest), {unit}:",
            f"  {'module':<30}" + "".join(f"{m:>11}" for m in AC_MODES),
        ]
        for m in plan.activations["none"]:
            lines.append(
                f"  {m:<30}" + "".join(f"{gib(plan.activations[ac][m]):>11}" for ac in AC_MODES)
            )
        lines.append(
            f"  {'total':<30}"
            + "".join(f"{gib(sum(plan.activations[ac].values())):>11}" for ac in AC_MODES)
        )
    p = plan.peak
    lines += [
        "",
        f"peak memory estimate (ac={lay.ac_mode}): {gib(p.total)} {unit} of {hw.hbm_gib:.1f} GiB "
        f"({'fits' if plan.fits else 'does NOT fit'} in 90%): state {gib(p.state)} + unsharded "
        f"params {gib(p.unsharded_params)} + activations {gib(p.activations)} + transient "
        f"{gib(p.transient)}",
        "",
        f"FLOPs per step: {flops(plan.useful_flops)} useful (whole job, image tokens once); the "
        f"busiest rank runs {flops(plan.rank_flops)} = {plan.compute_s:.3f} s at "
        f"{flops(plan.rank_flops / plan.compute_s)}/s ({plan.efficiency:.0%} of peak)"
        + (
            f", over {1 - plan.bubble:.0%} of the step (the pipeline's bubble)"
            if plan.ranks
            else ""
        ),
        "",
        "collectives, bytes each rank sends per step:",
        f"  {'what':<34}{'group':>13}{'ranks':>6}{'link':>9}{unit:>10}{'s':>9}  overlapped",
    ]
    for t in plan.comms:
        c = t.collective
        link = "in node" if span(lay, c.group) <= plan.gpus_per_node else "network"
        lines.append(
            f"  {c.name:<34}{c.group:>13}{c.group_size:>6}{link:>9}{gib(c.sent_bytes):>10}"
            f"{t.seconds:>9.4f}  {'yes' if c.overlapped else 'no'}"
        )
    if lay.cp > 1:
        # the collectives' rank: the slowest pipeline rank's layers and a step's rows under pp
        held = plan.ranks[plan.slowest].shapes if plan.ranks else shapes
        step = step_work(lay, work)
        by_type = []
        for comm in get_args(CPCommType):
            other = dataclasses.replace(lay, cp_comm_type=comm)
            heads = shapes.decoder.n_heads // lay.tp
            if comm == "a2a" and heads % lay.cp:
                by_type.append(f"{comm} - (heads per tp rank do not divide by cp)")
            else:
                by_type.append(f"{comm} {gib(cp_attention_bytes(held, other, step))}")
        lines.append(f"  cp attention by cp_comm_type, {unit}: " + " | ".join(by_type))
    lines += [
        "",
        f"step time {plan.step_s:.3f} s | MFU {100 * plan.mfu:.1f}% | "
        f"{plan.tokens_per_s:,.0f} tokens/s ({plan.tokens_per_step:,} slots per step)",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    try:
        opts, cfg = parse(sys.argv[1:] if argv is None else argv)
        hw = get_hardware(opts.gpu)
        gpn = opts.gpus_per_node or hw.gpus_per_node
        world = world_of(opts, cfg, gpn)
        spec = model_spec(cfg)
        args = spec.args(cfg)  # a flavor or a Hugging Face folder
        shapes = spec.plan_shapes(args, image_hw(opts.image_size))
        t = cfg.training
        image_slots = cfg.data.images_per_sample * shapes.tokens_per_image
        if image_slots >= t.seq_len:
            raise ConfigError(
                f"training.seq_len={t.seq_len}: {cfg.data.images_per_sample} image(s) of "
                f"{shapes.tokens_per_image} slots (data.images_per_sample, --image-size) leave no "
                "text in a row"
            )
        work = Workload.uniform(
            t.seq_len,
            t.local_batch_size,
            cfg.data.images_per_sample,
            shapes.tokens_per_image,
            cost=spec.layout_cost(args),  # what cp_sample_placement = "auto" balances
            image_work=shapes.image_work,
            bidirectional_images=cfg.model.image_attention == "bidirectional",
        )
        head = (
            f"plan: {spec.name} {cfg.model.hf_path or cfg.model.flavor}, {t.local_batch_size} "
            f"row(s) x {t.seq_len} slots per data-parallel rank ({cfg.data.images_per_sample} "
            f"image(s) of {shapes.image_hw[0]}x{shapes.image_hw[1]} px per row, "
            f"{shapes.tokens_per_image} slots and {shapes.vision.patches} ViT patches each), "
            f"{t.mixed_precision}, on {hw.name} "
            f"(peak {flops(hw.peak_flops)}/s bf16, {hw.hbm_gib:.1f} GiB, "
            f"{hw.intra_gbps:.0f} / {hw.inter_gbps:.0f} GB/s in / between nodes)"
        )
        if opts.search:
            check_without_layout(cfg)
            fitting, priced = search(cfg, shapes, work, hw, world, gpn, opts.efficiency)
            print(head)
            print(
                f"search: {world} devices, {gpn} per node: {priced} layouts the trainer accepts, "
                f"{len(fitting)} fit; fastest first:"
            )
            print(
                f"  {'pp':>3}{'dp_rep':>7}{'dp_shard':>9}{'cp':>5}{'tp':>4}{'sp':>4}{'ep':>4}  "
                f"{'schedule':<22}{'comm':<10}{'vision':<10}"
                f"{'ac':<10}{'peak GiB':>9}{'step s':>9}{'MFU %':>7}{'tokens/s':>12}"
            )
            for p in fitting[: opts.top]:
                lay = p.layout
                schedule = lay.pp_schedule if lay.pp > 1 else "-"
                print(
                    f"  {lay.pp:>3}{lay.dp_replicate:>7}{lay.dp_shard:>9}{lay.cp:>5}{lay.tp:>4}"
                    f"{'on' if lay.sequence_parallel else 'off':>4}{lay.ep:>4}  "
                    f"{schedule:<22}{lay.cp_comm_type:<10}{lay.cp_vision:<10}{lay.ac_mode:<10}"
                    f"{p.peak.total / GIB:>9.1f}{p.step_s:>9.3f}{100 * p.mfu:>7.1f}"
                    f"{p.tokens_per_s:>12,.0f}"
                )
            if not fitting:
                print("  none: more devices, a shorter sequence or a smaller model")
            return
        validate_job(cfg, world, weights=False)
        layout = Layout.from_config(cfg, world)
        print(
            "\n".join(
                report(
                    make_plan(shapes, layout, work, hw, gpn, opts.efficiency),
                    shapes,
                    work,
                    head,
                )
            )
        )
        if cfg.training.freeze:
            print(
                f"\nnote: training.freeze={cfg.training.freeze!r} is not priced: the model state "
                "above counts every parameter as trained (the trainer counts 4 bytes, not 16, "
                "for a frozen one)"
            )
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
