"""Run a benchmark worker on a fresh gloo group of `size` local processes and collect what rank 0
reports (shared by the benchmarks in this folder). The group is started by the repository's one
process-group spawner (tests/dist_pool.py: spawn_group, init_gloo), spawned: a fresh interpreter
per rank (the test pool forks its workers from a preloaded fork server instead)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist_pool import init_gloo, spawn_group  # noqa: E402 - tests/ is on the path only now


def _entry(
    rank: int, size: int, port: int, worker: Callable[..., None], args: tuple, results: Queue
) -> None:
    init_gloo(rank, size, port, threads=max(1, (os.cpu_count() or 1) // size), timeout_s=None)
    worker(rank, size, results, *args)
    dist.barrier()
    dist.destroy_process_group()


def run_group(worker: Callable[..., None], size: int, n_results: int, *args: Any) -> Iterator[dict]:
    """Start `worker(rank, size, results_queue, *args)` on `size` processes; yield `n_results`
    items from the queue as they come; exit if a worker failed."""
    results = mp.get_context("spawn").Queue()
    procs = spawn_group(_entry, size, worker, args, results)
    for _ in range(n_results):
        yield results.get()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a worker of the {size}-process group failed")
