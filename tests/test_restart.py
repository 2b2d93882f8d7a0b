"""A worker killed under a real torchrun (./run_train.sh, job.max_restarts=1): torchrun restarts
the job, it resumes from its latest checkpoint, and every step's loss equals an uninterrupted
run's; killed while an async checkpoint is being written, `latest` still names one that loads.
benchmarks/restart_trials.py repeats the kill many times."""

import pytest
from torchrun_kill import kill_worker_and_resume, kill_worker_when, logged_steps, run

STEPS = 8


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    dump = tmp_path_factory.mktemp("whole")
    rc, _, err = run(dump, STEPS)
    assert rc == 0, err[-3000:]
    steps = logged_steps(dump)
    assert sorted(steps) == list(range(1, STEPS + 1))
    return steps


def test_killed_worker_restarts_and_matches_an_uninterrupted_run(tmp_path, whole):
    rc, out, err = kill_worker_and_resume(tmp_path / "killed", STEPS, kill_after=4)
    assert rc == 0, err[-3000:]
    assert "resumed from" in out, out[-3000:]  # the restarted job read a checkpoint
    killed = logged_steps(tmp_path / "killed")
    assert killed == whole  # every step once, bit-exact (same layout, CPU)


def test_a_kill_during_an_async_save_leaves_a_latest_that_loads(tmp_path, whole):
    """checkpoint.async_mode='async', a checkpoint every 3 steps: a worker is killed while step
    6's save is being written (its folder exists, it is not committed); the restarted job passes
    over step-6 and resumes from step-3, and matches the uninterrupted synchronous run."""
    dump = tmp_path / "killed"
    step6 = dump / "checkpoint" / "step-6"
    rc, out, err = kill_worker_when(
        dump, STEPS, step6.is_dir, "step 6's save", "--checkpoint.async_mode=async"
    )
    assert rc == 0, err[-3000:]
    assert "step-6 is unusable: no manifest.json" in out + err, (out + err)[-3000:]
    assert f"resumed from {dump / 'checkpoint' / 'step-3'}" in out, out[-3000:]
    assert logged_steps(dump) == whole
    assert (dump / "checkpoint" / "latest").read_text().strip() == str(STEPS)
