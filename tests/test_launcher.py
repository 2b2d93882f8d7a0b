"""What ./run_train.sh does when things go wrong around the job: a second job on the same dump
folder, a killed launcher, SIGINT, and a problem the user can fix found inside the workers (one
line, from one process, no torchrun traceback)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrun_kill import ROOT, descendants, logged_steps, run, start, stop

from titan_vlm.checkpoint import verify_step_dir
from titan_vlm.launch import alive, lock_dump_folder

# torch's own deprecation notice, printed by every rank at its first all_gather_into_tensor
TORCH_NOTICE = ("FutureWarning: `torch.distributed.all_gather_into_tensor`", "return func(")


def stderr_lines(err: str) -> list[str]:
    """stderr without torch's deprecation notice."""
    return [x for x in err.splitlines() if x.strip() and not any(n in x for n in TORCH_NOTICE)]


def wait_for_step(proc, dump: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while max(logged_steps(dump), default=0) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the job did not reach step {step}"
        time.sleep(0.1)


def test_one_job_per_dump_folder_and_nothing_outlives_a_killed_launcher_nor_its_lock(tmp_path):
    """A second job on a busy dump folder is refused; a killed launcher takes torchrun, its
    workers and their loader workers with it, and its stale lock is taken over; a job that ended
    leaves no lock."""
    first = start(tmp_path, 200)
    try:
        wait_for_step(first, tmp_path, 1)
        rc, out, err = run(tmp_path, 2)  # the same command again, while the first one trains
        since = json.loads((tmp_path / "job.lock").read_text())["started"]
        assert rc == 2 and stderr_lines(err) == [
            f"error: job.dump_folder {tmp_path} is in use by another job (pid {first.pid} on "
            f"{os.uname().nodename} since {since}"
            f": python -m titan_vlm.launch --config train_configs/vlm_cp.toml "
            + " ".join(first.args[3:])
            + "); wait for it to end, or use another job.dump_folder"
        ], err
        # torchrun, its 2 workers and their loader workers (data.num_workers = 2 each)
        job = descendants(first.pid)
        assert len(job) == 3 + 2 * 2
        os.kill(first.pid, signal.SIGKILL)  # the launcher dies
        deadline = time.monotonic() + 30
        while any(alive(p) for p in job) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in job), "torchrun or a worker outlived the launcher"
    finally:
        stop(first)
    rc, out, err = run(tmp_path, 2)  # the dead job's lock is stale: taken over
    assert rc == 0, err[-3000:]
    assert f"took over {tmp_path / 'job.lock'} from a job that is gone (pid {first.pid}" in out
    assert (tmp_path / "job.lock").read_text() == ""  # the job ended: its lock is released
    # so the next job takes no lock over (the launcher's own locking, in this process)
    fd, note = lock_dump_folder(tmp_path)
    os.close(fd)
    assert note is None


def test_sigint_stops_at_a_step_boundary_with_a_checkpoint(tmp_path):
    job = start(tmp_path, 200)
    try:
        wait_for_step(job, tmp_path, 2)
        os.killpg(job.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the launcher's group
        out, err = job.communicate(timeout=120)
    finally:
        stop(job)
    assert job.returncode == 130 and stderr_lines(err) == [], err
    steps = logged_steps(tmp_path)
    last = max(steps)
    assert sorted(steps) == list(range(1, last + 1)) and last < 200
    assert f"stopped after step {last} on a signal" in out
    assert verify_step_dir(tmp_path / "checkpoint" / f"step-{last}") is None


# A worker (TORCHELASTIC_RUN_ID set: the parent watch and the signal handler are on) in one
# process, run as `python -m titan_vlm.train` runs it (its exit_without_teardown included); at
# exit (atexit: after threading's shutdown) it writes the Python threads still alive.
WORKER_AT_EXIT = """
import atexit, runpy, sys, threading
from pathlib import Path
atexit.register(lambda out=sys.argv[1]: Path(out).write_text(
    " ".join(sorted(t.name for t in threading.enumerate()))))
sys.argv = [sys.argv[0], *sys.argv[2:]]
runpy.run_module("titan_vlm.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("ending", ["trained", "trained with async checkpoints", "user error"])
def test_a_worker_exits_with_only_its_main_thread(tmp_path, ending):
    """A Python thread still running when the interpreter finalizes can abort a worker: the
    die-with-parent watch, if it is freeing a process group then (a full garbage collection
    in that thread; torch frees a group with the GIL released), cannot take the GIL back and
    is ended by pthread_exit inside a noexcept destructor: 'terminate called without an active
    exception', SIGABRT (test_sigint_stops_at_a_step_boundary_with_a_checkpoint on a loaded
    machine; the trainer and its Checkpointer, which holds the world group, are a reference
    cycle). train.py frees the groups in the main thread and joins the watch first. (Forcing
    a collection in the watch after destroy_process_group aborted 2 of 14 such workers before,
    none of 18 after.)"""
    extra = {
        "trained": [],
        "trained with async checkpoints": ["--checkpoint.async_mode=async"],  # DCP's writer thread
        "user error": [f"--data.dataset={tmp_path / 'missing.jsonl'}"],
    }[ending]
    done = subprocess.run(
        [sys.executable, "-c", WORKER_AT_EXIT, str(tmp_path / "threads")]
        + ["--config", "train_configs/vlm_cp.toml", "--parallelism.context_parallel_degree=1"]
        + ["--training.steps=1", "--metrics.enable_tensorboard=false", "--checkpoint.enable"]
        + [f"--job.dump_folder={tmp_path}", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCHELASTIC_RUN_ID": "test", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == (2 if ending == "user error" else 0), done.stderr[-3000:]
    assert (tmp_path / "threads").read_text() == "MainThread"


def test_a_user_error_inside_the_workers_is_one_line(tmp_path):
    """A .json dataset that does not parse is found by the workers (they read the file); with
    job.max_restarts=1 torchrun must not restart them for it either."""
    data = tmp_path / "broken.json"
    data.write_text('[{"text": "fine"},\n {"text": ')
    rc, out, err = run(
        tmp_path, 2, f"--data.dataset={data}", "--job.max_restarts=1", "--data.packing=false"
    )
    assert rc == 2 and stderr_lines(err) == [
        f"config error: data.dataset: {data}:2: invalid JSON: Expecting value (a .json file must "
        "be one JSON array of records; a .jsonl file holds one record per line)"
    ], err
    assert out.count("mesh: ") == 1  # not restarted


def test_a_dump_folder_that_cannot_be_written_is_one_line_before_torchrun(tmp_path):
    (tmp_path / "a_file").write_text("")
    dump = tmp_path / "a_file" / "out"
    rc, out, err = run(dump, 2)
    assert rc == 2 and stderr_lines(err) == [
        f"error: job.dump_folder {dump}: cannot write there (Not a directory)"
    ], err
    assert out == ""  # torchrun never started
