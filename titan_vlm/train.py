"""The trainer's entry under torchrun:

    torchrun ... -m titan_vlm.train --config train_configs/vlm_cp.toml [--key=value ...]

`train(cfg)` checks the config, starts the process group, builds the mesh and runs a `Trainer`
(trainer.py) on it; one step is step.py (read `forward_backward` there for where context
parallelism happens).
"""

from __future__ import annotations

import gc
import logging
import os
import sys

import torch.distributed as dist

from titan_vlm.config import JobConfig, load_config, validate_failure_keys
from titan_vlm.data.forked import LoaderWorkerDied
from titan_vlm.distributed import init_distributed
from titan_vlm.errors import UserError
from titan_vlm.launch import STOP, die_with_parent, report_user_error
from titan_vlm.process_tree import exit_after
from titan_vlm.trainer import Trainer
from titan_vlm.validate import validate_job

logger = logging.getLogger("titan_vlm")


def train(cfg: JobConfig) -> None:
    """Entry point under torchrun: validate, start the process group, build the mesh, train."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims = validate_job(cfg, world_size)  # config errors surface before any collective
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
        "mesh: pp=%d dp_replicate=%d dp_shard=%d cp=%d tp=%d on %d %s ranks",
        dims.pp,
        dims.dp_replicate,
        dims.dp_shard,
        dims.cp,
        dims.tp,
        world_size,
        device.type,
    )
    trainer = Trainer(cfg, mesh, device)
    trainer.train()
    dist.barrier()  # no rank tears down its groups while another still uses them
    del trainer, mesh
    shut_down()


def shut_down() -> None:
    """Free the process groups here, in the main thread, before the interpreter finalizes.

    The trainer and its Checkpointer (which holds the world group) are a reference cycle, so
    without this the group is freed by whichever thread next runs a full garbage collection,
    or by the interpreter's teardown. torch frees a group with the GIL released
    (c10d's IntrusivePtrNoGilDestructor: joining gloo's threads takes a while); if the main
    thread starts finalizing meanwhile, the other thread (here `die_with_parent`'s) cannot take
    the GIL back: Python 3.11 ends it with pthread_exit, whose unwinding through that
    destructor (noexcept) is std::terminate, "terminate called without an active exception"
    (SIGABRT; tests/test_launcher.py saw it on a loaded machine after Ctrl-C). So the groups
    go here, and `main` joins the watching thread before returning: the interpreter finalizes
    with one Python thread (test_a_worker_exits_with_only_its_main_thread), so a group freed
    then (torch itself keeps one alive past destroy_process_group once the model is built) is
    freed by the finalizing thread, which may take the GIL back. A UserError's way out (or a
    dead loader worker's) comes here too: left to the teardown, its groups aborted a worker
    about 1 run in 6 (test_a_user_error_inside_the_workers_is_one_line, 'terminate called
    without an active exception' after the one-line error). The rank raised outside any
    collective, so it has no operation in flight to wait for. Without a process group
    (an error before init_distributed) there is nothing to free."""
    if not dist.is_initialized():
        return
    dist.destroy_process_group()  # shuts the groups down and forgets them
    gc.collect()  # the cycles that still hold them: the groups' last references go here


def main(argv: list[str] | None = None) -> None:
    """A worker under torchrun (README: When things go wrong): it exits when torchrun is gone,
    stops at a step boundary on SIGINT / SIGTERM, and reports a UserError in one line (exit 0
    under the launcher, no restart), a dead loader worker in one line too (exit 1: torchrun
    restarts the job under job.max_restarts)."""
    watch = None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        watch = die_with_parent()
        STOP.install()
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        train(cfg)
    except UserError as e:
        code = report_user_error(e)
        shut_down()  # the groups freed here too, not by the interpreter's teardown
        sys.exit(code)
    except LoaderWorkerDied as e:  # not the user's: one line, exit 1, torchrun may restart
        print(f"error: {e}", file=sys.stderr)
        shut_down()
        sys.exit(1)
    finally:  # whichever way the worker ends, no Python thread but this one outlives it
        if watch is not None:
            watch.stop()


if __name__ == "__main__":
    exit_after(main)  # a worker's teardown is most of a second of a core
