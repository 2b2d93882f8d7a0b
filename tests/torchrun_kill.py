"""Kill one worker of a real ./run_train.sh job (torchrun) and let torchrun restart it.

Used by tests/test_restart.py (one trial) and benchmarks/restart_trials.py (many trials, to show
the restart is not flaky). torchrun starts each worker in its own session, so a worker is found
below the launcher (the process run_train.sh execs; torchrun is its child), by its LOCAL_RANK.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from titan_vlm.launch import children

ROOT = Path(__file__).resolve().parents[1]

# A few steps of the debug model at cp=2, checkpoints every 3 steps; seconds a step on 2 cores.
SMALL = (
    "--training.seq_len=128",
    "--training.local_batch_size=2",
    "--training.warmup_steps=2",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable",
    "--checkpoint.interval=3",
)


def start(dump: Path, steps: int, *extra: str) -> subprocess.Popen:
    """./run_train.sh on the default config, small; in its own session so cleanup can kill it."""
    return subprocess.Popen(
        [
            "./run_train.sh",
            "--config",
            "train_configs/vlm_cp.toml",
            *SMALL,
            f"--training.steps={steps}",
            f"--job.dump_folder={dump}",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the launcher: torchrun, then its workers)."""
    out = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def worker_of(launcher: int, local_rank: int) -> int | None:
    """The pid of the job's worker with that LOCAL_RANK, or None if there is none (yet)."""
    for pid in descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env:
            return pid
    return None


def logged_steps(dump: Path) -> dict[int, float]:
    """step -> loss of the complete lines of <dump>/metrics.jsonl."""
    path = dump / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n"):
            record = json.loads(line)
            out[record["step"]] = record["loss"]
    return out


def run(dump: Path, steps: int, *extra: str, timeout: float = 300) -> tuple[int, str, str]:
    """An uninterrupted job: (exit code, stdout, stderr)."""
    proc = start(dump, steps, *extra)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return proc.returncode, out, err


def kill_worker_and_resume(
    dump: Path, steps: int, kill_after: int, local_rank: int = 1, timeout: float = 300
) -> tuple[int, str, str]:
    """Start a job with job.max_restarts=1; once metrics.jsonl shows step `kill_after`, SIGKILL
    the worker of `local_rank`; wait for torchrun to restart and finish. Returns (exit code,
    stdout, stderr)."""
    return kill_worker_when(
        dump,
        steps,
        lambda: max(logged_steps(dump), default=0) >= kill_after,
        f"step {kill_after}",
        local_rank=local_rank,
        timeout=timeout,
    )


def loader_worker_of(launcher: int, local_rank: int) -> int | None:
    """The pid of a loader worker (data.num_workers: a process the rank forked) of the job's
    worker with that LOCAL_RANK, or None if it has none (yet)."""
    rank = worker_of(launcher, local_rank)
    workers = children(rank) if rank is not None else []
    return workers[0] if workers else None


def kill_worker_when(
    dump: Path,
    steps: int,
    ready: Callable[[], bool],
    what: str,
    *extra: str,
    local_rank: int = 1,
    timeout: float = 300,
    victim: Callable[[int, int], int | None] = worker_of,
) -> tuple[int, str, str]:
    """Start a job with job.max_restarts=1 (and `extra` arguments); as soon as `ready()` (polled
    every 10 ms; `what` names it in errors), SIGKILL `victim(launcher pid, local_rank)` (the
    worker of `local_rank`, or one of its loader workers: loader_worker_of); wait for torchrun
    to restart and finish. Returns (exit code, stdout, stderr)."""
    proc = start(dump, steps, "--job.max_restarts=1", *extra)
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                out, err = proc.communicate()
                raise RuntimeError(f"job ended before {what}: {err[-2000:]}")
            time.sleep(0.01)
        pid = victim(proc.pid, local_rank)
        if pid is None:
            raise RuntimeError(f"no {victim.__name__}({proc.pid}, LOCAL_RANK={local_rank})")
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        stop(proc)
    return proc.returncode, out, err


def stop(proc: subprocess.Popen) -> None:
    """Kill what is left of a job: the launcher's session, and torchrun's and its workers'."""
    if proc.poll() is None:
        for pid in descendants(proc.pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
