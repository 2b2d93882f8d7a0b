"""Run a benchmark worker on a fresh gloo group of `size` local processes and collect what rank 0
reports (shared by the benchmarks in this folder)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, size: int, port: int, worker: Callable, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    worker(rank, size, results, *args)
    dist.barrier()
    dist.destroy_process_group()


def run_group(worker: Callable, size: int, n_results: int, *args) -> Iterator[dict]:
    """Start `worker(rank, size, results_queue, *args)` on `size` processes; yield `n_results`
    items from the queue as they come; exit if a worker failed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_entry, args=(r, size, port, worker, args, results)) for r in range(size)
    ]
    for p in procs:
        p.start()
    for _ in range(n_results):
        yield results.get()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a worker of the {size}-process group failed")
