"""Pipeline parallelism on the CPU: each schedule's measured step time and idle share against the
planner's modelled bubble, on 2 pipeline ranks of one core each.

    python benchmarks/pipeline_bubble.py [--layers 8] [--seq-len 512] [--microbatches 4,8]

For each schedule and microbatch count m: the debug model (fp32) with `--layers` decoder layers
split over the stages as the trainer splits them (the cost model: stage_split), m microbatches
of one row (an image, then text to the end), one optimizer step's forward and backward
(parallel/pipeline.py Pipeline.step), the median of `--steps` timed steps after a warm-up.
`one s`: the same microbatches' forward and backward on one process (rank 0 alone, one core),
the work the two ranks share; `idle`: 1 - one / (2 x step),
the share of the step a rank did not compute (the bubble, the sends and any imbalance between
the stages: the first stage runs the ViT, the last the head); `modelled`: the planner's bubble
(parallel.pipeline.bubble, equal stages, no sends).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.queues import Queue

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _group import run_group

from titan_vlm.data.batch import IGNORE_INDEX, Batch
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.models.llava.args import VLMArgs, get_flavor
from titan_vlm.models.llava.flops import layout_cost
from titan_vlm.models.llava.model import VLM
from titan_vlm.parallel.context_parallel import CPContext
from titan_vlm.parallel.pipeline import (
    Pipeline,
    StagePlan,
    bubble,
    head_flops_per_token,
    split_stages,
)

SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 1))


def timed(fn: Callable[[], object], steps: int) -> float:
    """The median seconds of `steps` calls of `fn` after one warm-up call."""
    fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def whole_step(model: VLM, parts: list[Batch], ntokens: torch.Tensor) -> None:
    """The microbatches' forward and backward on one process."""
    for part in parts:
        logits, labels, _ = model.forward_local(part, CPContext())
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        (loss / ntokens).backward()


def cost_split(args: VLMArgs, stages: int, seq_len: int, images: int) -> tuple[range, ...]:
    """The trainer's split of the layers (parallel.pipeline.split_stages, by the cost model)
    for microbatches of one row of `seq_len` slots holding `images` images."""
    d = args.decoder
    head = head_flops_per_token(d.dim, d.vocab_size)
    cost = layout_cost(args)
    return tuple(split_stages("", stages, cost, head, d.n_layers, 1, seq_len, images))


def worker(
    rank: int, size: int, results: Queue, layers: int, seq_len: int, ms: list[int], steps: int
) -> None:
    base = get_flavor("debug")
    args = dataclasses.replace(base, decoder=dataclasses.replace(base.decoder, n_layers=layers))
    data = SyntheticCaptions(
        args.vision.image_size, args.tokens_per_image, seq_len, 0, sentences_per_image=40
    )
    group = dist.group.WORLD
    assert group is not None
    for m in ms:
        batch = data.batch(0, 0, 1, m)
        parts = [batch.rows(k, k + 1) for k in range(m)]
        ntokens = (batch.labels != IGNORE_INDEX).sum()
        images = len(torch.unique(parts[0].image[parts[0].image >= 0]))
        torch.manual_seed(0)
        one = timed(partial(whole_step, VLM(args), parts, ntokens), steps) if rank == 0 else 0.0
        dist.barrier()
        for schedule, virtual in SCHEDULES:
            split = cost_split(args, size * virtual, seq_len, images)
            torch.manual_seed(0)
            model = VLM(args)
            plan = StagePlan(rank, size, virtual, layers, split)
            plan.prune(model)
            pipe = Pipeline(model, plan, group, schedule, m, 1, seq_len, torch.device("cpu"))
            dist.barrier()
            step = timed(partial(pipe.step, parts, ntokens), steps)
            if rank == 0:
                results.put(
                    dict(
                        schedule=schedule,
                        virtual=virtual,
                        m=m,
                        split=[len(r) for r in split],
                        step=step,
                        one=one,
                        modelled=bubble(schedule, size * virtual, virtual, m),
                    )
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args()
    ms = [int(x) for x in opts.microbatches.split(",")]
    print(
        f"# debug flavor, {opts.layers} decoder layers, rows of {opts.seq_len} slots, fp32, "
        f"pp = 2, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    )
    print("| schedule | stages a rank | layers a stage | m | step s | one s | idle | modelled |")
    print("|---|---|---|---|---|---|---|---|")
    n = len(ms) * len(SCHEDULES)
    for r in run_group(worker, 2, n, opts.layers, opts.seq_len, ms, opts.steps):
        idle = 1 - r["one"] / (2 * r["step"])
        print(
            f"| {r['schedule']} | {r['virtual']} | {r['split']} | {r['m']} | {r['step']:.3f} | "
            f"{r['one']:.3f} | "
            f"{idle:.0%} | {r['modelled']:.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
