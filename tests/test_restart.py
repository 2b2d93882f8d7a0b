"""A worker killed under a real torchrun (./run_train.sh, job.max_restarts=1) while an async
checkpoint is being written: torchrun restarts the job, `latest` still names a checkpoint that
loads, the job resumes from it and every step's loss equals an uninterrupted run's.
benchmarks/restart_trials.py repeats the kill (synchronous checkpoints) many times."""

from torchrun_kill import kill_worker_when, logged_steps, run

STEPS = 8


def test_a_kill_during_an_async_save_restarts_from_a_latest_that_loads(tmp_path):
    """checkpoint.async_mode='async', a checkpoint every 3 steps: a worker is killed as soon as
    step 6's save has begun writing (its folder exists; it is committed only at step 7's
    boundary, a whole step later, which the 10 ms poll does not miss); the restarted job passes
    over step-6, resumes from step-3 and matches the uninterrupted synchronous run bit for bit
    (same layout, CPU)."""
    rc, _, err = run(tmp_path / "whole", STEPS)
    assert rc == 0, err[-3000:]
    whole = logged_steps(tmp_path / "whole")
    assert sorted(whole) == list(range(1, STEPS + 1))

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
