"""The [profiling] keys: torch.profiler traces and CUDA memory snapshots of chosen steps.

    with StepProfiler(cfg.profiling, dump_folder, rank, device, first_step=resumed) as prof:
        for step in ...:
            train ...
            prof.step(step)         after each step: saves what is due at `step`

Every profile_freq-th step (step % profile_freq == 0) is traced, its validation and checkpoint
included: torch.profiler records it, after up to 3 warm-up steps it sees but does not keep, and
each rank writes
<dump>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json (Chrome trace format: Perfetto,
chrome://tracing). The schedule is a function of the global step, so a resumed run traces the
same steps as an uninterrupted one. A memory snapshot (CUDA only) records the allocator's history
from the start and dumps it at the same steps:
<dump>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from titan_vlm.config import Profiling

logger = logging.getLogger("titan_vlm")

WARMUP_STEPS = 3  # at most; fewer when profile_freq leaves no room
# Each trace is one step on purpose: torch says every cycle starts afresh (acc_events=False).
warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each")
MEMORY_HISTORY_ENTRIES = 100_000  # allocator events a snapshot keeps (torchtitan's figure)


def action_at(step: int, freq: int) -> ProfilerAction:
    """What the profiler does during training step `step` (1-based): trace and save the steps that
    are multiples of `freq`, warm up on the ones just before."""
    warmup = min(WARMUP_STEPS, freq - 1)
    position = step % freq
    if position == 0:
        return ProfilerAction.RECORD_AND_SAVE
    if position >= freq - warmup:
        return ProfilerAction.WARMUP
    return ProfilerAction.NONE


class StepProfiler:
    """Profiles the steps the [profiling] keys ask for (none when both switches are off)."""

    def __init__(
        self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device, first_step: int
    ):
        """first_step: the step the run resumed after (0: a fresh run); the next step is
        first_step + 1."""
        self.cfg, self.rank, self.device = cfg, rank, device
        self.traces = Path(dump_folder) / cfg.save_traces_folder
        self.snapshots = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self.step_now = first_step
        self.closing = False  # the run is over: a window still recording is not a trace
        self.memory = cfg.enable_memory_snapshot and device.type == "cuda"
        self.torch_profiler: torch.profiler.profile | None = None
        if cfg.enable_profiling:
            activities = [ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.torch_profiler = torch.profiler.profile(
                activities=activities,
                # the profiler counts its own steps from 0 = the first one this run trains
                schedule=lambda n: action_at(first_step + 1 + n, cfg.profile_freq),
                on_trace_ready=self._save_trace,
                record_shapes=True,
            )
        if rank == 0:
            if cfg.enable_profiling:
                logger.info(
                    "profiling: a torch.profiler trace of every step that is a multiple of %d "
                    "-> %s/iteration_<step>/",
                    cfg.profile_freq,
                    self.traces,
                )
            if cfg.enable_memory_snapshot and not self.memory:
                logger.info(
                    "profiling.enable_memory_snapshot: CUDA memory snapshots; this run is on %s, "
                    "so none is recorded",
                    device.type,
                )
            elif self.memory:
                logger.info(
                    "profiling: a CUDA memory snapshot at every step that is a multiple of %d "
                    "-> %s/iteration_<step>/",
                    cfg.profile_freq,
                    self.snapshots,
                )

    def __enter__(self) -> StepProfiler:
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        if self.torch_profiler is not None:
            self.torch_profiler.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.torch_profiler is not None:
            self.closing = True
            self.torch_profiler.__exit__(kind, error, tb)
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None)

    def step(self, step: int) -> None:
        """Training step `step` is done: save its trace and snapshot if they are due."""
        self.step_now = step
        if self.torch_profiler is not None:
            self.torch_profiler.step()  # calls _save_trace after a RECORD_AND_SAVE step
        if self.memory and step % self.cfg.profile_freq == 0:
            path = self.snapshots / f"iteration_{step}" / f"rank{self.rank}_memory_snapshot.pickle"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            if self.rank == 0:
                logger.info("profiling: memory snapshot of step %d -> %s", step, path)

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        """on_trace_ready: after a RECORD_AND_SAVE step, and (torch's) when the profiler stops
        while recording: the run ended before the step it was warming up for, no trace."""
        if self.closing or self.step_now % self.cfg.profile_freq:
            return
        path = self.traces / f"iteration_{self.step_now}" / f"rank{self.rank}_trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        if self.rank == 0:
            logger.info("profiling: trace of step %d -> %s", self.step_now, path)
