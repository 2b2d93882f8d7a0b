"""Processes killed under a real torchrun (./run_train.sh, job.max_restarts=1): a worker while an
async checkpoint is being written (torchrun restarts the job, `latest` still names a checkpoint
that loads, the job resumes from it), and a rank's loader worker (data.num_workers: the rank
stops with one line, torchrun restarts the job); every step's loss equals an uninterrupted run's.
benchmarks/restart_trials.py repeats the kill (synchronous checkpoints) many times."""

import re

import pytest
from torchrun_kill import kill_worker_when, loader_worker_of, logged_steps, run

STEPS = 8


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's step -> loss (the default config, small)."""
    dump = tmp_path_factory.mktemp("whole")
    rc, _, err = run(dump, STEPS)
    assert rc == 0, err[-3000:]
    losses = logged_steps(dump)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_a_kill_during_an_async_save_restarts_from_a_latest_that_loads(tmp_path, whole):
    """checkpoint.async_mode='async', a checkpoint every 3 steps: a worker is killed as soon as
    step 6's save has begun writing (its folder exists; it is committed only at step 7's
    boundary, a whole step later, which the 10 ms poll does not miss); the restarted job passes
    over step-6, resumes from step-3 and matches the uninterrupted synchronous run bit for bit
    (same layout, CPU)."""
    dump = tmp_path / "killed"
    step6 = dump / "checkpoint" / "step-6"
    rc, out, err = kill_worker_when(
        dump, STEPS, step6.is_dir, "step 6's save", "--checkpoint.async_mode=async"
    )
    assert rc == 0, err[-3000:]
    assert "step-6 is unusable: no manifest.json" in out + err, (out + err)[-3000:]
    assert f"resumed from {dump / 'checkpoint' / 'step-3'}" in out, out[-3000:]
    assert logged_steps(dump) == whole  # every step once
    assert (dump / "checkpoint" / "latest").read_text().strip() == str(STEPS)


def test_a_killed_loader_worker_is_one_line_and_the_job_restarts(tmp_path, whole):
    """One of CP rank 1's two loader workers SIGKILLed (as the OOM killer would) once step 4 is
    logged: that rank stops with one line naming data.num_workers, the worker and its signal
    (no traceback from that rank), torchrun restarts the job, which resumes from its latest
    checkpoint and matches the uninterrupted run bit for bit."""
    dump = tmp_path / "killed"
    rc, out, err = kill_worker_when(
        dump,
        STEPS,
        lambda: max(logged_steps(dump), default=0) >= 4,
        "step 4",
        "--data.num_workers=2",
        victim=loader_worker_of,
    )
    assert rc == 0, err[-3000:]
    lines = [line for line in (out + err).splitlines() if "a loader worker is gone" in line]
    assert len(lines) == 1, (out + err)[-3000:]  # once, from the rank whose worker died
    assert lines[0].startswith("error: data.num_workers=2: a loader worker is gone (pid ")
    assert "died of SIGKILL (out of host memory, or killed)" in lines[0]
    # rank 1 (whose worker died) prints no traceback; rank 0's is gloo's closed connection
    assert "[rank1]: Traceback" not in out + err, (out + err)[-3000:]
    # the rank notices at the batch the dead worker owed (within torch's 5 s status interval):
    # the restart resumes from the checkpoint before it, step-3 or step-6
    assert re.search(rf"resumed from {dump / 'checkpoint'}/step-[36] ", out), out[-3000:]
    assert logged_steps(dump) == whole
