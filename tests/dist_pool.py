"""Pools of worker processes that share one gloo process group each for the whole test session.

Starting processes and process groups costs seconds on 2 cores, so the distributed tests send
their checks (module-level functions of tests/dist_checks.py) to long-lived groups:
`pool.run("parity", cp=2)` runs `dist_checks.parity(cp=2)` on every rank of a group and returns
the per-rank results. `DistPools` (the tests' `pool` fixture) keeps one `DistPool` per world
size, started on first use, and runs each check on exactly as many processes as its mesh has
ranks (dp_replicate x dp_shard x cp x tp, from the call and the check's defaults): a cp = 2
check on 4 processes would run as two identical copies fighting for the 2 cores. `defaults`
gives a check keyword arguments that every call of it gets unless the call passes them itself
(conftest.py's --compile-backend sets the parity check's `compile_backend` this way). A check
that fails on any rank raises here with that rank's traceback, and its pool is restarted so a
half-finished collective cannot poison the next check.

`spawn_group` and `init_gloo` are the one way this repository starts a local gloo group: the
pool uses them, and so does benchmarks/_group.py (its one-shot groups).

The pools' workers are forked from a multiprocessing fork server that has imported the checks
(and with them torch, titan_vlm, torch._dynamo) once (`PRELOAD`): a spawned worker spent about
5 s of a core importing them, paid again by every process of every pool started, restarted after
a failing check, or closed to free memory (27 pool starts a session). The server runs nothing
else (one thread, no process group), so what each worker inherits is fork-safe. It is started
with this process's sys.path (`preloaded_context`), so it loads the same titan_vlm and checks as
the test process does.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import inspect
import math
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

CHECKS_MODULE = "dist_checks"
RELEASE_ABOVE_BYTES = 2**30  # a pool process's resident memory that `_release_memory` trims
# the pools' resident memory in all above which DistPools closes the idle ones (`_make_room`):
# compiled graphs and allocator caches grow over a session (14 processes held 9.6 GiB after six
# test files), memory the torchrun tests and the CI machine need too. (It was not what made
# those tests slow in the suite: idle workers' threads were, which DistPool.run stops.)
POOLS_MEMORY_BYTES = 6 * 2**30
# the threads of a pool's process above which DistPools replaces the pool (`_recycle`). Each
# gloo process group a check makes (a mesh's dims and flattened dims, a dozen a new layout;
# cached, so they are never freed) keeps 3 threads, one of which, gloo's tcp loop, wakes every
# 10 ms: idle, 100 groups cost a process 9% of a core and 300 groups 24% (2 ranks, 5 s idle,
# 2026-12-06), and by the middle of the suite a 4-rank pool's ranks held 80 to 300 groups each,
# so every check ran 2 to 2.5 times slower than in a fresh pool. A new pool (forked from the
# fork server, the world group only) costs about a second, and recompiles what it compiles.
POOL_THREADS_LIMIT = 120
CLOSE_GRACE_S = 3.0  # how long the session's end waits for the workers to leave their groups
MESH_DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the checks' mesh keywords
# what the pools' fork server imports once for every worker it forks (module docstring): the
# checks, what their first optimizer imports (torch._dynamo) and their first aot_eager compile
PRELOAD = (CHECKS_MODULE, "torch._dynamo", "torch._inductor.pattern_matcher")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, threads: int, timeout_s: float | None) -> None:
    """In a process of a spawned group: the rendezvous on 127.0.0.1:`port`, `threads` intra-op
    threads, and the gloo process group (`timeout_s` None: torch's default timeout)."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(threads)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)


def spawn_group(
    target: Callable[..., None],
    world: int,
    *args: Any,
    daemon: bool = True,
    ctx: BaseContext | None = None,
) -> list[BaseProcess]:
    """Start `world` processes running `target(rank, world, port, *args)` (the port is a free one
    for init_gloo's rendezvous); returns them started. `ctx`: the multiprocessing context that
    starts them (spawned by default; the pools' fork server, `preloaded_context`), the one any
    queue in `args` comes from. `daemon=False` for processes that run a trainer, which forks its
    loader workers (data.num_workers; a daemonic process may not): the caller then joins them
    (DistPools.close, also at exit)."""
    ctx = ctx or mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=target, args=(r, world, port, *args), daemon=daemon)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def preloaded_context() -> BaseContext:
    """The multiprocessing context of the pools' workers: forked from this process's fork server
    (one a process), started here if it is not running, having imported PRELOAD. Python 3.11
    starts the server as `python -c ...` and drops the sys.path it is sent: it gets this
    process's path through PYTHONPATH (only while it starts), or it would import titan_vlm from
    wherever the working directory or the installed package points, and not find the checks."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def _worker(rank: int, world: int, port: int, tasks: list[Queue], results: Queue) -> None:
    import torch.distributed as dist

    init_gloo(rank, world, port, threads=1, timeout_s=120)
    checks = importlib.import_module(CHECKS_MODULE)
    while True:
        task = tasks[rank].get()
        if task is None:
            break
        name, kwargs = task
        try:
            results.put((rank, True, getattr(checks, name)(**kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the test process
            results.put((rank, False, traceback.format_exc()))
        _release_memory()
    dist.destroy_process_group()


def threads(proc: BaseProcess) -> int:
    """The threads of process `proc` (0 where it is gone)."""
    try:
        return len(os.listdir(f"/proc/{proc.pid}/task"))
    except OSError:
        return 0


def resident_bytes(pid: int) -> int:
    """Resident memory of process `pid` (0 where it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _release_memory() -> None:
    """Between checks, once this process holds more than RELEASE_ABOVE_BYTES: free what the last
    checks left and hand the freed heap back to the OS (the pools' 8 idle processes otherwise
    held over 5 GiB after two test files, memory the machine's reclaim then takes from every
    later test). Below it nothing is done: a trim costs the next check its page faults.
    Compiled graphs stay: later checks reuse them."""
    if resident_bytes(os.getpid()) > RELEASE_ABOVE_BYTES:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class DistPool:
    def __init__(
        self,
        world_size: int,
        timeout_s: float = 300,
        defaults: dict[str, dict[str, Any]] | None = None,
    ):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.defaults = defaults or {}
        self.procs: list[BaseProcess] = []
        self._start()

    def _start(self) -> None:
        self.asked = False  # ask_to_stop has been sent
        ctx = preloaded_context()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        self.results = ctx.Queue()
        self.procs = spawn_group(
            _worker, self.world_size, self.tasks, self.results, daemon=False, ctx=ctx
        )

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to every worker still there."""
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, sig)

    def run(self, check: str, **kwargs: Any) -> list[Any]:
        """Run `dist_checks.<check>(**kwargs)` on every rank; results in rank order. Between
        runs the workers are stopped (SIGSTOP): every gloo group a check makes keeps a TCP loop
        thread that wakes on its own, and idle pools grew to over 500 of them a process, which
        took a core of the 2 from every later test."""
        self.signal(signal.SIGCONT)
        procs = self.procs
        try:
            return self._run(check, **kwargs)
        finally:
            if self.procs is procs:  # not a pool restarted after a failure, still starting
                self.signal(signal.SIGSTOP)

    def _run(self, check: str, **kwargs: Any) -> list[Any]:
        kwargs = {**self.defaults.get(check, {}), **kwargs}
        for q in self.tasks:
            q.put((check, kwargs))
        out: dict[int, Any] = {}
        errors = []
        try:
            while len(out) + len(errors) < self.world_size:
                rank, ok, value = self.results.get(timeout=self.timeout_s)
                if ok:
                    out[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
        except queue.Empty:
            errors.append(
                f"timed out after {self.timeout_s}s waiting for ranks "
                f"{set(range(self.world_size)) - set(out)}"
            )
        if errors:
            self.restart()
            raise RuntimeError(f"check {check!r} failed:\n" + "\n".join(errors[:2]))
        return [out[r] for r in range(self.world_size)]

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def ask_to_stop(self) -> None:
        """Tell every worker to leave its process group and exit (`close` waits for them)."""
        self.signal(signal.SIGCONT)
        if not self.asked:
            for q in self.tasks:
                q.put(None)
            self.asked = True

    def close(self, graceful: bool = True) -> None:
        if graceful:
            self.ask_to_stop()
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []


class DistPools:
    """One DistPool per world size, started on first use; `run` sends a check to the pool whose
    world is the check's mesh (module docstring)."""

    def __init__(self, timeout_s: float = 300, defaults: dict[str, dict[str, Any]] | None = None):
        self.timeout_s = timeout_s
        self.defaults = defaults or {}
        self.pools: dict[int, DistPool] = {}
        # the workers are not daemonic: an exit that skips the fixture's close still stops them
        # (this runs before multiprocessing's own exit handler joins them)
        atexit.register(self.close)

    def world_of(self, check: str, kwargs: dict[str, Any]) -> int:
        """dp_replicate x dp_shard x cp x tp of the call, the check's defaults filling in."""
        fn = getattr(importlib.import_module(CHECKS_MODULE), check)
        call = inspect.signature(fn).bind_partial(**{**self.defaults.get(check, {}), **kwargs})
        call.apply_defaults()
        return math.prod(int(call.arguments.get(k, 1)) for k in MESH_DEGREES)

    def run(self, check: str, **kwargs: Any) -> list[Any]:
        """Run `dist_checks.<check>(**kwargs)` on every rank of its mesh; results in rank order."""
        world = self.world_of(check, kwargs)
        self._make_room(world)
        if world not in self.pools:
            self.pools[world] = DistPool(world, self.timeout_s, self.defaults)
        try:
            return self.pools[world].run(check, **kwargs)
        finally:
            self._recycle(world)

    def _recycle(self, world: int) -> None:
        """The pool of `world` closed (killed: nothing of it is needed) once a process of it holds
        more than POOL_THREADS_LIMIT threads; the next check of that world starts a new one."""
        pool = self.pools.get(world)
        if pool is not None and max(map(threads, pool.procs), default=0) > POOL_THREADS_LIMIT:
            self.pools.pop(world).close(graceful=False)

    def memory(self) -> int:
        return sum(
            resident_bytes(p.pid) for pool in self.pools.values() for p in pool.procs if p.pid
        )

    def _make_room(self, world: int) -> None:
        """Above POOLS_MEMORY_BYTES in all, close the pools other than `world`'s, then, if still
        above, that one too: each starts again (a few seconds) when a check next needs it."""
        if self.memory() <= POOLS_MEMORY_BYTES:
            return
        self._close([w for w in self.pools if w != world])
        if self.memory() > POOLS_MEMORY_BYTES:
            self._close([world] if world in self.pools else [])

    def close(self) -> None:
        """Every pool closed (`_close`)."""
        self._close(list(self.pools))

    def _close(self, worlds: list[int]) -> None:
        """The pools of `worlds`' workers told to stop at once, then joined: they shut down side
        by side, for at most `CLOSE_GRACE_S` in all (a worker still leaving its group then is
        killed, which costs nothing but its own cleanup)."""
        pools = [self.pools.pop(w) for w in worlds]
        for p in pools:
            p.ask_to_stop()
        deadline = time.monotonic() + CLOSE_GRACE_S
        for p in pools:
            for proc in p.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            p.close(graceful=False)
