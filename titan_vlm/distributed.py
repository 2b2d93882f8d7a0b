"""The small distributed helpers the trainer, the optimizer and the parallelisms share:

local_tensor(x)        this rank's piece of a DTensor; a plain tensor as it is
dist_sum(x, group)     x summed over the group, in place (every rank gets the sum)
dist_max(x, group)     the elementwise max over the group, in place
init_distributed()     the process group torchrun (or a plain `python -m`) asks for
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def local_tensor(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the same storage, no communication); any other tensor as
    it is."""
    return x.to_local() if isinstance(x, DTensor) else x


def dist_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce `x` with SUM over `group` in place; returns `x` (the same on every rank)."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def dist_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce `x` with MAX over `group` in place; returns `x` (the same on every rank)."""
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def init_distributed() -> torch.device:
    """Start the default process group: NCCL on this rank's GPU when there is one, else gloo on
    the CPU. Under plain `python -m titan_vlm.train` (no RANK in the environment) it is a group
    of one on 127.0.0.1:$MASTER_PORT (29511 unless set). Returns this rank's device."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", "29511"),
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device
