"""Where the ViT runs in a CP group:

    python benchmarks/vision_placement.py [--flavor small] [--cps 2,4]

For each parallelism.cp_vision mode, one step of the vision side as the trainer runs it
(`encode_images_over_cp`, then a backward from a gradient on the replicated embeddings): time of
the slowest rank, images each rank encodes, the ViT + projector activations each rank saves for
backward, and the bytes each rank sends for the embeddings and their gradient (ring algorithms:
all-reduce 2(P-1)/P E, all-gather and reduce-scatter (P-1)/P E each, broadcast and reduce E on
the ranks that forward it; E = the embeddings' bytes). 8 images per row, 2 rows, fp32, no FSDP.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from _group import run_group
from torch.distributed.device_mesh import init_device_mesh

from titan_vlm.metrics import SavedForBackward
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.models.llava.model import VLM
from titan_vlm.parallel.context_parallel import (
    CP_VISION_MODES,
    encode_images_over_cp,
    image_shard_sizes,
)

IMAGES_PER_ROW, ROWS, REPEATS = 8, 2, 3


def sent_bytes(mode: str, cp: int, embed_bytes: int) -> int:
    if mode == "broadcast":  # broadcast forward + reduce backward, on a rank that forwards them
        return 2 * embed_bytes
    return 2 * (cp - 1) * embed_bytes // cp  # all-reduce, or all-gather + reduce-scatter


def worker(rank: int, cp: int, results, flavor: str) -> None:
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    args = get_flavor(flavor)
    torch.manual_seed(0)
    model = VLM(args)
    n = IMAGES_PER_ROW * ROWS
    images = torch.randn(n, 3, args.vision.image_size, args.vision.image_size)
    for mode in CP_VISION_MODES:
        saved = SavedForBackward(model.parameters())
        times = []
        for i in range(REPEATS + 1):
            dist.barrier()
            start = time.perf_counter()
            with saved if i == 0 else torch.enable_grad():
                embeds = encode_images_over_cp(model, images, mesh, mode)
            embeds.backward(
                torch.full_like(embeds, 1e-3)
            )  # a partial gradient from this rank's text
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        elapsed = torch.tensor(min(times[1:]))
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        activations = torch.tensor(float(saved.bytes))
        dist.all_reduce(activations, op=dist.ReduceOp.MAX)
        encoded = {
            "replicate": n,
            "broadcast": n if rank == 0 else 0,
            "shard": image_shard_sizes([1] * n, cp)[rank],
        }[mode]
        most = torch.tensor(encoded)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put(
                dict(
                    mode=mode,
                    cp=cp,
                    ms=float(elapsed) * 1e3,
                    images=int(most),
                    saved_mib=float(activations) / 2**20,
                    sent_mib=sent_bytes(mode, cp, embeds.numel() * 4) / 2**20,
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="small")
    parser.add_argument("--cps", default="2,4")
    opts = parser.parse_args()
    print(
        f"# {opts.flavor} flavor, {IMAGES_PER_ROW} images per row x {ROWS} rows, fp32, "
        f"{os.cpu_count()} CPU cores"
    )
    print(
        "| cp | cp_vision | ViT+projector step ms | images encoded (max rank) "
        "| saved MiB/rank | sent MiB/rank |"
    )
    print("|---|---|---|---|---|---|")
    for cp in (int(x) for x in opts.cps.split(",")):
        for r in run_group(worker, cp, len(CP_VISION_MODES), opts.flavor):
            print(
                f"| {r['cp']} | {r['mode']} | {r['ms']:.1f} | {r['images']} | "
                f"{r['saved_mib']:.1f} | "
                f"{r['sent_mib']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
