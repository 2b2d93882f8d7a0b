"""The trainer's entry under torchrun:

    torchrun ... -m titan_vlm.train --config train_configs/vlm_cp.toml [--key=value ...]

`train(cfg)` checks the config, starts the process group, builds the mesh and runs a `Trainer`
(trainer.py) on it; one step is step.py (read `forward_backward` there for where context
parallelism happens).
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from titan_vlm.config import JobConfig, load_config, validate_failure_keys
from titan_vlm.distributed import init_distributed
from titan_vlm.errors import UserError
from titan_vlm.launch import STOP, die_with_parent, report_user_error
from titan_vlm.parallel_dims import ParallelDims
from titan_vlm.trainer import Trainer

logger = logging.getLogger("titan_vlm")


def train(cfg: JobConfig) -> None:
    """Entry point under torchrun: validate, start the process group, build the mesh, train."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.from_config(cfg, world_size)  # config errors surface before any collective
    dims.validate_model(cfg)
    validate_failure_keys(cfg)
    device = init_distributed()
    logging.basicConfig(
        level=logging.INFO if dist.get_rank() == 0 else logging.WARNING,
        format="[titan_vlm] %(message)s",
        stream=sys.stdout,
        force=True,
    )
    mesh = dims.build_mesh(device.type)
    logger.info(
        "mesh: dp_replicate=%d dp_shard=%d cp=%d tp=%d on %d %s ranks",
        dims.dp_replicate,
        dims.dp_shard,
        dims.cp,
        dims.tp,
        world_size,
        device.type,
    )
    Trainer(cfg, mesh, device).train()
    dist.barrier()  # no rank tears down its groups while another still uses them
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """A worker under torchrun (README: When things go wrong): it exits when torchrun is gone,
    stops at a step boundary on SIGINT / SIGTERM, and reports a UserError in one line."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
        STOP.install()
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        train(cfg)
    except UserError as e:
        sys.exit(report_user_error(e))


if __name__ == "__main__":
    main()
