"""Work split over child processes forked from this one (data/jsonl.py's window passes, over a
rank and its data.num_workers): child j computes `fn(j)` on what this process held when it
forked (the dataset's spans, tokenizer and processor: nothing is pickled on the way in), and
sends back its result (pickled), which `results` yields in order.

    this process:  forks 1 .. n-1 ── does its own share ── results(): 1, 2, ... in order
    child j:       fn(j) ── its result through a pipe ── exits

Invariants: a child never outlives this process (SIGKILL when it dies:
process_tree.killed_with_parent) and never runs this process's exit handlers (it leaves with
os._exit); a child that dies (killed, out of memory) or raises is one line (LoaderWorkerDied),
never a hang (its end of the pipe closes with it); leaving the `with` block kills the children
still running (an error in this process's own share, or a result that is not needed).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from titan_vlm.process_tree import killed_with_parent

R = TypeVar("R")


def death(exitcode: int | None) -> str:
    """What a child's exit code says, for the one line."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:  # a real-time signal: no name
            name = f"signal {-exitcode}"
        if -exitcode == signal.SIGBUS:  # torch's shared memory (/dev/shm) ran out
            return (
                f"died of {name} (its shared memory ran out: /dev/shm is full; a container "
                "needs a larger one, e.g. docker run --shm-size=16g, or lower data.prefetch)"
            )
        return f"died of {name} (out of host memory, or killed)"
    return f"exited with code {exitcode}"


def spare_cores() -> int:
    """The cores this process may keep busy beyond its own: those it may run on, shared by the
    ranks of its node (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun), less its own. More
    processes than cores only slow a CPU-bound pass down."""
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    return max(len(os.sched_getaffinity(0)) // local - 1, 0)


class LoaderWorkerDied(RuntimeError):
    """A loader worker died (killed, out of host or shared memory) or failed, building batches
    (data/loader.py) or its share of a window's pass (data/jsonl.py): a failure of the run,
    not of its config or data, so the rank exits 1 after one line (train.py) and torchrun
    restarts the job (job.max_restarts), which resumes from its latest checkpoint."""


class _Raised:
    """What a child sends for an exception its `fn` raised: its one line."""

    def __init__(self, line: str):
        self.line = line


def _child(fn: Callable[[int], Any], j: int, out: int) -> None:
    """Child j's life: fn(j), its result pickled down the pipe `out`, os._exit."""
    try:
        killed_with_parent()
        result: Any = fn(j)
    except BaseException as e:  # noqa: BLE001 - sent as one line; this process must not hang
        result = _Raised(f"{type(e).__name__}: {e}".splitlines()[0])
    try:
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as e:  # noqa: BLE001 - a result that does not pickle
        data = pickle.dumps(_Raised(f"its result cannot be sent: {type(e).__name__}: {e}"))
    try:
        with os.fdopen(out, "wb") as pipe:
            pipe.write(data)
    finally:
        os._exit(0)


class Forked(Generic[R]):
    """Children 1 .. n-1 of `n` shares, child j computing `fn(j)` (share 0 is the caller's own,
    done while they run); `what` names the work in the one line of a failure. Plain os.fork
    (not multiprocessing's Process, which a daemonic process may not start): a child is reaped
    here and nowhere else."""

    def __init__(self, fn: Callable[[int], R], n: int, what: str):
        self.what = what
        self.children: list[tuple[int, int]] = []  # (pid, the pipe's end this process reads)
        try:
            for j in range(1, n):
                ours, theirs = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child: never returns, whatever is raised in it
                    try:
                        os.close(ours)
                        _child(fn, j, theirs)
                    finally:
                        os._exit(1)
                os.close(theirs)  # only the child writes: its exit closes the pipe (EOF here)
                self.children.append((pid, ours))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Forked[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def results(self) -> Iterator[R]:
        """Each child's result, in order (a child not read when the caller stops is killed on
        leaving the `with` block); LoaderWorkerDied (one line) for the first that died or
        raised."""
        for j, (pid, ours) in enumerate(self.children, start=1):
            with os.fdopen(os.dup(ours), "rb") as pipe:
                data = pipe.read()  # to EOF: the child's exit
            exitcode = self._reap(j)
            try:
                got = pickle.loads(data)
            except Exception:  # noqa: BLE001 - nothing, or half a result: it died writing
                raise LoaderWorkerDied(
                    f"{self.what}: worker {j} (pid {pid}) {death(exitcode)}"
                ) from None
            if isinstance(got, _Raised):
                raise LoaderWorkerDied(f"{self.what}: worker {j} (pid {pid}): {got.line}")
            yield got

    def _reap(self, j: int) -> int | None:
        """Wait for child j; its exit code as multiprocessing gives it (-signal if killed)."""
        pid, ours = self.children[j - 1]
        if pid < 0:
            return None
        _, status = os.waitpid(pid, 0)
        self.children[j - 1] = (-pid, ours)  # reaped
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        """Kill the children still running, reap them and close the pipes."""
        for j, (pid, ours) in enumerate(self.children, start=1):
            if pid > 0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._reap(j)
            os.close(ours)
        self.children = []
