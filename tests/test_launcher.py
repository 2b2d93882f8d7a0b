"""What ./run_train.sh does when things go wrong around the job: a second job on the same dump
folder, a killed launcher, SIGINT, and a problem the user can fix found inside the workers (one
line, from one process, no torchrun traceback)."""

import json
import os
import signal
import time
from pathlib import Path

from torchrun_kill import descendants, logged_steps, run, start, stop

from titan_vlm.checkpoint import verify_step_dir
from titan_vlm.launch import alive

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
    """A second job on a busy dump folder is refused; a killed launcher takes torchrun and its
    workers with it, and its stale lock is taken over; a job that ended leaves no lock."""
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
        job = descendants(first.pid)  # torchrun and its 2 workers
        assert len(job) == 3
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
    rc, out, err = run(tmp_path, 3)  # so the next job (one more step) takes no lock over
    assert rc == 0 and "took over" not in out, err[-3000:]


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
