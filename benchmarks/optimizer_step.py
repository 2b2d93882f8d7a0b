"""Time of one AdamW step on a rank, by torch's three implementations:

    python benchmarks/optimizer_step.py [--flavors debug,small] [--cp 2] [--steps 30]

The model of each flavor is built and parallelized as the trainer does it (FSDP over a cp-rank
mesh, parameters as DTensors), its gradients filled with random numbers; each rank then times
`--steps` optimizer steps (after 3 of warm-up) with the parameter groups of
titan_vlm.optim.build_optimizer, for the per-parameter loop (`foreach=False`, torch's default on
CPU), the multi-tensor one (`foreach=True`, torch's default on CUDA) and the fused kernel
(`fused=True`, what build_optimizer uses). Prints the median milliseconds of the slowest rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _group import run_group  # noqa: E402

from titan_vlm.config import Training  # noqa: E402
from titan_vlm.models.llava.args import get_flavor  # noqa: E402
from titan_vlm.models.llava.model import VLM  # noqa: E402
from titan_vlm.models.llava.parallelize import parallelize_vlm  # noqa: E402
from titan_vlm.optim import build_optimizer  # noqa: E402
from titan_vlm.parallel_dims import MESH_DIMS, Mesh  # noqa: E402

IMPLEMENTATIONS = {
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def worker(rank: int, size: int, results: Any, flavors: list[str], steps: int) -> None:
    mesh = Mesh.from_root(init_device_mesh("cpu", (1, 1, 1, size, 1), mesh_dim_names=MESH_DIMS))
    for flavor in flavors:
        torch.manual_seed(0)
        model = parallelize_vlm(VLM(get_flavor(flavor)), mesh)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p)
        groups = build_optimizer(model, Training()).param_groups
        row: dict[str, Any] = {"flavor": flavor, "params": len(params)}
        for name, kwargs in IMPLEMENTATIONS.items():
            opt = torch.optim.AdamW(
                [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                lr=1e-4,
                betas=(0.9, 0.95),
                eps=1e-8,
                **kwargs,
            )
            times = []
            for i in range(steps + 3):
                dist.barrier()
                start = time.perf_counter()
                opt.step()
                if i >= 3:
                    times.append(time.perf_counter() - start)
            mine = torch.tensor(statistics.median(times))
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            row[name] = 1e3 * float(mine)
        if rank == 0:
            results.put(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", default="debug,small")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    flavors = args.flavors.split(",")
    print(f"| flavor | parameter tensors | {' ms | '.join(IMPLEMENTATIONS)} ms |")
    print("|---|---|" + "---|" * len(IMPLEMENTATIONS))
    for r in run_group(worker, args.cp, len(flavors), flavors, args.steps):
        cells = " | ".join(f"{r[name]:.1f}" for name in IMPLEMENTATIONS)
        print(f"| {r['flavor']} | {r['params']} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
