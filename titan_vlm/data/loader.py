"""Batches built ahead of the step by loader worker processes (data.num_workers, data.prefetch).

    training process:  step s trains ........ step s+1 trains ........ step s+2 trains ....
    worker 0:          builds s+2 ........... builds s+4 ............
    worker 1:          builds s+3 ........... builds s+5 ............
                       (each worker keeps data.prefetch batches ready; step k's batch is built
                        by worker (k - first) mod num_workers)

The training process makes each step's rows readable (`Dataset.ensure`: a dataset file indexes
the windows that hold them, every rank at the same step) and says what reading them takes
(`Dataset.plan`: a dataset file's samples and where they lie); a worker builds the batch from
that plan (`Dataset.collated`), as the training process does itself with num_workers = 0, and a
batch is a pure function of its step (data/dataset.py). So:

Invariants: workers change when a batch is built, never what it holds (losses are bit-identical
at any data.num_workers); the loader has no position of its own beyond the step, so a run
resumed at step s (at the same or another number of workers, dp or cp layout) builds the same
batches from step s on; what building a batch reports (each bad sample's warning, the sample
numbers it dropped) travels back with the batch and is reported by the training process exactly
as it is with num_workers = 0 (a line warned about once per process, the same counts); a
DataError in a worker (data.on_bad_sample = "error") is raised in the training process, the same
line; a worker that dies (killed, out of host or shared memory) stops the rank at its next batch
with one line (LoaderWorkerDied, exit 1: torchrun restarts the job under job.max_restarts),
not a hang: one that dies while the rank waits for a batch is raised in that wait (so a message
it was sending cannot block it), one that dies between batches at the next batch, and `close`
then kills the others rather than wait for torch's pin thread (on CUDA), which such a message
can leave blocked.

Workers are forked from the training process when the loop starts (`start`): they read the dataset
the trainer built (its files, tokenizer and processor) without pickling it, get each step's plan
pickled, and touch no accelerator. Each runs in a process group of its own (torchrun signals a
rank's whole group; the rank stops at a step boundary and closes its workers) and is killed with
its rank (process_tree.killed_with_parent). On CUDA, batches are copied into pinned host memory by
the loader's pin thread, then to the device without blocking.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.data

from titan_vlm.data.bad_samples import Report
from titan_vlm.data.dataset import batch_rows, step_rows
from titan_vlm.data.forked import LoaderWorkerDied, death
from titan_vlm.errors import UserError
from titan_vlm.process_tree import killed_with_parent

if TYPE_CHECKING:
    from collections.abc import Iterator

    from titan_vlm.data.batch import Batch
    from titan_vlm.data.dataset import Dataset


@dataclass
class Built:
    """One batch as a worker built it, with what building it reported: the bad samples'
    warnings to log (BadSampleLog.report's arguments) and the sample numbers it dropped; or the
    UserError that building it raised (`error`)."""

    batch: Batch | None
    dropped: frozenset[int] = frozenset()
    reports: tuple[Report, ...] = ()
    error: UserError | None = None

    def pin_memory(self) -> Built:
        """The batch in pinned host memory (torch's DataLoader calls this in its pin thread)."""
        if self.batch is None:
            return self
        return Built(self.batch.pin_memory(), self.dropped, self.reports, self.error)


class _StepBatches(torch.utils.data.Dataset):
    """A step's batch from its plan (Dataset.plan) as the item of that plan: what a worker
    builds."""

    def __init__(self, data: Dataset):
        self.data = data

    def __getitem__(self, plan: Any) -> Built:
        data = self.data
        before = len(data.dropped)
        seen = set(data.dropped) if before else set()
        recording: AbstractContextManager[list[Report]] = (
            data.bad.recorded() if data.bad is not None else nullcontext([])
        )
        with recording as reports:
            try:
                batch = data.collated(plan)
            except UserError as e:  # raised again in the training process: one line, as there
                return Built(None, reports=tuple(reports), error=e)
        dropped = frozenset(data.dropped) - seen if len(data.dropped) != before else frozenset()
        return Built(batch, dropped, tuple(reports))

    def __len__(self) -> int:  # the sampler says which steps; this is only DataLoader's question
        raise TypeError("_StepBatches has no length: the sampler names the steps")


class _Plans:
    """The plans of dp rank `dp_rank`'s batches of `rows` rows at steps `steps`, each made when
    the DataLoader asks for it (in the training process: num_workers x prefetch steps ahead of
    the step being trained, whose rows BatchLoader.batch made readable)."""

    def __init__(self, data: Dataset, dp_rank: int, dp_size: int, rows: int, steps: range):
        self.data, self.dp_rank, self.dp_size, self.rows = data, dp_rank, dp_size, rows
        self.steps = steps

    def __iter__(self) -> Iterator[Any]:
        for step in self.steps:
            yield self.data.plan(batch_rows(step, self.dp_rank, self.dp_size, self.rows))


def _start_worker(worker_id: int) -> None:
    """In each worker, before its first batch: a process group of its own (torchrun signals a
    rank's whole group; the rank stops at a step boundary and closes its workers itself), and
    SIGKILL when the rank dies."""
    del worker_id
    os.setpgid(0, 0)
    killed_with_parent()


def _one(built: Any) -> Any:  # typed as DataLoader's collate_fn (a list when it batches)
    return built  # one Built per step: no collation


class BatchLoader:
    """Dp rank `dp_rank`'s batches of `rows` rows, step by step: `batch(k)` is step k's (the
    0-based step, as Dataset.batch numbers them), on `device`. num_workers = 0: built in this
    process when asked for (as the trainer always did); else by `num_workers` processes,
    `prefetch` batches each ahead, for consecutive steps from `start(first)` (or the first
    asked for) up to `last` (exclusive).

    A dead worker is reported where the rank asks for a batch, a step boundary: the loader's
    SIGCHLD handler replaces the one torch's DataLoader installs, which raises anywhere in the
    step (inside a checkpoint's save, where it would read as a disk error, say)."""

    def __init__(
        self,
        data: Dataset,
        dp_rank: int,
        dp_size: int,
        rows: int,
        num_workers: int,
        prefetch: int,
        last: int,
        device: torch.device,
    ):
        self.data, self.dp_rank, self.dp_size, self.rows = data, dp_rank, dp_size, rows
        self.num_workers, self.prefetch, self.last = num_workers, prefetch, last
        self.ahead = num_workers * prefetch  # the steps the workers build ahead of the step
        self.device = device
        self._batches: Iterator[Built] | None = None
        self._next = -1  # the step the workers' next batch is for
        self._outer: Any = None  # the SIGCHLD handler before ours (start)
        self._waiting = False  # the rank waits for a batch
        self._gone: RuntimeError | None = None  # a worker that died between batches

    def start(self, first: int) -> None:
        """Start the workers on steps `first`, `first` + 1, ... (none with num_workers = 0, or
        when `first` is past the last step). Every rank calls it at the same step (the rows the
        workers build first are made readable: Dataset.ensure)."""
        self.close()
        if self.num_workers == 0 or first >= self.last:
            return
        self._readable(first)  # the steps the DataLoader asks plans of at once
        outer = signal.getsignal(signal.SIGCHLD)
        self._batches = iter(self._loader(first))
        if threading.current_thread() is threading.main_thread():
            # in place of the handler torch's DataLoader installs (which raises wherever the
            # rank is, inside a checkpoint's save, say): ours raises only while the rank waits
            self._outer = outer if outer is not None else signal.SIG_DFL
            signal.signal(signal.SIGCHLD, self._on_child)
        self._next = first

    def _on_child(self, signum: int, frame: object) -> None:
        """SIGCHLD: a worker that died is raised here while the rank waits for a batch (so that
        a message it was sending cannot block the wait), else kept for the next batch."""
        try:
            torch._C._error_if_any_worker_fails()  # what torch's own handler asks
        except RuntimeError as e:
            if self._waiting:
                raise
            self._gone = self._gone or e

    def batch(self, step: int) -> tuple[Batch, Batch]:
        """Step `step`'s batch: (on the host, on `device`). Every rank calls it at the same step:
        the rows of this step and of the steps the workers build ahead are made readable
        (Dataset.ensure), with the next step's first row (a checkpoint's position). What
        building it reported is reported here (bad samples logged once, their numbers added to
        data.dropped)."""
        self._readable(step)
        if self.num_workers == 0:
            rows = batch_rows(step, self.dp_rank, self.dp_size, self.rows)
            host = self.data.collated(self.data.plan(rows))
            return host, host.to(self.device)
        built = self._from_workers(step)
        if self.data.bad is not None:
            for report in built.reports:
                self.data.bad.report(*report)
        if built.error is not None:
            raise built.error
        if built.dropped:
            self.data.dropped.update(built.dropped)  # type: ignore[attr-defined]
        assert built.batch is not None
        return built.batch, built.batch.to(self.device, non_blocking=True)

    def _readable(self, step: int) -> None:
        """Rows of `step` and of the steps the workers build ahead (not past the last) readable,
        with the first row after them (a checkpoint's position), and those before it forgotten
        (every rank calls this at the same step: Dataset.ensure)."""
        steps = max(min(1 + self.ahead, self.last - step), 1)
        self.data.ensure(step_rows(step, self.dp_size, self.rows, steps))
        self.data.forget(step_rows(step, self.dp_size, self.rows).start)

    def _from_workers(self, step: int) -> Built:
        if self._batches is None or step != self._next:
            if step >= self.last:
                raise ValueError(f"BatchLoader: step {step} is past the last ({self.last - 1})")
            self.start(step)
        assert self._batches is not None
        self._waiting = True
        try:
            if self._gone is not None:
                raise self._gone
            built = next(self._batches)
        except Exception as e:  # a dead worker, however torch noticed (its pin thread's too)
            self._waiting = False  # a SIGCHLD from here on is kept, not raised in this handler
            died = self._died(settle_s=1.0)
            if died is None:
                raise
            raise died from e
        finally:
            self._waiting = False
        self._next += 1
        return built

    def _died(self, settle_s: float = 0.0) -> LoaderWorkerDied | None:
        """The one line for the workers that have died, if any has. `settle_s`: how long to wait
        for a worker to be seen dead (an error from a dying worker, a connection it reset, can
        come before its exit is)."""
        workers = getattr(self._batches, "_workers", [])  # multiprocessing Processes
        deadline = time.monotonic() + settle_s
        while not (dead := [w for w in workers if w.exitcode is not None]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)
        what = "; ".join(f"pid {w.pid} {death(w.exitcode)}" for w in dead)
        return LoaderWorkerDied(
            f"data.num_workers={self.num_workers}: a loader worker is gone ({what}); "
            "data.num_workers=0 builds the batches in the training process"
        )

    def _loader(self, first: int) -> torch.utils.data.DataLoader:
        steps = range(first, self.last)
        return torch.utils.data.DataLoader(
            _StepBatches(self.data),
            batch_size=None,
            sampler=_Plans(self.data, self.dp_rank, self.dp_size, self.rows, steps),
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch,
            collate_fn=_one,
            pin_memory=self.device.type == "cuda",  # the pin thread pins on the rank's device
            worker_init_fn=_start_worker,
            multiprocessing_context="fork",
        )

    def close(self) -> None:
        """Stop the workers (and the pin thread); a later `start` or `batch` starts them again."""
        if self._batches is not None:
            if self._died() is not None:
                # torch's shutdown joins its pin thread, which a worker killed mid-message can
                # leave blocked: the live workers are killed instead, and the iterator marked
                # shut down (its __del__ would run that shutdown); the rank is on its way out
                for w in getattr(self._batches, "_workers", []):
                    if w.exitcode is None:
                        w.kill()
                torch._C._remove_worker_pids(id(self._batches))  # as torch's shutdown ends
                setattr(self._batches, "_shutdown", True)  # noqa: B010 - torch's private flag
            else:
                shutdown = getattr(self._batches, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()
            self._batches = None
        if self._outer is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCHLD, self._outer)
        self._outer, self._gone = None, None
