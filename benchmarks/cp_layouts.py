"""Where the tokens of a batch go on the CP group: parallelism.cp_sample_placement "split" (every
sample head-tail over all ranks, its images on every rank) against "auto" (the cost model keeps
short samples whole on one rank, splits the long ones; rows placed as one), each with
parallelism.cp_image_tokens "replicate" (a split sample's image slots on every rank), "shard"
(cut head-tail with its text) or "auto" (whichever the cost model prices lower):

    python benchmarks/cp_layouts.py [--steps 10] [--cps 2,4,8] [--run-cps 2,4]

Part 1, layouts (no processes, `layout.build_layout` as the trainer calls it), for three
workloads, at each cp, averaged over `--steps` batches:

  default     the default run's data (train_configs/vlm_cp.toml: 4 rows x 256, debug flavor)
  sft         an SFT-like mix: samples of 300-4000 text tokens with 0-3 images of 576 slots,
              packed into 32k rows (LLaVA-7B widths: flavor llava7b), one row per step
  image N%    an image-heavy mix: samples of 1k-8k slots, N% of them image slots (llava7b)

  balance     cp_balance, max/mean over the ranks of the modelled cost (layout.LayoutCost: the
              flavor's FLOPs per slot, attention pair and ViT image; cp_vision = shard)
  vs ideal    the busiest rank's modelled cost / (the batch's useful cost / P): what the step
              waits for, against a perfect split of the work done once
  padding     cp_padding: the padding fraction of the busiest rank's local slots
  slots       the busiest rank's decoder slots / ((N + L) / P), N and L the batch's image and
              text slots: 1.0 when nothing is replicated or padded
  p2p MiB     bytes one rank sends for the ring attention per step (bf16 K/V, fp32 dK/dV,
              every layer), from the layout's travelling slots by cp_scaling.analytic_bytes
              (the formula tests and cp_scaling.py check against counted bytes)

Part 2, runs (`--run-cps`): the debug model's forward + backward on a real gloo group of cp
processes, ring attention, for the default run's data and for rows of one long sample whose
image share grows (0-75%: where sharding image tokens starts to pay), split vs auto placement
and replicated vs sharded image tokens: the busiest rank's local slots, the slowest rank's step
time, saved-for-backward bytes of the worst rank, and the bytes each rank sends, counted by
wrapping torch.distributed's collectives (cp_scaling.count_sent_bytes).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _group import run_group
from cp_scaling import analytic_bytes, count_sent_bytes
from torch.distributed.device_mesh import init_device_mesh

from titan_vlm.data.batch import Batch, Sample, collate
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.layout import LayoutCost, SeqLayout, build_layout
from titan_vlm.metrics import SavedForBackward
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.models.llava.flops import layout_cost
from titan_vlm.models.llava.model import VLM
from titan_vlm.parallel.context_parallel import CPOptions, image_shard_sizes
from titan_vlm.parallel_dims import MESH_DIMS, Mesh
from titan_vlm.step import forward_backward

# (cp_sample_placement, cp_image_tokens): today's layout first
LAYOUTS = (
    ("split", "replicate"),
    ("auto", "replicate"),
    ("split", "shard"),
    ("auto", "shard"),
    ("auto", "auto"),
)
IMAGE_SHARES = (0.01, 0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass
class Rows:
    """The slot metadata of one step's rows (data/batch.py's doc and image)."""

    doc: torch.Tensor
    image: torch.Tensor


def pack_rows(samples: list[tuple[int, list[int]]], seq_len: int) -> Rows:
    """One row of `seq_len` slots from (text slots, image slots of each image) samples, taken in
    order while they fit (data/batch.pack's rule); each image at a random place in its text."""
    rng = random.Random(len(samples))
    doc = torch.full((1, seq_len), -1, dtype=torch.long)
    image = torch.full((1, seq_len), -1, dtype=torch.long)
    at, images, d = 0, 0, 0
    for text, sizes in samples:
        size = text + sum(sizes)
        if at + size > seq_len:
            continue
        doc[0, at : at + size] = d
        cuts = sorted(rng.randint(0, text) for _ in sizes)  # text slots before each image
        pos, done = at, 0
        for cut, n in zip(cuts, sizes):
            pos += cut - done
            done = cut
            image[0, pos : pos + n] = images
            images += 1
            pos += n
        at += size
        d += 1
    return Rows(doc, image)


def sft_rows(step: int, seq_len: int = 32768, tpi: int = 576) -> Rows:
    rng = random.Random(1000 + step)
    samples = [(rng.randint(300, 4000), [tpi] * rng.randint(0, 3)) for _ in range(64)]
    return pack_rows(samples, seq_len)


def image_heavy_rows(step: int, share: float, seq_len: int = 32768, tpi: int = 576) -> Rows:
    rng = random.Random(2000 + step)
    samples = []
    for _ in range(64):
        total = rng.randint(1000, 8000)
        k = round(total * share / tpi) if rng.random() < 0.9 else 0
        samples.append((max(total - k * tpi, 8), [tpi] * k))
    return pack_rows(samples, seq_len)


def default_rows(step: int) -> Batch:
    args = get_flavor("debug")
    data = SyntheticCaptions(
        args.vision.image_size,
        args.tokens_per_image,
        256,
        0,
        sentences_per_image=3,
        images_per_sample=3,
        packing=True,
    )
    return data.batch(step, 0, 1, 4)


def place(
    rows: Rows | Batch, cp: int, placement: str, image_tokens: str, cost: LayoutCost
) -> SeqLayout:
    """CP rank 0's layout of the rows, as shard_batch builds it (cp_vision = shard); it knows
    every rank's slots."""
    if placement == "auto":
        if isinstance(rows, Batch):
            rows = rows.as_one_row()
        else:
            rows = Rows(rows.doc.reshape(1, -1), rows.image.reshape(1, -1))
    n_images = len(torch.unique(rows.image[rows.image >= 0]))
    # every image has the model's size here: each rank's ViT work is its share of the images
    encoded = [float(n) for n in image_shard_sizes([1] * n_images, cp)]
    return build_layout(
        rows.doc, rows.image, cp, 0, False, 1, placement, cost, encoded, image_tokens
    )[1]


def layout_row(lay: SeqLayout, rows: Rows | Batch, cp: int, flavor: str) -> dict:
    cost = lay.cost
    real = rows.doc >= 0
    n_img = int((rows.image >= 0).sum())
    n_text = int(real.sum()) - n_img
    images = len(torch.unique(rows.image[rows.image >= 0]))
    useful = cost.slot * (n_img + n_text) + cost.pair * lay.whole_work() + cost.image * images
    batch = lay.images.doc.shape[0]
    return dict(
        balance=lay.balance(),
        vs_ideal=max(lay.rank_cost()) / (useful / cp),
        padding=lay.padding(),
        slots=max(lay.rank_slots()) / ((n_img + n_text) / cp),
        p2p_mib=analytic_bytes("p2p", cp, lay.num_image_tokens, lay.travel, flavor, batch, elem=2)
        / 2**20,
        image_share=n_img / max(n_img + n_text, 1),
        split=lay.split_samples(),
        whole=sum(lay.kept_samples()),
        sharded=lay.sharded_images(),
    )


def workloads(steps: int) -> list[tuple[str, str, list]]:
    out: list[tuple[str, str, list]] = [
        ("default", "debug", [default_rows(s) for s in range(steps)]),
        ("sft", "llava7b", [sft_rows(s) for s in range(steps)]),
    ]
    for share in IMAGE_SHARES:
        rows = [image_heavy_rows(s, share) for s in range(steps)]
        out.append((f"image {share:.0%}", "llava7b", rows))
    return out


def part_layouts(steps: int, cps: list[int]) -> None:
    print("## layouts (modelled; rows of each workload averaged over the steps)\n")
    print(
        "| workload | image share | cp | placement | image tokens | split / whole samples | "
        "sharded images | balance | vs ideal | padding | slots | p2p MiB/rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, flavor, batches in workloads(steps):
        cost = layout_cost(get_flavor(flavor))
        for cp in cps:
            for placement, image_tokens in LAYOUTS:
                rows = [
                    layout_row(place(b, cp, placement, image_tokens, cost), b, cp, flavor)
                    for b in batches
                ]

                def mean(key: str, rows: list[dict] = rows) -> float:
                    return sum(r[key] for r in rows) / len(rows)

                print(
                    f"| {name} | {mean('image_share'):.0%} | {cp} | {placement} | {image_tokens} | "
                    f"{mean('split'):.1f} / {mean('whole'):.1f} | {mean('sharded'):.1f} | "
                    f"{mean('balance'):.3f} | "
                    f"{mean('vs_ideal'):.3f} | {mean('padding'):.1%} | {mean('slots'):.3f} | "
                    f"{mean('p2p_mib'):.1f} |",
                    flush=True,
                )


RUN_LAYOUTS = (("split", "replicate"), ("auto", "replicate"), ("auto", "shard"))
CROSSOVER_IMAGES = (0, 8, 16, 32, 48)  # images of 16 slots in a 1024-slot sample: 0% to 75%


def long_sample_rows(images: int, seq_len: int = 1024) -> Batch:
    """One row: one sample of `seq_len` slots with `images` images (debug flavor: 16 slots)
    spread through its text; "auto" must split it, its image slots replicated or sharded."""
    args = get_flavor("debug")
    tpi, size = args.tokens_per_image, args.vision.image_size
    rng = random.Random(images)
    text = seq_len - images * tpi
    cuts = sorted(rng.randint(0, text) for _ in range(images))
    parts: list = []
    done = 0
    for cut in cuts:
        parts += [[rng.randint(5, 200) for _ in range(cut - done)], torch.zeros(3, size, size)]
        done = cut
    parts.append([rng.randint(5, 200) for _ in range(text - done)])
    sample = Sample([p for p in parts if not isinstance(p, list) or p])
    return collate([[sample]], seq_len, tpi, size, 0)


def worker(rank: int, cp: int, results, steps: int, workload: str) -> None:
    mesh = Mesh.from_root(init_device_mesh("cpu", (1, 1, 1, cp, 1), mesh_dim_names=MESH_DIMS))
    args = get_flavor("debug")
    torch.manual_seed(0)
    model = VLM(args)
    if workload == "default":
        batches = [default_rows(s) for s in range(steps)]
    else:
        batches = [long_sample_rows(int(workload.split()[0]))] * steps
    for placement, image_tokens in RUN_LAYOUTS:
        options = CPOptions("p2p", "shard", placement, image_tokens, layout_cost(args))
        elapsed, saved_bytes, sent_bytes = 0.0, 0, 0
        forward_backward(model, batches[0], mesh, options)  # warm-up
        for batch in batches:
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            with count_sent_bytes() as sent, SavedForBackward(model.parameters()) as saved:
                layout = forward_backward(model, batch, mesh, options).layout
            took = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            elapsed += float(took)
            saved_bytes = max(saved_bytes, saved.bytes)
            sent_bytes += sent["bytes"]
        stats = torch.tensor([saved_bytes, sent_bytes], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if rank == 0:
            image = batches[0].image
            results.put(
                dict(
                    workload=workload,
                    image_share=float((image >= 0).sum() / (batches[0].doc >= 0).sum()),
                    cp=cp,
                    placement=placement,
                    image_tokens=image_tokens,
                    slots=max(layout.rank_slots()),
                    step_s=elapsed / steps,
                    saved_mib=float(stats[0]) / 2**20,
                    sent_mib=float(stats[1]) / steps / 2**20,
                )
            )


def part_runs(steps: int, cps: list[int]) -> None:
    print(
        f"\n## runs: debug flavor, p2p, forward + backward, fp32, "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}\n"
    )
    print(
        "| workload | image share | cp | placement | image tokens | slots (busiest) | step s | "
        "saved MiB/rank (worst) | sent MiB/rank/step (counted) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    workloads = ["default"] + [f"{k} images" for k in CROSSOVER_IMAGES]
    for cp in cps:
        for workload in workloads:
            for r in run_group(worker, cp, len(RUN_LAYOUTS), steps, workload):
                print(
                    f"| {r['workload']} | {r['image_share']:.0%} | {r['cp']} | {r['placement']} "
                    f"| {r['image_tokens']} | {r['slots']} | {r['step_s']:.3f} | "
                    f"{r['saved_mib']:.1f} | {r['sent_mib']:.3f} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cps", default="2,4,8", help="'' skips the layouts")
    parser.add_argument("--run-cps", default="2,4", help="'' skips the runs")
    opts = parser.parse_args()
    if opts.cps:
        part_layouts(opts.steps, [int(x) for x in opts.cps.split(",")])
    if opts.run_cps:
        part_runs(opts.steps, [int(x) for x in opts.run_cps.split(",")])


if __name__ == "__main__":
    main()
