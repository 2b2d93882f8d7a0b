"""A worker killed under a real torchrun (./run_train.sh, job.max_restarts=1): torchrun restarts
the job, it resumes from its latest checkpoint, and every step's loss equals an uninterrupted
run's. benchmarks/restart_trials.py repeats the kill many times."""

from torchrun_kill import kill_worker_and_resume, logged_steps, run

STEPS = 8


def test_killed_worker_restarts_and_matches_an_uninterrupted_run(tmp_path):
    rc, _, err = run(tmp_path / "whole", STEPS)
    assert rc == 0, err[-3000:]
    whole = logged_steps(tmp_path / "whole")
    assert sorted(whole) == list(range(1, STEPS + 1))

    rc, out, err = kill_worker_and_resume(tmp_path / "killed", STEPS, kill_after=4)
    assert rc == 0, err[-3000:]
    assert "resumed from" in out, out[-3000:]  # the restarted job read a checkpoint
    killed = logged_steps(tmp_path / "killed")
    assert killed == whole  # every step once, bit-exact (same layout, CPU)
